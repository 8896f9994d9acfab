"""Whether the work being issued is captured into a graph for later replay.

A call captured into a CUDA graph (``torch.cuda.graph``, or ``torch.compile``'s CUDA graphs)
runs again at every replay on the values its tensors hold then, so a decision it takes from
the values on the host would be taken once, at capture, for every replay; reading a value on
the host is also an error during a capture. The emulator's graph
(:class:`amp_fused_ops.emulation.Graph`, CPU tensors standing for CUDA ones) opens and closes
its captures here, so that the same code takes the same branch under it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor

__all__ = ["capturing", "emulated_capture"]

_emulated_captures = 0
"""The emulator's captures open now (it captures on one thread at a time)."""


def capturing(t: Tensor) -> bool:
    """Whether work on ``t``'s device is being captured now: the current stream of a CUDA
    tensor's device is capturing, or an emulated capture is open."""
    if _emulated_captures:
        return True
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


@contextlib.contextmanager
def emulated_capture() -> Iterator[None]:
    """An emulated capture open for the ``with`` block."""
    global _emulated_captures
    _emulated_captures += 1
    try:
        yield
    finally:
        _emulated_captures -= 1
