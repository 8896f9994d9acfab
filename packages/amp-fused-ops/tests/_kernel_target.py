"""Where the ``gpu`` kernel tests run: a CUDA device, or the emulated kernels on the CPU.

With ``AMP_FUSED_OPS_EMULATION`` set to a build of :mod:`amp_fused_ops.emulation._kernels`
(``counting`` or ``asan``), the CUDA sources compiled for the CPU take CPU tensors and the
tests use smaller sizes (up to 33333 elements); otherwise the tests need CUDA and its compiled
extension.

``AMP_EMULATION_SIZES=small`` narrows the emulated multi-tensor tests further, to the tensor
sizes 1, 7 and 555 and the chunk size 333 (every op, dtype mix, inf/nan injection and graph
replay still runs), and the norm kernels' widest row from 4099 to 1031 columns (the same
512-thread launch): what the AddressSanitizer build has time for in CI, where the counting
build runs the full set (``nox -s cuda_emulation``).
"""

from __future__ import annotations

import collections
import os
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

EMULATION = os.environ.get("AMP_FUSED_OPS_EMULATION", "")
EMULATED = bool(EMULATION)
DEVICE = "cpu" if EMULATED else "cuda"

SIZES_ENV = "AMP_EMULATION_SIZES"
_SIZE_SETS = ("all", "small")
SIZE_SET = os.environ.get(SIZES_ENV) or "all"
if SIZE_SET not in _SIZE_SETS:
    raise ValueError(f"{SIZES_ENV}={SIZE_SET!r}: expected one of {_SIZE_SETS} (or leave it unset)")
# Only the emulated kernels take the small set; a GPU run always tests every size.
SMALL_SIZES = EMULATED and SIZE_SET == "small"


def extension() -> Any:
    """The CUDA extension's module (emulated or real); fails the test when it is missing."""
    if EMULATED:
        from amp_fused_ops.emulation import _kernels as _emulation

        return _emulation.load(EMULATION)
    from amp_fused_ops.extensions import _loader

    module = _loader.get_extension("cuda")
    if module is None:
        pytest.fail(f"the CUDA extension is unavailable: {_loader.unavailable_reason('cuda')}")
    return module


def norm_ops() -> Any:
    """The namespace of the norm and SyncBN ops whose kernels are the CUDA sources'
    (``torch.ops.amp_fused_ops``, or the emulated build's ``torch.ops.amp_fused_ops_emu``)."""
    extension()
    return torch.ops.amp_fused_ops_emu if EMULATED else torch.ops.amp_fused_ops


class OnKernelsOf(TorchDispatchMode):
    """Sends every call of a norm or SyncBN op of ``torch.ops.amp_fused_ops`` to the same op
    of ``namespace`` (the emulated build's), below autograd: the modules and functions run
    their own code on those kernels."""

    def __init__(self, namespace: str) -> None:
        super().__init__()
        from amp_fused_ops.ops._kernel_ops import KERNEL_OPS

        self.names = set(KERNEL_OPS)
        self.target = getattr(torch.ops, namespace)
        self.calls: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        schema = func._schema.name
        namespace, _, name = schema.partition("::")
        if namespace == "amp_fused_ops" and name in self.names:
            self.calls[name] += 1
            return getattr(self.target, name).default(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


class Graph:
    """A captured sequence of launches: a CUDA graph, or the emulator's (``emulation.Graph``)."""

    def __init__(self) -> None:
        if EMULATED:
            from amp_fused_ops import emulation

            self._graph: Any = emulation.Graph()
        else:
            self._graph = torch.cuda.CUDAGraph()

    def __enter__(self) -> Graph:
        if EMULATED:
            self._graph.__enter__()
        else:
            self._context = torch.cuda.graph(self._graph)
            self._context.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if EMULATED:
            self._graph.__exit__(*exc)
        else:
            self._context.__exit__(*exc)

    def replay(self) -> None:
        self._graph.replay()
