"""The build lock: one process compiles a kind while the others wait, visibly and not forever.

The builder holds an exclusive ``flock`` on ``amp_fused_ops.lock`` in the build folder and
writes beside it ``amp_fused_ops.lock.json``: its pid, host, since when it builds and how far
it got. Waiters poll the lock, log who holds it and keep logging while they wait; after
``$AMP_FUSED_OPS_LOCK_TIMEOUT`` seconds (default 1800) they give up, and the caller uses the
reference path. A builder that dies releases the lock with its file descriptor.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ._settings import LOCK, LOCK_INFO, LOCK_TIMEOUT_ENV, ExtensionUnavailableError

logger = logging.getLogger(__name__)

POLL_SECONDS = 0.25
"""How often a waiter tries the lock again."""
PROGRESS_SECONDS = 30.0
"""How often a waiter says it is still waiting."""


class LockTimeoutError(ExtensionUnavailableError):
    """Another process held the build lock for longer than the timeout."""


@contextlib.contextmanager
def build_lock(build_dir: Path, kind: str, *, timeout: float) -> Iterator[None]:
    """Hold the build lock of ``build_dir`` (a no-op where there is no ``fcntl``).

    Args:
        build_dir: The build folder (it must exist and be writable).
        kind: The extension kind being built, for the messages.
        timeout: Seconds to wait for another holder before giving up.

    Raises:
        LockTimeoutError: If another process held the lock for ``timeout`` seconds.
        OSError: If the lock file cannot be opened.
    """
    try:
        import fcntl
    except ImportError:  # Windows: rely on torch's own lock file
        yield
        return
    with open(build_dir / LOCK, "a+") as handle:
        _acquire(handle.fileno(), build_dir, kind, timeout)
        try:
            now = time.time()
            info = {"pid": os.getpid(), "host": socket.gethostname(), "since": now}
            write_info(build_dir, {**info, "kind": kind, "progress": "starting"})
            yield
        finally:
            (build_dir / LOCK_INFO).unlink(missing_ok=True)
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _acquire(fd: int, build_dir: Path, kind: str, timeout: float) -> None:
    import fcntl

    start = time.monotonic()
    next_line = 0.0
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        waited = time.monotonic() - start
        holder = describe_holder(build_dir)
        if waited >= timeout:
            pid = read_info(build_dir).get("pid", "<pid>")
            raise LockTimeoutError(
                f"gave up after {waited:.0f} s waiting for the build lock of {build_dir}: "
                f"{holder}. If that process is stuck, stop it (`kill {pid}`) and run "
                f"`python -m amp_fused_ops build`; to wait longer, set {LOCK_TIMEOUT_ENV} "
                f"(seconds, now {timeout:g})"
            )
        if waited >= next_line:
            first = next_line == 0.0
            logger.warning(
                "%s for the %s extension: %s; waiting up to %.0f s more (%s)",
                "waiting for another process's build"
                if first
                else f"still waiting ({waited:.0f} s)",
                kind.upper(),
                holder,
                timeout - waited,
                LOCK_TIMEOUT_ENV,
            )
            next_line = waited + PROGRESS_SECONDS
        time.sleep(min(POLL_SECONDS, max(0.01, timeout - waited)))


def read_info(build_dir: Path) -> dict[str, Any]:
    """What the holder of the lock wrote about itself (empty when nothing readable)."""
    try:
        info = json.loads((build_dir / LOCK_INFO).read_text())
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def write_info(build_dir: Path, info: dict[str, Any]) -> None:
    """Replace the lock-info file atomically (waiters may read it at any moment)."""
    tmp = build_dir / f"{LOCK_INFO}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(info))
    tmp.replace(build_dir / LOCK_INFO)


def update_progress(build_dir: Path, progress: str) -> None:
    """Record how far this process's build got, for the processes waiting on it."""
    info = read_info(build_dir)
    if info.get("pid") == os.getpid():
        with contextlib.suppress(OSError):
            write_info(build_dir, {**info, "progress": progress})


def describe_holder(build_dir: Path) -> str:
    """One phrase: which process holds the lock of ``build_dir``, since when, how far it got."""
    info = read_info(build_dir)
    if "pid" not in info:
        return f"another process holds {build_dir / LOCK} (it has not said who it is yet)"
    since = float(info.get("since", time.time()))
    clock = datetime.datetime.fromtimestamp(since).strftime("%H:%M:%S")
    where = f"process {info['pid']} on {info.get('host', '?')}"
    state = _process_state(info) or ""
    return (
        f"{where}{state} has been building it since {clock} ({time.time() - since:.0f} s ago; "
        f"progress: {info.get('progress', 'unknown')})"
    )


def _process_state(info: dict[str, Any]) -> str | None:
    """`` (stopped)`` when the holder runs on this host and is stopped (SIGSTOP, a debugger)."""
    if info.get("host") != socket.gethostname():
        return None
    try:
        stat = Path(f"/proc/{int(info['pid'])}/stat").read_text()
    except (OSError, ValueError):
        return None
    state = stat.rpartition(")")[2].split()[:1]
    return " (stopped)" if state in (["T"], ["t"]) else None
