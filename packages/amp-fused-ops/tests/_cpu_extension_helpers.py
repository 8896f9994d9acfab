"""The CPU extension of a test session: built once per run, or taken from the configured cache.

The test modules that need the extension ask :func:`session_cache` for a cache folder in the
session's temporary directory. When the configured cache (``$AMP_FUSED_OPS_CACHE`` or
``~/.cache/amp_fused_ops``) already holds a verified build of these sources, it is copied there
(the quick test tier compiles nothing on a machine that has built the extension once);
otherwise two fresh Python processes call ``get_extension("cpu")`` at the same moment on that
empty folder: one compiles under the build lock, the other waits and loads the result.
:func:`race_reports` gives what those two processes reported, racing for real in a folder of
its own when the session's build was a copy. Under pytest-xdist the folders and the reports
are shared by the workers of the run: the first worker to ask builds, under a file lock, and
the others wait and reuse.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from amp_fused_ops.extensions import _build as ext_build
from amp_fused_ops.extensions import _cache as ext_cache
from amp_fused_ops.extensions import _loader
from amp_fused_ops.extensions import _record as ext_record

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
    """Where the session's extension lives and what the two building processes reported
    (None: copied from the configured cache, nothing was built)."""

    cache: Path
    reports: tuple[dict[str, object], ...] | None


_builds: dict[Path, SessionBuild] = {}

# The CPU build folder of these sources in the cache the process was started with (tests
# change the variable for their own caches; this is the one the user's runs fill).
CONFIGURED_BUILD = ext_cache.build_directory("cpu").resolve()


def own_messages(caplog: pytest.LogCaptureFixture, level: int | None = None) -> list[str]:
    """The messages amp_fused_ops logged (at ``level`` only, when given), in order.

    Other loggers are left out: torch's own warn too (a CUDA build of torch on a machine without
    a GPU logs "No CUDA runtime is found" from ``torch.utils.cpp_extension`` at import).
    """
    return [
        r.getMessage()
        for r in caplog.records
        if r.name.split(".")[0] == "amp_fused_ops" and (level is None or r.levelno == level)
    ]


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


def copy_build(source: Path, target: Path) -> None:
    """Copy the build folder ``source`` into ``target`` (created or merged), without its locks."""
    shutil.copytree(source, target, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.lock*"))


def _copy_configured_build(cache: Path) -> bool:
    """Copy a verified build of the configured cache into ``cache``; False if there is none."""
    try:
        if ext_record.verified_module(CONFIGURED_BUILD) is None:
            return False
    except ext_record.DamagedBuildError:
        return False
    copy_build(CONFIGURED_BUILD, cache / CONFIGURED_BUILD.name)
    return True


def _once_per_run(
    factory: pytest.TempPathFactory, name: str, make: Callable[[Path], object]
) -> tuple[Path, object]:
    """``make(<run folder>/<name>)`` once per run (all xdist workers), and what it returned."""
    shared = _shared_folder(factory)
    cache = shared / name
    record = shared / f"{name}.json"
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if record.exists():  # another worker of this run made it
            return cache, json.loads(record.read_text())
        result = make(cache)
        record.write_text(json.dumps(result))
    return cache, result


def _skip_without_tools() -> None:
    missing = _loader._missing_tools_reason("cpu")
    if missing is not None:
        pytest.skip(f"cannot build the CPU extension here: {missing}")


def session_cache(factory: pytest.TempPathFactory) -> SessionBuild:
    """This session's cache folder with the CPU extension in it (copied or built, once)."""
    shared = _shared_folder(factory)
    if shared in _builds:
        return _builds[shared]
    _skip_without_tools()

    def make(cache: Path) -> object:
        if _copy_configured_build(cache):
            return None
        return list(_build_in_two_processes(cache))

    cache, reports = _once_per_run(factory, "amp_fused_ops_cache", make)
    _builds[shared] = SessionBuild(cache, None if reports is None else tuple(reports))
    return _builds[shared]


def race_reports(factory: pytest.TempPathFactory) -> tuple[dict[str, object], ...]:
    """What two processes that built the CPU extension at once into an empty folder reported:
    the session's build, or (when that was a copy) a build of their own, once per run."""
    build = session_cache(factory)
    if build.reports is not None:
        return build.reports
    _, reports = _once_per_run(
        factory, "amp_fused_ops_race_cache", lambda cache: list(_build_in_two_processes(cache))
    )
    return tuple(reports)  # type: ignore[arg-type]


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
