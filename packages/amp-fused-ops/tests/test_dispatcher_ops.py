"""The compiled multi-tensor ops are PyTorch dispatcher ops: ``torch.ops.amp_fused_ops.<op>``.

One schema per op (``csrc/common/ops_schema.h``), Apex's tensor lists as separate arguments,
the written ones mutable; the C++ CPU extension registers its kernels for the CPU dispatch key
(the CUDA extension for CUDA). The extension module that ``get_extension`` returns keeps
Apex's ``amp_C`` calling convention on top.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from _cpu_extension_helpers import child_env, load_from, session_cache
from _op_cases import OP_CASES
from amp_fused_ops.reference import _ops as _reference

NAMESPACE = "amp_fused_ops"


@pytest.fixture(scope="module")
def ext(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return load_from(session_cache(tmp_path_factory).cache)


@pytest.mark.parametrize("name", sorted(OP_CASES))
def test_the_schema_marks_what_the_op_writes(ext: Any, name: str) -> None:
    """The arguments the op writes in place (the lists the reference writes, and the noop
    flag where the op may set it), as ``_op_cases.py`` declares them, are the schema's."""
    schema = getattr(getattr(torch.ops, NAMESPACE), name).default._schema
    written = {
        a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write
    }
    assert written == OP_CASES[name].writes
    if name != "update_scale_hysteresis":
        assert [a.name for a in schema.arguments[:2]] == ["chunk_size", "noop_flag"]


def test_cpu_kernels_are_registered_for_the_cpu_dispatch_key(ext: Any) -> None:
    has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key
    for name, case in OP_CASES.items():
        on_cpu = has_kernel(f"{NAMESPACE}::{name}", "CPU")
        # An op without a CPU kernel (the loss-scale update, ...): the module has no such
        # attribute and amp_C takes the reference for CPU tensors.
        assert on_cpu == ("cpu" in case.paths), name
        assert hasattr(ext, name) == on_cpu, name


@pytest.mark.gpu
def test_cuda_kernels_are_registered_for_the_cuda_dispatch_key() -> None:
    """The CUDA extension's kernels serve CUDA tensors; an op without one (``OpCase.paths``)
    has no module attribute and amp_C takes the reference for CUDA tensors."""
    from _kernel_target import extension

    ext = extension()
    has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key
    for name, case in OP_CASES.items():
        on_cuda = has_kernel(f"{NAMESPACE}::{name}", "CUDA")
        assert on_cuda == ("cuda" in case.paths), name
        assert hasattr(ext, name) == on_cuda, name


def test_the_dispatcher_op_takes_the_lists_as_separate_arguments(ext: Any) -> None:
    del ext  # loaded: the op is registered
    g = torch.Generator().manual_seed(0)
    ins = [torch.randn(n, generator=g) for n in (5, 3000)]
    outs = [torch.empty_like(t) for t in ins]
    flag = torch.zeros(1, dtype=torch.int32)
    versions = [t._version for t in outs]
    torch.ops.amp_fused_ops.multi_tensor_scale(2048, flag, ins, outs, 0.25)
    expected = [torch.empty_like(t) for t in ins]
    _reference.multi_tensor_scale(2048, torch.zeros(1, dtype=torch.int32), [ins, expected], 0.25)
    for got, want in zip(outs, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert all(t._version > v for t, v in zip(outs, versions, strict=True))
    assert flag.item() == 0


def test_python_numbers_given_for_tensor_arguments_become_tensors(ext: Any) -> None:
    xs = [torch.full((7,), 2.0), torch.full((3,), -1.0)]
    flag = torch.zeros(1, dtype=torch.int32)
    as_number = ext.multi_tensor_unscale_l2norm(2048, flag, [xs], 0.5, True)
    as_keyword = ext.multi_tensor_unscale_l2norm(2048, flag, [xs], inv_scale=0.5, per_tensor=True)
    as_tensor = ext.multi_tensor_unscale_l2norm(2048, flag, [xs], torch.tensor([0.5]), True)
    # sqrt(7 * 1 + 3 * 0.25) and the per-tensor norms sqrt(7), sqrt(0.75)
    want = (torch.tensor([7.75**0.5]), torch.tensor([7**0.5, 0.75**0.5]))
    for result in (as_number, as_keyword, as_tensor):
        torch.testing.assert_close(result[0], want[0])
        torch.testing.assert_close(result[1], want[1])
    with pytest.raises(TypeError, match="inv_scale must be a tensor or a number, got str"):
        ext.multi_tensor_unscale_l2norm(2048, flag, [xs], "0.5", True)


def test_sgd_takes_three_or_four_lists(ext: Any) -> None:
    lists = [[torch.ones(4)] for _ in range(5)]
    with pytest.raises(ValueError, match=r"multi_tensor_sgd: expected 3 or 4 tensor lists, got 5"):
        ext.multi_tensor_sgd(2048, torch.zeros(1, dtype=torch.int32), lists, 0.0, 0.9, 0.0, 0.1,
                             False, True, False, 1.0)  # fmt: skip
    copies = [torch.zeros(4, dtype=torch.float16)]
    grads, params, bufs = [torch.ones(4)], [torch.ones(4)], [torch.zeros(4)]
    ext.multi_tensor_sgd(2048, torch.zeros(1, dtype=torch.int32), [grads, params, bufs, copies],
                         0.0, 0.0, 0.0, 0.5, False, True, False, 1.0)  # fmt: skip
    torch.testing.assert_close(copies[0], torch.full((4,), 0.5, dtype=torch.float16))


_KERNELS_FIRST = """
import sys, torch
torch.ops.load_library(sys.argv[1])  # registers CPU kernels only: no schema yet
print(hasattr(torch.ops.amp_fused_ops, "multi_tensor_scale"))
import amp_fused_ops  # defines the schemas (the op registry)
print(torch._C._dispatch_has_kernel_for_dispatch_key("amp_fused_ops::multi_tensor_scale", "CPU"))
ins, outs = [torch.ones(3)], [torch.zeros(3)]
torch.ops.amp_fused_ops.multi_tensor_scale(64, torch.zeros(1, dtype=torch.int32), ins, outs, 3.0)
print(outs[0].tolist())
"""


def test_the_library_registers_kernels_and_the_package_defines_the_ops(
    ext: Any, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The extensions carry kernels only; the schemas come from amp_fused_ops, in either order."""
    result = subprocess.run(
        [sys.executable, "-c", _KERNELS_FIRST, str(Path(ext.__file__))],
        env=child_env(session_cache(tmp_path_factory).cache),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-3:] == ["False", "True", "[3.0, 3.0, 3.0]"]


def _child_lines(code: str, tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The lines ``code`` prints in a fresh Python that loads the session's CPU extension."""
    result = subprocess.run(
        [sys.executable, "-c", code],
        env=child_env(session_cache(tmp_path_factory).cache),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().splitlines()


# A fresh process: the first amp_C call on CPU tensors reaches the kernel of last resort (the
# one place that loads kernels), which loads the CPU extension once; later calls go to the C++
# kernel directly, and a call with empty lists loads nothing.
_LOADED_ON_FIRST_USE = """
import torch
from amp_fused_ops import amp_C
from amp_fused_ops.ops import _registry

asked = []
loader = _registry._kernel_loader
_registry.set_kernel_loader(lambda kind: (asked.append(kind), loader(kind))[1])
flag = torch.zeros(1, dtype=torch.int32)
ins, outs = [torch.full((3,), 2.0)], [torch.zeros(3)]
has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key
print(has_kernel("amp_fused_ops::multi_tensor_scale", "CPU"))
amp_C.multi_tensor_scale(64, flag, [[], []], 0.5)
print(asked)
amp_C.multi_tensor_scale(64, flag, [ins, outs], 0.5)
amp_C.multi_tensor_scale(64, flag, [ins, outs], 0.5)
print(asked, has_kernel("amp_fused_ops::multi_tensor_scale", "CPU"), outs[0].tolist())
"""


def test_the_first_op_of_a_device_loads_its_extension_once(
    ext: Any, tmp_path_factory: pytest.TempPathFactory
) -> None:
    del ext  # built in the session cache the child loads from
    assert _child_lines(_LOADED_ON_FIRST_USE, tmp_path_factory)[-3:] == [
        "False",
        "[]",
        "['cpu'] True [1.0, 1.0, 1.0]",
    ]


# A fresh process whose first op call is from a compiled graph: torch.compile traced the fake
# kernel and loaded nothing, so the call reaches the kernel of last resort, which must load the
# CPU extension and hand the call to the C++ kernel (not run the reference on every step).
_COMPILED_FIRST = """
import torch
from torch.profiler import profile
import amp_fused_ops
from amp_fused_ops import amp_C

has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key
name = "amp_fused_ops::multi_tensor_adam"
g = torch.Generator().manual_seed(0)
lists = [[torch.randn(n, generator=g).abs() for n in (5, 3000)] for _ in range(4)]
flag = torch.zeros(1, dtype=torch.int32)

@torch.compile(fullgraph=True)
def step():
    amp_C.multi_tensor_adam(2048, flag, lists, 1e-3, 0.9, 0.999, 1e-8, 1, 1, 1, 0.01)

eager = [[t.clone() for t in part] for part in lists]
print(has_kernel(name, "CPU"))
step()
print(has_kernel(name, "CPU"))
with profile() as prof:
    step()
print(sorted({e.key for e in prof.key_averages() if e.key.startswith("aten::")}))
for _ in range(2):  # the same two steps in eager mode, on the kernels now loaded
    amp_C.multi_tensor_adam(2048, flag, eager, 1e-3, 0.9, 0.999, 1e-8, 1, 1, 1, 0.01)
print(all(torch.equal(a, b) for x, y in zip(lists, eager) for a, b in zip(x, y)))
"""


def test_a_compiled_graph_loads_and_runs_the_cpu_kernels(
    ext: Any, tmp_path_factory: pytest.TempPathFactory
) -> None:
    del ext  # built in the session cache the child loads from
    before, after, aten_ops, same = _child_lines(_COMPILED_FIRST, tmp_path_factory)[-4:]
    assert (before, after) == ("False", "True")
    # The C++ kernel calls no ATen op; the reference computes the step with ATen ops.
    assert aten_ops == "[]", aten_ops
    assert same == "True"  # the compiled steps gave the eager kernel's bits
