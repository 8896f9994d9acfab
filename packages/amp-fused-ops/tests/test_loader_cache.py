"""A damaged, locked, unwritable or corrupt cache never kills, hangs or silently breaks a run.

Most tests copy the session's real CPU build (see ``_cpu_extension_helpers``) into a
temporary cache, damage it, and run the real loader in a fresh Python process: the first op
must exit 0 with the right numbers, on the compiled or the reference path, and the log must
say what happened and what to do. Where a test needs the loader to compile, it either patches
``torch.utils.cpp_extension.load`` in this process (fast) or compiles for real (``slow``).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from _cpu_extension_helpers import (
    SessionBuild,
    child_env,
    copy_build,
    own_messages,
    session_cache,
)
from amp_fused_ops import __version__
from amp_fused_ops.extensions import _api as api
from amp_fused_ops.extensions import _build as ext_build
from amp_fused_ops.extensions import _loader
from amp_fused_ops.extensions import _lock as lock
from amp_fused_ops.extensions import _progress as progress
from amp_fused_ops.extensions import _toolkit as ext_toolkit

MARKER = "amp_fused_ops_build.json"
LOCK_INFO = "amp_fused_ops.lock.json"
TIMEOUT = 1800  # seconds for a child that may compile on a loaded machine (a hang still fails)

# Runs the first op of a fresh process: multi_tensor_scale by 0.5 of values that halve exactly.
_FIRST_OP = """
import json, logging, torch
from amp_fused_ops import amp_C, multi_tensor_applier
from amp_fused_ops.extensions import _loader

class Recorder(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []
    def emit(self, record):
        self.messages.append((record.levelname, record.getMessage()))

recorder = Recorder()
logging.getLogger("amp_fused_ops").addHandler(recorder)
logging.getLogger("amp_fused_ops").setLevel(logging.INFO)
SETUP
src = [torch.arange(1, 40001, dtype=torch.float32) * 2.0, torch.full((7,), 6.0)]
dst = [torch.empty_like(t) for t in src]
flag = torch.zeros(1, dtype=torch.int32)
multi_tensor_applier(amp_C.multi_tensor_scale, flag, [src, dst], 0.5)
correct = all(torch.equal(d, s / 2) for s, d in zip(src, dst)) and int(flag) == 0
print("RESULT " + json.dumps({
    "correct": correct,
    "compiled": _loader.get_extension("cpu") is not None,
    "messages": recorder.messages,
}))
"""


@pytest.fixture(scope="module")
def build(tmp_path_factory: pytest.TempPathFactory) -> SessionBuild:
    return session_cache(tmp_path_factory)


@pytest.fixture(autouse=True)
def fresh_loader(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv(_loader.DISABLE_ENV, raising=False)
    monkeypatch.setattr(api, "_loaded", {})  # as in a process that has loaded nothing yet
    _loader.clear_cache()
    yield
    _loader.clear_cache()


def copy_cache(build: SessionBuild, tmp_path: Path) -> tuple[Path, Path]:
    """A private copy of the session's cache: (cache root, the built module in it)."""
    cache = tmp_path / "cache"
    copy_build(build.cache, cache)
    (module,) = cache.glob("cpu-*/amp_fused_ops_cpu*.so")
    return cache, module


def text_section(path: Path) -> tuple[int, int]:
    """File offset and size of the ``.text`` section of a 64-bit little-endian ELF file."""
    data = path.read_bytes()
    assert data[:4] == b"\x7fELF" and data[4] == 2 and data[5] == 1, "not an ELF64 LE file"
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)

    def section(index: int) -> tuple[int, int, int]:
        name, _, _, _, offset, size = struct.unpack_from("<IIQQQQ", data, shoff + index * shentsize)
        return name, offset, size

    _, strings, _ = section(shstrndx)
    for index in range(shnum):
        name, offset, size = section(index)
        if data[strings + name : data.index(b"\0", strings + name)] == b".text":
            return offset, size
    raise AssertionError(f"no .text section in {path}")


def damage(module: Path, how: str) -> None:
    """Truncate ``module`` to half its size, or overwrite its code with breakpoints."""
    if how == "truncate":
        os.truncate(module, module.stat().st_size // 2)
        return
    offset, size = text_section(module)
    with open(module, "r+b") as handle:
        handle.seek(offset)
        handle.write(b"\xcc" * size)  # int3: SIGTRAP wherever the code runs


def run_child(
    cache: Path, code: str, *, prefix: tuple[str, ...] = (), **env: str
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any] | None]:
    """Run ``code`` in a fresh Python on ``cache``; return the process and its RESULT line."""
    result = subprocess.run(
        [*prefix, sys.executable, "-c", code],
        env=child_env(cache, **env),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    report = json.loads(lines[-1].removeprefix("RESULT ")) if lines else None
    return result, report


def first_op(cache: Path, setup: str = "", **env: str) -> dict[str, Any]:
    """Run the first op in a fresh process; it must exit 0 with correct numbers."""
    result, report = run_child(cache, _FIRST_OP.replace("SETUP", setup), **env)
    assert result.returncode == 0, (result.returncode, result.stdout, result.stderr)
    assert report is not None and report["correct"], result.stdout
    return report


def cli(cache: Path, *args: str, prefix: tuple[str, ...] = (), **env: str) -> Any:
    return subprocess.run(
        [*prefix, sys.executable, "-m", "amp_fused_ops", *args],
        env=child_env(cache, **env),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )


def warnings_of(report: dict[str, Any]) -> list[str]:
    return [message for level, message in report["messages"] if level == "WARNING"]


def fake_build(
    calls: list[list[str]], monkeypatch: pytest.MonkeyPatch, *, before: Any = None
) -> None:
    """Replace torch's build by one that records the build folder's files and writes a module."""
    from torch.utils import cpp_extension

    def fake_load(**kwargs: Any) -> ModuleType:
        folder = Path(str(kwargs["build_directory"]))
        # The lock holder's progress thread may be replacing its info file (through a
        # temporary file) at this moment: that file is the lock's, not a build leftover.
        names = (path.name for path in folder.iterdir())
        calls.append(sorted(n for n in names if not n.startswith("amp_fused_ops.lock.json.")))
        if before is not None:
            before(folder)
        built = folder / f"{kwargs['name']}.so"
        built.write_bytes(b"freshly built")
        module = ModuleType(str(kwargs["name"]))
        module.__file__ = str(built)
        return module

    monkeypatch.setattr(cpp_extension, "load", fake_load)


needs_tools = pytest.mark.skipif(
    _loader._missing_tools_reason("cpu") is not None,
    reason=f"cannot build the CPU extension here: {_loader._missing_tools_reason('cpu')}",
)


# --- a damaged module is never loaded -------------------------------------------------------


@pytest.mark.parametrize("how", ["truncate", "overwrite"])
def test_damaged_module_falls_back_when_it_cannot_be_rebuilt(
    how: str, build: SessionBuild, tmp_path: Path
) -> None:
    cache, module = copy_cache(build, tmp_path)
    damage(module, how)
    # No ninja in the child (the compiler is part of the cache key, ninja is not).
    report = first_op(
        cache,
        "from amp_fused_ops.extensions import _toolkit as toolkit\n"
        "toolkit.ninja_path = lambda: None",
    )
    assert not report["compiled"]  # the reference path ran, and nothing crashed
    (line,) = warnings_of(report)
    assert line.startswith("amp_fused_ops CPU extension unavailable, using the PyTorch ")
    assert f"the compiled module in {module.parent} does not match its build record" in line
    expected = "bytes, the build wrote" if how == "truncate" else "SHA-256 of"
    assert expected in line and "it cannot be compiled again: ninja is not installed" in line


@pytest.mark.parametrize("how", ["truncate", "overwrite"])
def test_info_does_not_call_a_damaged_module_built(
    how: str, build: SessionBuild, tmp_path: Path
) -> None:
    cache, module = copy_cache(build, tmp_path)
    damage(module, how)
    result = cli(cache, "info")
    assert result.returncode == 0, result.stderr
    assert "cpu extension: not built (the compiled module in " in result.stdout
    assert "compiled again on first use" in result.stdout


def test_damaged_module_is_rebuilt_from_scratch(
    build: SessionBuild,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    cache, module = copy_cache(build, tmp_path)
    damage(module, "truncate")
    monkeypatch.setenv(_loader.CACHE_ENV, str(cache))
    calls: list[list[str]] = []
    fake_build(calls, monkeypatch)
    with caplog.at_level(logging.WARNING, logger="amp_fused_ops"):
        ext = _loader.get_extension("cpu")
    assert ext is not None and ext.__file__ == str(module)
    # ninja found nothing to take for up to date: no module, no object, no build file.
    assert calls == [["amp_fused_ops.lock", "amp_fused_ops.lock.json"]]
    damaged, compiling = own_messages(caplog)
    assert damaged.startswith(f"the compiled module in {module.parent} does not match")
    assert damaged.endswith("; compiling it again from scratch")
    assert compiling.startswith("compiling amp_fused_ops CPU extension (rebuilding from scratch")
    record = json.loads((module.parent / MARKER).read_text())
    assert record["size"] == len(b"freshly built") and record["file"] == module.name
    assert not (module.parent / LOCK_INFO).exists()  # removed with the lock


def test_build_force_starts_from_an_empty_folder(
    build: SessionBuild, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache, module = copy_cache(build, tmp_path)
    monkeypatch.setenv(_loader.CACHE_ENV, str(cache))
    (module.parent / "lock").write_text("")  # torch's baton, as a killed build leaves it
    calls: list[list[str]] = []
    fake_build(calls, monkeypatch)
    assert _loader.build_extension("cpu", force=True) == module
    assert calls == [["amp_fused_ops.lock", "amp_fused_ops.lock.json"]]


def test_build_command_force_replaces_an_overwritten_module(
    build: SessionBuild,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from amp_fused_ops.__main__ import main

    cache, module = copy_cache(build, tmp_path)
    damage(module, "overwrite")
    monkeypatch.setenv(_loader.CACHE_ENV, str(cache))
    calls: list[list[str]] = []
    fake_build(calls, monkeypatch)
    assert main(["build", "cpu", "--force"]) == 0
    assert f"cpu extension: built {module}" in capsys.readouterr().out
    assert calls == [["amp_fused_ops.lock", "amp_fused_ops.lock.json"]]  # from an empty folder
    record = json.loads((module.parent / MARKER).read_text())
    assert record["size"] == len(b"freshly built") and record["file"] == module.name


@pytest.mark.slow
@pytest.mark.extended
@needs_tools
def test_damaged_module_recovers_for_real(build: SessionBuild, tmp_path: Path) -> None:
    # The first op of a process compiles a truncated module again, from an emptied folder,
    # and runs on it. One real compile: `build --force` empties the folder and compiles the
    # same way (test_build_command_force_replaces_an_overwritten_module). CI leaves it out:
    # test_damaged_module_is_rebuilt_from_scratch runs the same recovery with a stand-in
    # compiler, and the run's session build is the real compile from an empty folder.
    cache, module = copy_cache(build, tmp_path)
    damage(module, "truncate")
    report = first_op(cache)
    assert report["compiled"], report["messages"]
    assert any("compiling it again from scratch" in m for m in warnings_of(report))
    # The next process loads the rebuilt module: no compile, no warning.
    again = first_op(
        cache,
        "from amp_fused_ops.extensions import _build as build; build.compile_extension = None",
    )
    assert again["compiled"] and not warnings_of(again)
    record = json.loads((module.parent / MARKER).read_text())
    assert module.stat().st_size == record["size"]


# --- a stuck builder does not hang the others -----------------------------------------------

_HOLDER = """
import time
from amp_fused_ops.extensions import _cache as cache, _lock as lock
folder = cache.build_directory("cpu")
folder.mkdir(parents=True, exist_ok=True)
with lock.build_lock(folder, "cpu", timeout=0):
    print("HELD", flush=True)
    time.sleep(600)
"""


@pytest.fixture
def stopped_holder(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    """A process that took the build lock of an empty cache and was then stopped (SIGSTOP)."""
    cache = tmp_path / "cache"
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER],
        env=child_env(cache),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "HELD"
        os.kill(holder.pid, signal.SIGSTOP)
        yield cache, holder.pid
    finally:
        holder.kill()
        holder.wait(timeout=60)


@needs_tools
def test_waiter_says_who_holds_the_lock_then_falls_back(
    stopped_holder: tuple[Path, int],
) -> None:
    cache, pid = stopped_holder
    setup = "from amp_fused_ops.extensions import _lock as lock; lock.PROGRESS_SECONDS = 1.0"
    report = first_op(cache, setup, AMP_FUSED_OPS_LOCK_TIMEOUT="4")
    assert not report["compiled"]
    lines = warnings_of(report)
    assert lines[0].startswith(
        f"waiting for another process's build for the CPU extension: process {pid} on "
    )
    assert "(stopped) has been building it since " in lines[0]
    assert "progress: starting" in lines[0] and "AMP_FUSED_OPS_LOCK_TIMEOUT" in lines[0]
    assert any(line.startswith("still waiting (") for line in lines[1:-1]), lines
    assert lines[-1].startswith("amp_fused_ops CPU extension unavailable, using the PyTorch")
    assert "gave up after " in lines[-1] and f"stop it (`kill {pid}`)" in lines[-1]
    assert "to wait longer, set AMP_FUSED_OPS_LOCK_TIMEOUT (seconds, now 4)" in lines[-1]


@needs_tools
def test_build_command_gives_up_on_a_stuck_lock(stopped_holder: tuple[Path, int]) -> None:
    cache, pid = stopped_holder
    result = cli(cache, "build", "cpu", AMP_FUSED_OPS_LOCK_TIMEOUT="1")
    assert result.returncode == 1
    assert "cpu extension: FAILED: gave up after " in result.stderr
    assert f"kill {pid}" in result.stderr and "Traceback" not in result.stderr


def test_bad_lock_timeout_value_is_explained(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(_loader.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv(_loader.LOCK_TIMEOUT_ENV, "ten minutes")
    with pytest.raises(_loader.ExtensionUnavailableError, match="is not a number of seconds"):
        _loader.build_extension("cpu", force=True)


# --- an unwritable cache --------------------------------------------------------------------


@needs_tools
def test_unwritable_cache_names_the_variable_and_falls_back(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    cache = blocker / "cache"  # below a regular file: nothing can be created there
    report = first_op(cache)
    assert not report["compiled"]
    (line,) = warnings_of(report)
    assert f"the cache folder {cache}/cpu-" in line and "cannot be written" in line
    assert f"set by AMP_FUSED_OPS_CACHE={cache}" in line
    assert "Set AMP_FUSED_OPS_CACHE to a writable folder" in line
    info = cli(cache, "info")
    assert info.returncode == 0
    assert "cpu extension: unavailable (the cache folder " in info.stdout
    assert "compiles on first use" not in info.stdout
    forced = cli(cache, "build", "cpu", "--force")
    assert forced.returncode == 1
    assert "cpu extension: FAILED: the cache folder " in forced.stderr
    assert "Traceback" not in forced.stderr + forced.stdout


def _without_write_access(folder: Path) -> tuple[str, ...]:
    """Make ``folder`` read-only for child processes; return the command prefix they need.

    Root ignores permissions, so a root test drops the capabilities that let it (setpriv).
    """
    for path in [folder, *folder.rglob("*")]:
        path.chmod(path.stat().st_mode & ~0o222)
    prefix: tuple[str, ...] = ()
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("running as root without setpriv: cannot make a folder read-only")
        prefix = (setpriv, "--bounding-set=-dac_override,-dac_read_search,-fowner")
    probe = subprocess.run(
        [*prefix, sys.executable, "-c", f"open({str(folder / 'probe')!r}, 'w')"],
        capture_output=True,
        timeout=120,
    )
    if probe.returncode == 0:
        pytest.skip("cannot take write access to a folder away here")
    return prefix


@needs_tools
def test_read_only_cache_loads_and_build_force_fails_cleanly(
    build: SessionBuild, tmp_path: Path
) -> None:
    cache, module = copy_cache(build, tmp_path)
    try:
        prefix = _without_write_access(cache)
        result, report = run_child(cache, _FIRST_OP.replace("SETUP", ""), prefix=prefix)
        assert result.returncode == 0 and report is not None, result.stderr
        assert report["correct"] and report["compiled"]  # a shared read-only cache works
        info = cli(cache, "info", prefix=prefix)
        assert f"cpu extension: built (cached: {module})" in info.stdout
        forced = cli(cache, "build", "cpu", "--force", prefix=prefix)
        assert forced.returncode == 1
        assert f"cpu extension: FAILED: the cache folder {module.parent} cannot be" in (
            forced.stderr
        )
        assert "Set AMP_FUSED_OPS_CACHE to a writable folder" in forced.stderr
        assert "Traceback" not in forced.stderr + forced.stdout
        assert module.stat().st_size == json.loads((module.parent / MARKER).read_text())["size"]
    finally:
        for path in [cache, *cache.rglob("*")]:
            path.chmod(path.stat().st_mode | 0o200)


# --- a corrupt build record -----------------------------------------------------------------


def test_corrupt_build_record_gets_a_hint_and_is_rebuilt(
    build: SessionBuild,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    cache, module = copy_cache(build, tmp_path)
    (module.parent / MARKER).write_text('{"file": "amp_fused_ops_cp')
    monkeypatch.setenv(_loader.CACHE_ENV, str(cache))
    status = _loader.extension_status("cpu")
    assert status.state == "not built"
    assert f"the build record {module.parent / MARKER} is unreadable (JSONDecodeError" in (
        status.detail
    )
    assert "cut short (a full disk or a killed process)" in status.detail
    assert "python -m amp_fused_ops build --force" in status.detail
    calls: list[list[str]] = []
    fake_build(calls, monkeypatch)
    with caplog.at_level(logging.WARNING, logger="amp_fused_ops"):
        assert _loader.get_extension("cpu") is not None
    assert len(calls) == 1
    assert "is unreadable (JSONDecodeError" in own_messages(caplog)[0]
    assert json.loads((module.parent / MARKER).read_text())["file"] == module.name


# --- progress and estimate ------------------------------------------------------------------


def _wait_for(caplog: pytest.LogCaptureFixture, text: str) -> None:
    deadline = time.monotonic() + 120
    while not any(text in r.getMessage() for r in caplog.records):
        assert time.monotonic() < deadline, f"no log line with {text!r}"
        time.sleep(0.02)


def test_compile_logs_ninja_steps_and_a_heartbeat(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(_loader.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(progress, "POLL_SECONDS", 0.02)
    monkeypatch.setattr(progress, "HEARTBEAT_SECONDS", 0.2)
    csrc = _loader.source_dir()
    assert csrc is not None
    units = sorted(p.stem for folder in ("cpu", "common") for p in (csrc / folder).glob("*.cpp"))

    def ninja(folder: Path) -> None:
        log = folder / ".ninja_log"
        log.write_text("# ninja log v5\n")
        with open(log, "a") as handle:
            handle.write(f"1\t9\t0\t{units[0]}.o\tabc\n")
        _wait_for(caplog, f"[1/{len(units) + 1}] CPU extension: built {units[0]}.o")
        deadline = time.monotonic() + 120  # waiters read the progress from the lock info
        while not lock.read_info(folder).get("progress", "").startswith("[1/"):
            assert time.monotonic() < deadline, lock.read_info(folder)
            time.sleep(0.02)
        assert lock.read_info(folder)["pid"] == os.getpid()
        _wait_for(caplog, "still compiling the CPU extension: ")

    fake_build([], monkeypatch, before=ninja)
    with caplog.at_level(logging.WARNING, logger="amp_fused_ops"):
        assert _loader.get_extension("cpu") is not None
    heartbeat = next(r.getMessage() for r in caplog.records if "still compiling" in r.getMessage())
    assert f"1 of {len(units) + 1} steps done" in heartbeat and "(estimate " in heartbeat


def test_estimate_follows_the_work_the_cores_and_the_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(_loader.CACHE_ENV, str(tmp_path))
    monkeypatch.delenv("MAX_JOBS", raising=False)
    monkeypatch.setattr(progress, "usable_cores", lambda: 2)
    monkeypatch.setattr(os, "getloadavg", lambda: (1.0, 1.0, 1.0))
    per_unit = progress.SECONDS_PER_UNIT["cpu"]
    assert progress.estimate_seconds("cpu", 5) == 3 * per_unit  # 5 units, 2 at a time
    assert progress.estimate_seconds("cpu", 2) == per_unit
    monkeypatch.setenv("MAX_JOBS", "1")
    assert progress.estimate_seconds("cpu", 5) == 5 * per_unit
    monkeypatch.delenv("MAX_JOBS")
    monkeypatch.setattr(os, "getloadavg", lambda: (6.0, 6.0, 6.0))  # 3 processes per core
    assert progress.estimate_seconds("cpu", 5) == 9 * per_unit
    assert "5 units, 2 at a time on 2 cores, load 6.0" in progress.describe_estimate("cpu", 5)
    # A build measured on this machine (40 s for 2 rounds at load factor 2: 10 s per unit).
    folder = tmp_path / "cpu-earlier"
    folder.mkdir()
    record = {"seconds": 40.0, "units": 4, "jobs": 2, "load": 2.0}
    (folder / MARKER).write_text(json.dumps(record))
    assert progress.estimate_seconds("cpu", 5) == 10.0 * 3 * 3


# --- the command line and the hot path ------------------------------------------------------


def test_version_flag_and_info_show_the_package_version(tmp_path: Path) -> None:
    version = cli(tmp_path, "--version")
    assert version.returncode == 0, version.stderr
    assert version.stdout.startswith(f"amp-fused-ops {__version__} (torch ")
    info = cli(tmp_path, "info")
    assert info.stdout.startswith(f"amp-fused-ops: {__version__}\n")


class _NoEnvironment(dict):  # type: ignore[type-arg]
    def __getitem__(self, key: object) -> Any:
        raise AssertionError(f"the hot path read the environment variable {key}")

    def get(self, key: object, default: object = None) -> Any:
        raise AssertionError(f"the hot path read the environment variable {key}")


class _NoLock:
    def __enter__(self) -> None:
        raise AssertionError("the hot path took the loader's lock")

    def __exit__(self, *args: object) -> None:
        pass


def test_calls_after_the_first_read_no_environment_and_take_no_lock(
    build: SessionBuild, monkeypatch: pytest.MonkeyPatch
) -> None:
    from amp_fused_ops import amp_C

    monkeypatch.setenv(_loader.CACHE_ENV, str(build.cache))
    monkeypatch.setattr(
        ext_build, "compile_extension", lambda kind, folder: pytest.fail("compiled")
    )
    ext = _loader.get_extension("cpu")
    assert ext is not None
    import torch

    tensors = [[torch.ones(3)], [torch.empty(3)]]
    with monkeypatch.context() as patch:  # undone before the fixtures clear the loader
        patch.setattr(os, "environ", _NoEnvironment())
        patch.setattr(api, "_lock", _NoLock())
        assert _loader.get_extension("cpu") is ext
        amp_C.multi_tensor_scale(64, torch.zeros(1, dtype=torch.int32), tensors, 2.0)
        assert torch.equal(tensors[1][0], torch.full((3,), 2.0))


def test_clear_cache_reads_the_environment_again(
    build: SessionBuild, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(_loader.CACHE_ENV, str(build.cache))
    monkeypatch.setenv(_loader.DISABLE_ENV, "cpu")
    assert _loader.get_extension("cpu") is None  # read before anything was loaded
    monkeypatch.delenv(_loader.DISABLE_ENV)
    assert _loader.get_extension("cpu") is None  # decided for this process
    _loader.clear_cache()
    assert _loader.get_extension("cpu") is not None
    assert _loader.unavailable_reason("cpu") is None


def test_disable_after_loading_tells_the_truth(
    build: SessionBuild,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from amp_fused_ops.__main__ import main

    # A C++ registration cannot be undone: the loaded kernels keep serving the ops, so the
    # loader must not claim the reference path runs; use_reference() is the way there.
    monkeypatch.setenv(_loader.CACHE_ENV, str(build.cache))
    ext = _loader.get_extension("cpu")
    assert ext is not None
    monkeypatch.setenv(_loader.DISABLE_ENV, "1")
    _loader.clear_cache()
    with caplog.at_level(logging.INFO, logger="amp_fused_ops"):
        assert _loader.get_extension("cpu") is ext
        assert _loader.get_extension("cpu") is ext
    lines = own_messages(caplog)
    assert lines == [
        "amp_fused_ops CPU extension: disabled by AMP_FUSED_OPS_DISABLE=1, but it was loaded "
        "earlier in this process and its kernels stay registered with the dispatcher, so the "
        "ops keep running them; use `with amp_fused_ops.extensions.use_reference():` to run "
        "the PyTorch reference path in this process, or set AMP_FUSED_OPS_DISABLE before the "
        "first op"
    ]
    assert not any("using the PyTorch reference path" in line for line in lines)
    assert _loader.unavailable_reason("cpu") is None
    status = _loader.extension_status("cpu")
    assert (status.state, status.path) == ("built", Path(str(ext.__file__)))
    assert "disabled by AMP_FUSED_OPS_DISABLE=1, but it was loaded earlier" in status.detail
    # What `python -m amp_fused_ops info` prints in this process, and in a new one (where the
    # variable is read before the first op, and holds).
    capsys.readouterr()
    main(["info"])
    assert f"cpu extension: built ({ext.__file__}: disabled by" in capsys.readouterr().out
    env = child_env(build.cache, **{_loader.DISABLE_ENV: "1"})
    done = subprocess.run(
        [sys.executable, "-m", "amp_fused_ops", "info"],
        env=env, capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    assert (
        "cpu extension: unavailable (disabled by AMP_FUSED_OPS_DISABLE=1; unset it to use the "
        "compiled kernels)" in done.stdout
    )


def test_assigning_through_the_facade_reaches_the_module_that_uses_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from amp_fused_ops.extensions import _build as build_module
    from amp_fused_ops.extensions import _lookup as lookup
    from amp_fused_ops.extensions import _toolkit as toolkit

    monkeypatch.setattr(ext_toolkit, "ninja_path", lambda: None)
    monkeypatch.setattr(ext_build, "compile_extension", None)
    assert toolkit.ninja_path() is None and build_module.compile_extension is None
    assert "ninja is not installed" in str(lookup.missing_tools_reason("cpu"))
    monkeypatch.undo()
    assert build_module.compile_extension is not None


def test_lock_info_is_written_while_held_and_removed_after(tmp_path: Path) -> None:
    with lock.build_lock(tmp_path, "cpu", timeout=0):
        info = json.loads((tmp_path / LOCK_INFO).read_text())
        assert info["pid"] == os.getpid() and info["kind"] == "cpu"
        assert abs(info["since"] - time.time()) < 3600  # a wall-clock time, not a monotonic one
    assert not (tmp_path / LOCK_INFO).exists()
