"""The C++/CUDA sources include the few ATen headers they use, never the umbrella headers.

<ATen/ATen.h> declares every ATen operator and <torch/extension.h> adds the C++ frontend and
pybind11: each roughly doubles the compile time of a translation unit, and every build of
csrc/ (the CPU extension on first use, the CUDA extension under nvcc, both emulated builds)
compiles each unit from scratch. csrc/common/aten_headers.h lists what the kernels need.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

CSRC = Path(__file__).resolve().parents[1] / "csrc"
UMBRELLAS = (
    "ATen/ATen.h",
    "torch/extension.h",
    "torch/all.h",
    "torch/torch.h",
    "torch/python.h",
)
_INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', re.MULTILINE)


def _sources() -> list[Path]:
    suffixes = {".h", ".cuh", ".cu", ".cpp"}
    return sorted(p for p in CSRC.rglob("*") if p.suffix in suffixes)


def test_the_sources_are_found() -> None:
    names = {p.name for p in _sources()}
    assert {"aten_headers.h", "multi_tensor_apply.cuh", "amp_emu.h"} <= names


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(CSRC)))
def test_no_umbrella_header(path: Path) -> None:
    included = _INCLUDE.findall(path.read_text())
    umbrellas = sorted(set(included) & set(UMBRELLAS))
    assert not umbrellas, (
        f"{path.relative_to(CSRC)} includes {umbrellas}: include the headers of what it uses "
        "(csrc/common/aten_headers.h for tensors, dtypes and at::empty-like factories)"
    )


# The one source that includes torch/csrc/autograd: the norm op's C++ autograd kernels, with
# the public headers of custom autograd Functions and of the error node of once-differentiable
# ones.
_AUTOGRAD_KERNEL = [
    ("common/norm_autograd.h", "torch/csrc/autograd/custom_function.h"),
    ("common/norm_autograd.h", "torch/csrc/autograd/functions/basic_ops.h"),  # DelayedError
]


def test_autograd_internals_stay_out() -> None:
    # The wrappers bump version counters through TensorImpl (c10/core/TensorImpl.h, with the
    # tensor headers), not through torch/csrc/autograd's headers; the norm's autograd kernel
    # is a custom Function (custom_function.h), in one header.
    found = []
    for path in _sources():
        for name in _INCLUDE.findall(path.read_text()):
            if name.startswith("torch/csrc/autograd/"):
                found.append((str(path.relative_to(CSRC)), name))
    assert found == _AUTOGRAD_KERNEL, found
