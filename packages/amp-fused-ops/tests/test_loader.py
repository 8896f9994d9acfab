"""The loader: just-in-time build, cache, lock, disable switch, failures and the CLI."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

from _cpu_extension_helpers import (
    SessionBuild,
    child_env,
    own_messages,
    race_reports,
    session_cache,
)
from amp_fused_ops.extensions import _api as ext_api
from amp_fused_ops.extensions import _build as ext_build
from amp_fused_ops.extensions import _loader
from amp_fused_ops.extensions import _lookup as ext_lookup
from amp_fused_ops.extensions import _prebuilt as ext_prebuilt
from amp_fused_ops.extensions import _record as ext_record
from amp_fused_ops.extensions import _toolkit as ext_toolkit

OPS = ("multi_tensor_scale", "multi_tensor_axpby", "multi_tensor_l2norm", "multi_tensor_adam")


@pytest.fixture(scope="module")
def build(tmp_path_factory: pytest.TempPathFactory) -> SessionBuild:
    return session_cache(tmp_path_factory)


@pytest.fixture(autouse=True)
def fresh_loader(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv(_loader.DISABLE_ENV, raising=False)
    # The loader's answers as in a process that has loaded nothing yet (a kind loaded earlier
    # stays the answer: test_loader_cache.py's test_disable_after_loading_tells_the_truth).
    monkeypatch.setattr(ext_api, "_loaded", {})
    _loader.clear_cache()
    yield
    _loader.clear_cache()


def _fail_compile(kind: str, build_dir: Path) -> None:
    raise AssertionError(f"{kind} extension compiled again in {build_dir}")


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return own_messages(caplog, logging.WARNING)


@pytest.mark.slow  # a real compile, where the session's build was copied from the user's cache
def test_two_processes_starting_at_once_build_once(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    reports = race_reports(tmp_path_factory)
    assert all(report["loaded"] for report in reports), reports
    compiled = [report["compiled"] for report in reports]
    assert sorted(compiled) == [False, True], reports  # one compiled, one waited


def test_cache_hit_loads_without_compiling(
    build: SessionBuild, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(_loader.CACHE_ENV, str(build.cache))
    monkeypatch.setattr(ext_build, "compile_extension", _fail_compile)
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
    monkeypatch.setattr(ext_build, "compile_extension", _fail_compile)
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


# --- the CUDA kind: why it is unavailable, and what its build would compile ----------------

CPU_TORCH = torch.version.cuda is None
CUDA_DIR = Path(_loader.__file__).resolve().parents[3] / "csrc" / "cuda"


@pytest.fixture
def cuda_toolchain(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Pretend torch is a CUDA 13.0 build and a CUDA 13.0 nvcc exists (no GPU, arch 9.0)."""
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(ext_toolkit, "nvcc_path", lambda: "/opt/cuda/bin/nvcc")
    monkeypatch.setattr(ext_toolkit, "nvcc_version", lambda nvcc: (13, 0))
    monkeypatch.setattr(ext_toolkit, "cuda_home", lambda: Path("/opt/cuda"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    monkeypatch.setenv(_loader.CACHE_ENV, str(tmp_path))
    return tmp_path


@pytest.mark.skipif(not CPU_TORCH, reason="needs a CPU build of torch")
def test_cuda_on_a_cpu_build_of_torch_says_so_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(ext_build, "compile_extension", _fail_compile)
    with caplog.at_level(logging.WARNING, logger="amp_fused_ops"):
        assert _loader.get_extension("cuda") is None
        assert _loader.get_extension("cuda") is None
    (line,) = _warnings(caplog)
    assert line == (
        "amp_fused_ops CUDA extension unavailable, using the PyTorch reference path: "
        f"torch {torch.__version__} is a CPU build (torch.version.cuda is None); install a "
        "CUDA build of torch to use the CUDA kernels"
    )
    assert "is a CPU build" in str(_loader.unavailable_reason("cuda"))
    with pytest.raises(_loader.ExtensionUnavailableError, match="is a CPU build"):
        _loader.build_extension("cuda")


def test_cuda_disabled_even_when_buildable(
    cuda_toolchain: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(_loader.DISABLE_ENV, "cuda")
    monkeypatch.setattr(ext_build, "compile_extension", _fail_compile)
    assert _loader.get_extension("cuda") is None
    assert "disabled by AMP_FUSED_OPS_DISABLE=cuda" in str(_loader.unavailable_reason("cuda"))


def test_cuda_without_nvcc_gives_the_fix(
    cuda_toolchain: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ext_toolkit, "nvcc_path", lambda: None)
    reason = str(_loader.unavailable_reason("cuda"))
    assert reason.startswith("nvcc not found (no CUDA toolkit in $CUDA_HOME, on PATH or in")
    assert "install the CUDA 13.0 toolkit and set CUDA_HOME" in reason


def test_cuda_version_mismatch_between_nvcc_and_torch(
    cuda_toolchain: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ext_toolkit, "nvcc_version", lambda nvcc: (12, 4))
    reason = str(_loader.unavailable_reason("cuda"))
    assert reason.startswith(
        "CUDA version mismatch: nvcc (/opt/cuda/bin/nvcc) is CUDA 12.4 but torch "
    )
    assert "was built with CUDA 13.0; set CUDA_HOME to a CUDA 13.x toolkit" in reason


def test_cuda_without_gpu_needs_an_arch_list(
    cuda_toolchain: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST")
    assert str(_loader.unavailable_reason("cuda")) == (
        "no CUDA GPU is visible (torch.cuda.is_available() is False) and TORCH_CUDA_ARCH_LIST "
        "is not set; set TORCH_CUDA_ARCH_LIST (e.g. 9.0) to compile without a GPU"
    )


def test_cuda_with_an_arch_list_builds_without_gpu(cuda_toolchain: Path) -> None:
    status = _loader.extension_status("cuda")
    assert status.state == "not built", status
    assert status.detail.startswith("compiles on first use (about ")
    assert _loader.unavailable_reason("cuda") is None
    name = _loader.build_directory("cuda").name
    assert name.startswith(f"cuda-torch{torch.__version__}-cu13.0-sm90-py"), name


def test_cuda_cache_key_follows_the_arch_list(
    cuda_toolchain: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sm90 = _loader.build_directory("cuda")
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0+PTX")
    both = _loader.build_directory("cuda")
    assert sm90 != both and "-sm80-90+PTX-" in both.name


@pytest.mark.parametrize(
    ("arch_list", "capability", "runs"),
    [
        ("8.0;9.0+PTX", "9.0", True),
        ("8.0;9.0+PTX", "8.6", True),  # sm_80 machine code runs on 8.6 and 8.9 (same major)
        ("8.0;9.0+PTX", "8.9", True),
        ("8.6", "8.0", False),  # never on an older minor
        ("8.0;9.0", "10.0", False),  # nor across majors without PTX
        ("8.0;9.0;10.0+PTX", "12.0", True),  # the driver compiles the PTX of 10.0
        ("9.0+PTX", "8.9", False),  # PTX is for its architecture and newer only
        ("9.0a", "9.0", True),
        ("10.0a", "10.3", False),  # architecture-specific: that architecture only
        ("10.0f", "10.3", True),  # family-specific: the family
        ("8.0 9.0,10.0", "10.0", True),
        ("", "9.0", False),
    ],
)
def test_prebuilt_cuda_module_follows_cuda_compatibility_rules(
    arch_list: str, capability: str, runs: bool
) -> None:
    """A wheel's CUDA module built for 8.0, 9.0 and 10.0+PTX is taken on an A10 (8.6), an L4
    (8.9) or a 12.0 GPU, where CUDA runs it; not on a GPU it cannot run on."""
    assert _loader._arch_covers(arch_list, capability) is runs


def _record_cuda_loads(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, object]]:
    """Replaces ``cpp_extension.load`` by a recorder of its arguments that writes an empty
    module; returns the list the calls go to."""
    from torch.utils import cpp_extension

    calls: list[dict[str, object]] = []

    def fake_load(**kwargs: object) -> ModuleType:
        env = {name: os.environ.get(name) for name in ("TORCH_CUDA_ARCH_LIST", "CUDA_HOME")}
        calls.append({**kwargs, "env": env, "cuda_home": cpp_extension.CUDA_HOME})
        built = Path(str(kwargs["build_directory"])) / "amp_fused_ops_cuda.so"
        built.write_bytes(b"")
        module = ModuleType("amp_fused_ops_cuda")
        module.__file__ = str(built)
        return module

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    return calls


@pytest.mark.skipif(not (CUDA_DIR / "ops_registration.cpp").exists(), reason="no csrc/cuda sources")
def test_cuda_build_compiles_every_source_of_csrc_cuda(
    cuda_toolchain: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    calls = _record_cuda_loads(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="amp_fused_ops"):
        assert _loader.get_extension("cuda") is not None
    (call,) = calls
    common = sorted(str(p) for p in (CUDA_DIR.parent / "common").glob("*.cpp"))
    assert common  # the C++ runtime definitions, compiled into both extensions
    expected = sorted(common + [str(p) for p in CUDA_DIR.iterdir() if p.suffix in (".cu", ".cpp")])
    assert sorted(map(str, call["sources"])) == expected  # type: ignore[call-overload]
    assert call["name"] == "amp_fused_ops_cuda" and call["with_cuda"] is True
    assert call["env"] == {"TORCH_CUDA_ARCH_LIST": "9.0", "CUDA_HOME": "/opt/cuda"}
    assert call["cuda_home"] == "/opt/cuda"
    (line,) = _warnings(caplog)
    assert line.startswith("compiling amp_fused_ops CUDA extension (first use on this machine")
    meta = json.loads((_loader.build_directory("cuda") / "amp_fused_ops_build.json").read_text())
    assert meta["arch"] == "9.0"


@pytest.mark.skipif(not (CUDA_DIR / "ops_registration.cpp").exists(), reason="no csrc/cuda sources")
def test_headers_of_torch_nvidia_packages_are_searched_after_the_toolkit(
    cuda_toolchain: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A toolkit without cusparse.h takes it from torch's nvidia-* packages, whose folder also
    holds the CUDA runtime headers of torch's CUDA release: searched before the toolkit's own,
    they made an nvcc of another minor release refuse every unit (CCCL's "CUDA compiler and
    CUDA toolkit headers are incompatible"). They come after the toolkit's, as -isystem."""
    include = tmp_path / "site" / "nvidia" / "cu13" / "include"
    include.mkdir(parents=True)
    (include / "cusparse.h").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    calls = _record_cuda_loads(monkeypatch)
    assert _loader.get_extension("cuda") is not None
    (call,) = calls
    assert str(include) not in (call.get("extra_include_paths") or [])  # -I: before the toolkit
    for key in ("extra_cflags", "extra_cuda_cflags"):
        flags = list(call[key])  # type: ignore[call-overload]
        assert flags[flags.index(str(include)) - 1] == "-isystem", key


def test_cuda_home_skips_wrapper_scripts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wrapper_bin = tmp_path / "wrapper" / "bin"
    wrapper_bin.mkdir(parents=True)
    (wrapper_bin / "nvcc").write_text('#!/bin/sh\nexec /elsewhere/nvcc "$@"\n')
    (wrapper_bin / "nvcc").chmod(0o755)
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv("PATH", str(wrapper_bin))
    home = _loader.cuda_home()
    assert home != tmp_path / "wrapper"  # no include/cuda_runtime.h there
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "toolkit"))
    assert _loader.cuda_home() == tmp_path / "toolkit"


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
    monkeypatch.setattr(ext_toolkit, "ninja_path", lambda: None)
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


def _ship(built: Path, folder: Path, torch_version: str, isa: str, **meta: object) -> Path:
    """Put a copy of ``built`` into ``folder`` as a wheel ships it, with its note."""
    name = f"amp_fused_ops_cpu.torch-{torch_version.split('+')[0]}.{isa}.so"
    folder.mkdir(exist_ok=True)
    shutil.copy(built, folder / name)
    note: dict[str, object] = {
        "file": name,
        "torch": torch_version,
        "python": _loader._python_tag(),
        "isa": isa,
        "size": built.stat().st_size,
        "sha256": hashlib.sha256(built.read_bytes()).hexdigest(),
        **meta,
    }
    (folder / f"{name.removesuffix('.so')}.json").write_text(json.dumps(note))
    return folder / name


@pytest.fixture
def wheel_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty ``_prebuilt/`` the loader reads instead of the installed package's."""
    folder = tmp_path / "_prebuilt"
    folder.mkdir()
    monkeypatch.setattr(ext_prebuilt, "PREBUILT_DIR", folder)
    return folder


def _built(build: SessionBuild, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The session's build of the CPU extension (the loader's cache becomes the session's)."""
    monkeypatch.setenv(_loader.CACHE_ENV, str(build.cache))
    status = _loader.extension_status("cpu")
    assert status.state == "built" and status.path is not None, status
    return status.path


def _capability(monkeypatch: pytest.MonkeyPatch, capability: str) -> None:
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)


def test_prebuilt_module_is_preferred_when_torch_matches(
    build: SessionBuild, wheel_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    built = _built(build, monkeypatch)
    shipped = _ship(built, wheel_folder, torch.__version__, _loader._host_isas()[0])
    imported: list[Path] = []
    real_import = _loader._import_compiled

    def spy(path: Path) -> object:
        imported.append(path)
        return real_import(path)

    monkeypatch.setattr(ext_lookup, "import_compiled", spy)
    assert _loader.extension_status("cpu").state == "prebuilt"
    assert _loader.get_extension("cpu") is not None
    assert imported == [shipped]
    note = shipped.with_suffix(".json")
    meta = json.loads(note.read_text())
    meta["sha256"] = "0" * 64  # not the bytes it was built with: never loaded
    note.write_text(json.dumps(meta))
    status = _loader.extension_status("cpu")
    assert status.state == "built"
    assert "; the prebuilt module of this wheel is damaged: the SHA-256 of" in status.detail


def test_prebuilt_module_of_the_best_instruction_set_the_cpu_runs(
    build: SessionBuild, wheel_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A wheel ships AVX2 and AVX-512 modules per torch release; torch's CPU capability (which
    ATEN_CPU_CAPABILITY lowers) picks one, and a CPU that has neither compiles just in time."""
    built = _built(build, monkeypatch)
    avx2 = _ship(built, wheel_folder, torch.__version__, "avx2")
    avx512 = _ship(built, wheel_folder, torch.__version__, "avx512")
    _capability(monkeypatch, "AVX512")
    assert _loader.extension_status("cpu").path == avx512
    _capability(monkeypatch, "AVX2")
    assert _loader.extension_status("cpu").path == avx2
    _capability(monkeypatch, "DEFAULT")
    status = _loader.extension_status("cpu")
    assert status.state != "prebuilt"
    assert status.detail.endswith(
        f"the wheel's prebuilt cpu modules for torch {torch.__version__} need avx2, avx512; "
        "this CPU runs baseline (torch's CPU capability DEFAULT)"
    )


def test_prebuilt_module_serves_its_torch_release_whatever_the_local_label(
    build: SessionBuild, wheel_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CPU kernels link only torch's CPU libraries: a module built with the CUDA build of a
    release serves its CPU build (and the other way round), under any Python; another release
    compiles."""
    built = _built(build, monkeypatch)
    isa = _loader._host_isas()[0]
    release = torch.__version__.split("+")[0]
    label = "+cpu" if "+cu" in torch.__version__ else "+cu130"
    other_build = _ship(built, wheel_folder, release + label, isa, python="3.99")
    assert _loader.extension_status("cpu").path == other_build
    other_build.unlink()
    other_build.with_suffix(".json").unlink()
    _ship(built, wheel_folder, "2.10.0+cpu", isa)
    _ship(built, wheel_folder, "2.99.1", isa)
    status = _loader.extension_status("cpu")
    assert status.state == "built"
    assert status.detail.endswith(
        "the wheel's prebuilt cpu modules are for torch 2.10.0+cpu, torch 2.99.1; this is "
        f"torch {torch.__version__}"
    )


def test_prebuilt_module_that_does_not_load_falls_back_to_the_cache(
    build: SessionBuild,
    wheel_folder: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A shipped module the dynamic loader refuses (a torch patch release that broke its ABI, a
    library missing on this system) is logged once and skipped, never the end of the ops."""
    built = _built(build, monkeypatch)
    junk = wheel_folder / "not-a-library.so"
    junk.write_bytes(b"\x7fELF but not really")
    broken = _ship(junk, wheel_folder, torch.__version__, _loader._host_isas()[0])
    monkeypatch.setattr(ext_build, "compile_extension", _fail_compile)
    with caplog.at_level(logging.WARNING, logger="amp_fused_ops"):
        module = _loader.get_extension("cpu")
    assert module is not None and Path(str(module.__file__)) == built
    (warning,) = _warnings(caplog)
    assert warning.startswith(f"the compiled module {broken} cannot be imported (")
    assert warning.endswith("; using the cache or a just-in-time build instead")


def test_wheel_modules_are_staged_under_their_instruction_set(tmp_path: Path) -> None:
    """A just-in-time build whose host flags are those of an instruction set is that set's
    module for a wheel; written under the set's name with a note that verifies, it is refused
    without a set; two different modules of one name never both reach a wheel."""
    build_dir = tmp_path / "cpu-build"
    build_dir.mkdir()
    module = build_dir / "amp_fused_ops_cpu.so"
    module.write_bytes(b"module bytes")
    meta = {"torch": "2.13.0+cpu", "python": "3.11", "isa": "host", "seconds": 1.0}
    ext_record.write_record(build_dir, module, meta)
    with pytest.raises(ValueError, match="built for 'host'"):
        ext_prebuilt.stage("cpu", build_dir, tmp_path / "refused")
    staged = ext_prebuilt.stage("cpu", build_dir, tmp_path / "out", isa="avx512")
    assert staged.name == "amp_fused_ops_cpu.torch-2.13.0.avx512.so"
    (shipped,) = ext_prebuilt.shipped("cpu", tmp_path / "out")
    assert shipped.path == staged and shipped.isa == "avx512" and shipped.torch == "2.13.0+cpu"
    assert ext_record.mismatch(staged, shipped.meta) is None
    assert "seconds" not in shipped.meta  # the note keeps what the loader reads
    wheel = tmp_path / "wheel"
    assert ext_prebuilt.gather("cpu", tmp_path / "out", wheel) == [wheel / staged.name]
    assert ext_prebuilt.gather("cpu", tmp_path / "out", wheel) == [wheel / staged.name]  # same
    module.write_bytes(b"other bytes")  # another build of the same name
    ext_record.write_record(build_dir, module, meta)
    ext_prebuilt.stage("cpu", build_dir, tmp_path / "other", isa="avx512")
    with pytest.raises(ext_record.DamagedBuildError, match="two different modules named"):
        ext_prebuilt.gather("cpu", tmp_path / "other", wheel)


def test_a_wheel_module_for_an_instruction_set_this_cpu_lacks_is_compiled_but_not_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a CPU without AVX-512, the wheel's AVX-512 module is compiled with the AVX-512 flags
    and staged, and never loaded (the build child loads what it builds: an illegal instruction
    on such a CPU); a torch without the compile-only helper is refused with what to do."""
    monkeypatch.setenv("AMP_FUSED_OPS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(ext_api.flags, "host_isas", lambda: ("avx2", "baseline"))
    monkeypatch.setattr(ext_api.subprocess, "run", lambda *a, **k: pytest.fail("a child ran"))
    compiled = []

    def compile_without_loading(build_dir: Path) -> Path:
        compiled.append((build_dir, ext_build.flags.extra_cflags()))
        module = build_dir / "amp_fused_ops_cpu.so"
        module.write_bytes(b"avx-512 module")
        meta = {"torch": torch.__version__, "python": ext_record.python_tag(), "isa": "avx512"}
        ext_record.write_record(build_dir, module, meta)
        return module

    monkeypatch.setattr(ext_build, "compile_without_loading", compile_without_loading)
    (staged,) = ext_api.build_for_wheel("cpu", tmp_path / "out", isas=["avx512"])
    assert staged.name == f"amp_fused_ops_cpu.torch-{torch.__version__.split('+')[0]}.avx512.so"
    assert staged.read_bytes() == b"avx-512 module"
    ((build_dir, cflags),) = compiled
    assert any(flag.startswith("-mavx512") for flag in cflags), cflags
    assert ext_api.build_for_wheel("cpu", tmp_path / "again", isas=["avx512"])  # from the cache
    assert len(compiled) == 1

    class OldTorch:  # a cpp_extension without torch's internal build-only helper
        pass

    with pytest.raises(ext_api.ExtensionUnavailableError, match="cannot compile an extension"):
        ext_build._compile_cpu_only(OldTorch(), [], build_dir)


def _cli(cache: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "amp_fused_ops", *args],
        env=child_env(cache, **env),
        capture_output=True,
        text=True,
        timeout=1800,  # a hang guard, not a speed check (a first compile under load is slow)
    )


def test_info_reports_the_cpu_extension(build: SessionBuild) -> None:
    result = _cli(build.cache, "info")
    assert result.returncode == 0, result.stderr
    assert f"torch:        {torch.__version__}" in result.stdout
    assert "cpu extension: built (cached: " in result.stdout
    if CPU_TORCH:
        assert "cuda extension: unavailable (torch " in result.stdout
        assert "is a CPU build (torch.version.cuda is None)" in result.stdout


@pytest.mark.skipif(not CPU_TORCH, reason="would compile the CUDA extension")
def test_build_command_exit_codes(build: SessionBuild, tmp_path: Path) -> None:
    cached = _cli(build.cache, "build")
    assert cached.returncode == 0, cached.stderr
    assert "cpu extension: already built" in cached.stdout
    assert "cuda extension: skipped (torch " in cached.stdout  # `build` = all: skipped
    broken = _cli(tmp_path, "build", "--kind", "cpu", CXX="no-such-compiler-here")
    assert broken.returncode == 1
    assert "cpu extension: FAILED: no C++ compiler found" in broken.stderr
    named = _cli(build.cache, "build", "cuda")  # named explicitly: it must build, or fail
    assert named.returncode == 1
    assert "cuda extension: FAILED: torch " in named.stderr
    assert "is a CPU build" in named.stderr


@pytest.mark.parametrize(
    ("capability", "avx2", "avx512"),
    [("DEFAULT", False, False), ("AVX2", True, False), ("AVX512", True, True)],
)
def test_cpu_flags_follow_the_vector_width_torch_uses(
    monkeypatch: pytest.MonkeyPatch, capability: str, avx2: bool, avx512: bool
) -> None:
    monkeypatch.delenv(_loader.PORTABLE_ENV, raising=False)
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    flags = _loader._extra_cflags()
    assert {"-O3", "-fno-math-errno"} <= set(flags)
    assert ("-mavx2" in flags) is avx2
    assert ("-mfma" in flags) is avx2
    assert ("-mavx512f" in flags) is avx512
    # at::parallel_for runs on one thread in code compiled without OpenMP.
    openmp = sys.platform.startswith("linux") and torch.backends.openmp.is_available()
    assert ("-fopenmp" in flags) is openmp
    # A module built ahead of time for a wheel: the flags of the instruction set it names,
    # whatever this host has.
    monkeypatch.setenv(_loader.PORTABLE_ENV, "1")
    assert not any(flag.startswith("-mavx") for flag in _loader._extra_cflags())
    monkeypatch.setenv(_loader.PORTABLE_ENV, "avx2")
    portable = _loader._extra_cflags()
    assert "-mavx2" in portable and "-mfma" in portable and "-mavx512f" not in portable
    monkeypatch.setenv(_loader.PORTABLE_ENV, "avx512")
    assert {"-mavx2", "-mavx512f", "-mavx512bw"} <= set(_loader._extra_cflags())
    monkeypatch.setenv(_loader.PORTABLE_ENV, "avx10")
    with pytest.raises(_loader.ExtensionUnavailableError, match="'avx10' names no instruction"):
        _loader._extra_cflags()


def test_cuda_cache_key_follows_where_the_library_headers_come_from(
    cuda_toolchain: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Headers taken from torch's nvidia-* packages (a toolkit without cusparse.h) are part of
    the CUDA build's key: a build made with another search order is not taken for this one."""
    from amp_fused_ops.extensions import _cache as cache

    before = cache.source_hash("cuda")
    include = tmp_path / "site" / "nvidia" / "cu13" / "include"
    include.mkdir(parents=True)
    (include / "cusparse.h").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert cache.source_hash("cuda") != before


def test_cache_key_covers_the_shared_headers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An edit of csrc/common (the math both extensions include) changes both cache keys."""
    from amp_fused_ops.extensions import _cache as cache

    csrc = tmp_path / "csrc"
    shutil.copytree(CUDA_DIR.parent, csrc)
    assert (csrc / "common" / "adam_math.h").is_file()
    monkeypatch.setattr(cache, "source_dir", lambda: csrc)
    before = {kind: cache.source_hash(kind) for kind in ("cpu", "cuda")}
    assert csrc / "common" / "adam_math.h" in cache.sources("cpu")
    assert csrc / "common" / "adam_math.h" in cache.sources("cuda")
    with (csrc / "common" / "adam_math.h").open("a") as header:
        header.write("// edited\n")
    after = {kind: cache.source_hash(kind) for kind in ("cpu", "cuda")}
    assert after["cpu"] != before["cpu"] and after["cuda"] != before["cuda"]
    # Headers are hashed, never compiled on their own; the shared sources compile in both.
    for kind in ("cpu", "cuda"):
        common = [path for path in cache.compiled_sources(kind) if path.parent.name == "common"]
        assert common == [csrc / "common" / "libstdcxx_compat.cpp"]


# --- the C++ runtime ------------------------------------------------------------------------
# A second, uninitialised copy of libstdc++ inside an extension crashed the process (SIGSEGV in
# std::ostream's number formatting) at the first error message that printed a number. These
# check that the link line keeps the shared runtime that torch uses, also where the toolchain
# links libstdc++ statically.

_RUNTIME_SYMBOLS = ("__cxa_throw", "_ZNSo9_M_insertIlEERSoT_")  # throw; ostream << long


def _defined_runtime_symbols(library: Path) -> list[str]:
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm (binutils) is not installed")
    listing = subprocess.run(
        [nm, "-D", "--defined-only", str(library)], capture_output=True, text=True, check=True
    ).stdout
    names = {line.split()[-1] for line in listing.splitlines() if line.strip()}
    return [name for name in _RUNTIME_SYMBOLS if name in names]


def test_link_flags_keep_libstdcxx_shared_under_a_static_toolchain(tmp_path: Path) -> None:
    from amp_fused_ops.extensions import _flags as flags

    compiler = shutil.which(os.environ.get("CXX", "c++"))
    if compiler is None:
        pytest.skip("no C++ compiler")
    ldflags = flags.extra_ldflags()
    assert len(ldflags) == 1 and Path(ldflags[0]).name.startswith("libstdc++.so")
    source = tmp_path / "formats.cpp"
    source.write_text(
        "#include <sstream>\n#include <stdexcept>\n"
        "void fail(long n) { std::ostringstream o; o << n; throw std::runtime_error(o.str()); }\n"
    )
    static = ["-shared", "-fPIC", "-static-libstdc++", str(source)]
    plain = tmp_path / "plain.so"
    subprocess.run([compiler, *static, "-o", str(plain)], check=True)
    # The check can see a runtime of its own: this toolchain does link one in when asked.
    assert _defined_runtime_symbols(plain) == list(_RUNTIME_SYMBOLS)
    fixed = tmp_path / "fixed.so"
    subprocess.run([compiler, *static, *ldflags, "-o", str(fixed)], check=True)
    assert _defined_runtime_symbols(fixed) == []


def test_built_extension_has_no_cxx_runtime_of_its_own(build: SessionBuild) -> None:
    module = _loader.get_extension("cpu")
    assert module is not None, _loader.unavailable_reason("cpu")
    assert _defined_runtime_symbols(Path(str(module.__file__))) == []


def test_cache_key_follows_the_link_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    from amp_fused_ops.extensions import _cache as cache
    from amp_fused_ops.extensions import _flags as flags

    before = cache.source_hash("cpu")
    monkeypatch.setattr(flags, "extra_ldflags", lambda: ("/elsewhere/libstdc++.so.6",))
    assert cache.source_hash("cpu") != before
