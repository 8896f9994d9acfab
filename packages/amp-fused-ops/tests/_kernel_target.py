"""Where the ``gpu`` kernel tests run: a CUDA device, or the emulated kernels on the CPU.

With ``AMP_FUSED_OPS_EMULATION`` set to a build of :mod:`amp_fused_ops._emulation`
(``counting`` or ``asan``), the CUDA sources compiled for the CPU take CPU tensors and the
tests use the issue's small sizes; otherwise the tests need CUDA and its compiled extension.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

EMULATION = os.environ.get("AMP_FUSED_OPS_EMULATION", "")
EMULATED = bool(EMULATION)
DEVICE = "cpu" if EMULATED else "cuda"


def extension() -> Any:
    """The CUDA extension's module (emulated or real); fails the test when it is missing."""
    if EMULATED:
        from amp_fused_ops import _emulation

        return _emulation.load(EMULATION)
    from amp_fused_ops import _loader

    module = _loader.get_extension("cuda")
    if module is None:
        pytest.fail(f"the CUDA extension is unavailable: {_loader.unavailable_reason('cuda')}")
    return module


def norm_ops() -> Any:
    """The namespace of the norm and SyncBN ops (``torch.ops.<namespace>``)."""
    extension()
    return torch.ops.amp_fused_ops_emu_ops if EMULATED else torch.ops.amp_fused_ops_cuda_ops


class Graph:
    """A captured sequence of launches: a CUDA graph, or the emulator's (``_emulation.Graph``)."""

    def __init__(self) -> None:
        if EMULATED:
            from amp_fused_ops import _emulation

            self._graph: Any = _emulation.Graph()
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
