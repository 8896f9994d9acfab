"""Builds the C++ CPU extension once per test session, by two processes at once.

Both test modules that need the extension ask :func:`session_cache` for a cache folder in
the session's temporary directory. The first call starts two fresh Python processes that
call ``get_extension("cpu")`` at the same moment on that empty folder: one compiles under the
build lock, the other waits and loads the result. Later calls (and other modules) only load.
Under pytest-xdist the folder and the two processes' reports are shared by the workers of
the run: the first worker to ask builds, under a file lock, and the others wait and reuse.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from amp_fused_ops.extensions import _build as ext_build
from amp_fused_ops.extensions import _loader

# Run in each child: report whether the extension loaded and whether this process compiled.
_CHILD = """
import json, logging
from amp_fused_ops.extensions import _loader

class Recorder(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []
    def emit(self, record):
        self.messages.append(record.getMessage())

recorder = Recorder()
logging.getLogger("amp_fused_ops").addHandler(recorder)
logging.getLogger("amp_fused_ops").setLevel(logging.INFO)
ext = _loader.get_extension("cpu")
print("RESULT " + json.dumps({
    "loaded": ext is not None,
    "compiled": any(m.startswith("compiling amp_fused_ops CPU") for m in recorder.messages),
    "messages": recorder.messages,
}))
"""


@dataclass(frozen=True)
class SessionBuild:
    """Where the session's extension lives and what the two building processes reported."""

    cache: Path
    reports: tuple[dict[str, object], ...]


_builds: dict[Path, SessionBuild] = {}


def child_env(cache: Path, **extra: str) -> dict[str, str]:
    """Environment for a child Python that imports this checkout's amp_fused_ops."""
    env = dict(os.environ)
    src = str(Path(_loader.__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    env[_loader.CACHE_ENV] = str(cache)
    env.pop(_loader.DISABLE_ENV, None)
    env.update(extra)
    return env


def _shared_folder(factory: pytest.TempPathFactory) -> Path:
    """The session's temporary folder; under pytest-xdist, the one all workers of the run share."""
    base = factory.getbasetemp()
    # Each xdist worker's base is <run folder>/popen-gw<N>.
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def _build_in_two_processes(cache: Path) -> tuple[dict[str, object], ...]:
    children = [
        subprocess.Popen(
            [sys.executable, "-c", _CHILD],
            env=child_env(cache),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(2)
    ]
    reports = []
    for child in children:
        # A hang guard, not a speed check: a first compile on a loaded 2-core machine has
        # taken over 7 minutes.
        output, _ = child.communicate(timeout=3600)
        lines = [line for line in output.splitlines() if line.startswith("RESULT ")]
        if child.returncode != 0 or not lines:
            pytest.fail(f"building the CPU extension failed (exit {child.returncode}):\n{output}")
        reports.append(json.loads(lines[-1].removeprefix("RESULT ")))
    return tuple(reports)


def session_cache(factory: pytest.TempPathFactory) -> SessionBuild:
    """Build the CPU extension in this session's cache folder (once) and describe the build."""
    shared = _shared_folder(factory)
    cache = shared / "amp_fused_ops_cache"
    if cache in _builds:
        return _builds[cache]
    missing = _loader._missing_tools_reason("cpu")
    if missing is not None:
        pytest.skip(f"cannot build the CPU extension here: {missing}")
    record = shared / "amp_fused_ops_session_build.json"
    with open(shared / "amp_fused_ops_session_build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if record.exists():  # another worker of this run built it
            reports = tuple(json.loads(record.read_text()))
        else:
            reports = _build_in_two_processes(cache)
            record.write_text(json.dumps(list(reports)))
    _builds[cache] = SessionBuild(cache, reports)
    return _builds[cache]


def load_from(cache: Path) -> object:
    """Load the extension from ``cache`` (never compiles: the session build made it)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(_loader.CACHE_ENV, str(cache))
        patch.delenv(_loader.DISABLE_ENV, raising=False)
        patch.setattr(ext_build, "compile_extension", _no_compile)
        _loader.clear_cache()  # the loader decides once per process: look in `cache` now
        ext = _loader.get_extension("cpu")
    assert ext is not None, "the session build should have left a loadable extension"
    return ext


def _no_compile(kind: str, build_dir: Path) -> object:
    raise AssertionError(f"the {kind} extension was compiled again in {build_dir}")
