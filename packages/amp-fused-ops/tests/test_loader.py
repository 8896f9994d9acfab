"""The loader: just-in-time build, cache, lock, disable switch, failures and the CLI."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from _cpu_extension_helpers import SessionBuild, child_env, session_cache
from amp_fused_ops import _loader

OPS = ("multi_tensor_scale", "multi_tensor_axpby", "multi_tensor_l2norm", "multi_tensor_adam")


@pytest.fixture(scope="module")
def build(tmp_path_factory: pytest.TempPathFactory) -> SessionBuild:
    return session_cache(tmp_path_factory)


@pytest.fixture(autouse=True)
def fresh_loader(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv(_loader.DISABLE_ENV, raising=False)
    _loader.clear_cache()
    yield
    _loader.clear_cache()


def _fail_compile(kind: str, build_dir: Path) -> None:
    raise AssertionError(f"{kind} extension compiled again in {build_dir}")


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_two_processes_starting_at_once_build_once(build: SessionBuild) -> None:
    assert all(report["loaded"] for report in build.reports), build.reports
    compiled = [report["compiled"] for report in build.reports]
    assert sorted(compiled) == [False, True], build.reports  # one compiled, one waited


def test_cache_hit_loads_without_compiling(
    build: SessionBuild, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(_loader.CACHE_ENV, str(build.cache))
    monkeypatch.setattr(_loader, "_compile", _fail_compile)
    with caplog.at_level(logging.INFO, logger="amp_fused_ops"):
        ext = _loader.get_extension("cpu")
        assert _loader.get_extension("cpu") is ext  # memoized in the process
    assert ext is not None and all(hasattr(ext, op) for op in OPS)
    assert Path(str(ext.__file__)).parent == _loader.build_directory("cpu")
    assert not caplog.records
    assert _loader.unavailable_reason("cpu") is None
    assert _loader.extension_status("cpu").state == "built"


@pytest.mark.parametrize("value", ["1", "cpu", "cuda,cpu"])
def test_disable_forces_none_with_one_line(
    value: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(_loader.DISABLE_ENV, value)
    monkeypatch.setattr(_loader, "_compile", _fail_compile)
    with caplog.at_level(logging.INFO, logger="amp_fused_ops"):
        assert _loader.get_extension("cpu") is None
        assert _loader.get_extension("cpu") is None
    assert _warnings(caplog) == [
        "amp_fused_ops CPU extension unavailable, using the PyTorch reference path: "
        f"disabled by AMP_FUSED_OPS_DISABLE={value}; unset it to use the compiled kernels"
    ]
    assert "AMP_FUSED_OPS_DISABLE" in str(_loader.unavailable_reason("cpu"))


def test_disable_cuda_only_keeps_cpu(build: SessionBuild, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_loader.DISABLE_ENV, "cuda")
    monkeypatch.setenv(_loader.CACHE_ENV, str(build.cache))
    assert _loader.get_extension("cpu") is not None


def test_cuda_says_there_are_no_cuda_kernels(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(_loader, "_compile", _fail_compile)
    with caplog.at_level(logging.WARNING, logger="amp_fused_ops"):
        assert _loader.get_extension("cuda") is None
    assert len(caplog.records) == 1
    assert "no CUDA kernels in this release" in caplog.records[0].getMessage()
    assert "no CUDA kernels" in str(_loader.unavailable_reason("cuda"))


def test_unknown_kind_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="unknown extension kind 'rocm'"):
        _loader.get_extension("rocm")


def test_missing_compiler_gives_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(_loader.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    with caplog.at_level(logging.WARNING, logger="amp_fused_ops"):
        assert _loader.get_extension("cpu") is None
        assert _loader.get_extension("cpu") is None
    (line,) = _warnings(caplog)
    assert "no C++ compiler found ('no-such-compiler-here' is not on PATH)" in line
    assert "python -m amp_fused_ops build" in line


def test_missing_ninja_gives_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(_loader.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(_loader, "ninja_path", lambda: None)
    with caplog.at_level(logging.WARNING, logger="amp_fused_ops"):
        assert _loader.get_extension("cpu") is None
    (line,) = _warnings(caplog)
    assert "ninja is not installed; run `pip install ninja`" in line


def test_build_failure_names_the_log_and_is_not_retried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from torch.utils import cpp_extension

    calls = []

    def broken_load(**kwargs: object) -> None:
        calls.append(kwargs)
        raise RuntimeError("Error building extension 'amp_fused_ops_cpu': error: boom")

    monkeypatch.setenv(_loader.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(cpp_extension, "load", broken_load)
    with caplog.at_level(logging.WARNING, logger="amp_fused_ops"):
        assert _loader.get_extension("cpu") is None
        _loader.clear_cache()  # as a new process would: the failure is remembered on disk
        assert _loader.get_extension("cpu") is None
    log = _loader.build_directory("cpu") / "amp_fused_ops_build_failed.log"
    assert len(calls) == 1 and "boom" in log.read_text()
    compiling, failed, failed_again = _warnings(caplog)
    assert compiling.startswith("compiling amp_fused_ops CPU extension (first use")
    assert f"compiler output in {log}" in failed and failed_again == failed
    with pytest.raises(_loader.ExtensionUnavailableError, match="failed to compile"):
        _loader.build_extension("cpu", force=True)
    assert len(calls) == 2  # `build` retries


def test_prebuilt_module_is_preferred_when_torch_matches(
    build: SessionBuild, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(_loader.CACHE_ENV, str(build.cache))
    built = _loader.extension_status("cpu").path
    assert built is not None
    prebuilt = tmp_path / "_prebuilt"
    prebuilt.mkdir()
    shutil.copy(built, prebuilt / built.name)
    meta = {"file": built.name, "torch": torch.__version__, "python": _loader._python_tag()}
    (prebuilt / "amp_fused_ops_cpu.json").write_text(json.dumps(meta))
    monkeypatch.setattr(_loader, "_PREBUILT_DIR", prebuilt)
    imported: list[Path] = []
    real_import = _loader._import_compiled

    def spy(path: Path) -> object:
        imported.append(path)
        return real_import(path)

    monkeypatch.setattr(_loader, "_import_compiled", spy)
    assert _loader.extension_status("cpu").state == "prebuilt"
    assert _loader.get_extension("cpu") is not None
    assert imported == [prebuilt / built.name]  # (Python reuses the module object by name)
    meta["torch"] = "0.0.1"  # built for another torch: ignored
    (prebuilt / "amp_fused_ops_cpu.json").write_text(json.dumps(meta))
    assert _loader.extension_status("cpu").state == "built"


def _cli(cache: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "amp_fused_ops", *args],
        env=child_env(cache, **env),
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_info_reports_the_cpu_extension(build: SessionBuild) -> None:
    result = _cli(build.cache, "info")
    assert result.returncode == 0, result.stderr
    assert f"torch:        {torch.__version__}" in result.stdout
    assert "cpu extension: built (cached: " in result.stdout
    assert "cuda extension: unavailable (no CUDA kernels in this release" in result.stdout


def test_build_command_exit_codes(build: SessionBuild, tmp_path: Path) -> None:
    cached = _cli(build.cache, "build")
    assert cached.returncode == 0, cached.stderr
    assert "cpu extension: already built" in cached.stdout
    assert "cuda extension: skipped (no CUDA kernels" in cached.stdout
    broken = _cli(tmp_path, "build", "--kind", "cpu", CXX="no-such-compiler-here")
    assert broken.returncode == 1
    assert "cpu extension: FAILED: no C++ compiler found" in broken.stderr
