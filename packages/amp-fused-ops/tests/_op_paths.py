"""The paths an ``amp_C`` op runs on, as one test parameter: the contract tests' ``path``.

An op has one contract (its registry entry and its case in ``_op_cases.py``) and up to three
implementations. A contract test takes the ``path`` fixture and runs on each of them:

``reference``
    ``amp_C`` on CPU tensors inside :func:`amp_fused_ops.extensions.use_reference`: the
    pure-PyTorch reference, with ``amp_C``'s own argument checks in front. Every successful
    call is proven to have reached the reference (its call count).
``cpu``
    The compiled C++ CPU extension (built once per test run, ``_cpu_extension_helpers``),
    called in Apex's convention on CPU tensors.
``cuda``
    The CUDA kernels: the CUDA extension on a GPU, or under ``nox -s cuda_emulation`` the same
    sources compiled for the CPU, on CPU tensors (``_kernel_target``). These parameters carry
    the ``gpu`` and ``cuda_emulation`` marks, so the CPU test run leaves them out and the GPU
    and emulated runs select them.

:func:`paths` gives the parameters for a test of some ops: the paths where every one of them
has a kernel (``OpCase.paths``), so no test is generated only to be skipped.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import Tensor

from _kernel_target import DEVICE as CUDA_DEVICE
from _kernel_target import EMULATED, SMALL_SIZES
from _op_cases import KERNEL_OP_PATHS, OP_CASES, PATHS, noop_flag

__all__ = [
    "PATHS",
    "OpPath",
    "apex_arguments",
    "call_grouped",
    "kernel_paths",
    "mixed_lists",
    "on_device",
    "open_path",
    "paths",
]

# Tensor sizes that cross the vector width (1, 7), the chunk sizes (333 and 2048 * 32, so
# chunks start both misaligned and aligned) and, on a GPU, the launch batches.
_CPU_SIZES = (1, 7, 555, 33333, 2048 * 32 + 1)
if SMALL_SIZES:
    _CUDA_SIZES: tuple[int, ...] = (1, 7, 555)
elif EMULATED:
    _CUDA_SIZES = (1, 7, 555, 33333)
else:
    _CUDA_SIZES = (1, 7, 555, 33333, 2048 * 32 + 1, 2 * 2048 * 32)
_CHUNKS = (333, 2048 * 32)


@dataclass(frozen=True)
class OpPath:
    """One way of running the ``amp_C`` ops, with the tensors to run them on.

    Attributes:
        name: ``"reference"``, ``"cpu"`` or ``"cuda"``.
        device: Where the path's tensors live (``"cpu"`` for the emulated CUDA kernels too).
        sizes: The tensor sizes a test of this path runs over.
        chunks: The chunk sizes a test of this path runs with.
    """

    name: str
    device: str
    sizes: tuple[int, ...]
    chunks: tuple[int, ...]
    _module: Any
    _counts: Any = None

    def op(self, name: str) -> Callable[..., Any]:
        """Op ``name`` of this path, in Apex's calling convention (``amp_C``'s)."""
        function = getattr(self._module, name)
        if self._counts is None:
            return function  # type: ignore[no-any-return]

        key = f"amp_fused_ops::{name}"

        @functools.wraps(function)
        def counted(*args: Any, **kwargs: Any) -> Any:
            before = self._counts[key]
            result = function(*args, **kwargs)
            # A call of empty lists has nothing to compute: amp_C returns without an op call.
            if not _empty_lists(name, args):
                assert self._counts[key] > before, f"{name} did not run on the reference"
            return result

        return counted

    def kernel_op(self, name: str) -> Callable[..., Any]:
        """Norm or SyncBN op ``name`` of this path (``KERNEL_OP_PATHS``): the dispatcher op, on
        the reference path counted, on the emulated CUDA path the emulated build's."""
        if self.name == "cuda":
            from _kernel_target import norm_ops

            return getattr(norm_ops(), name).default  # type: ignore[no-any-return]
        op = getattr(torch.ops.amp_fused_ops, name).default
        if self._counts is None:
            return op  # type: ignore[no-any-return]
        key = f"amp_fused_ops::{name}"

        def counted(*args: Any, **kwargs: Any) -> Any:
            before = self._counts[key]
            result = op(*args, **kwargs)
            assert self._counts[key] > before, f"{name} did not run on the reference"
            return result

        return counted

    def flag(self, value: int = 0) -> Tensor:
        """Apex's noop flag on this path's device."""
        return noop_flag(value, self.device)

    def randn(
        self,
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
        sizes: tuple[int, ...] | None = None,
        *,
        scale: float = 1.0,
        positive: bool = False,
    ) -> list[Tensor]:
        """One tensor per size (``self.sizes`` by default), the same values on every path."""
        generator = torch.Generator().manual_seed(seed)
        out = []
        for n in self.sizes if sizes is None else sizes:
            t = torch.randn(n, generator=generator) * scale
            out.append((t.abs() if positive else t).to(device=self.device, dtype=dtype))
        return out

    def tensor(self, value: Any, dtype: torch.dtype | None = None) -> Tensor:
        """``torch.tensor(value)`` on this path's device."""
        return torch.tensor(value, dtype=dtype, device=self.device)


def _empty_lists(name: str, args: tuple[Any, ...]) -> bool:
    """Whether a call of ``name`` in Apex's convention passes lists that hold no tensor."""
    if name == "update_scale_hysteresis" or len(args) < 3:
        return False
    return not any(isinstance(t, Tensor) for tensors in args[2] for t in tensors)


def on_device(value: Any, device: str) -> Any:
    """``value`` with every tensor in it (lists and tuples too) moved to ``device``."""
    if isinstance(value, Tensor):
        return value.to(device)
    if isinstance(value, list | tuple):
        return type(value)(on_device(v, device) for v in value)
    return value


def apex_arguments(name: str, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """A call of op ``name`` with the schema's arguments (the tensor lists as separate
    arguments, as ``OpCase.sample`` gives them) in Apex's convention: one list of lists."""
    from amp_fused_ops.ops._registry import REGISTRY

    counts = REGISTRY[name].list_counts
    if not counts:
        return args
    most = max(counts)
    lists = [part for part in args[2 : 2 + most] if part is not None]
    return (args[0], args[1], lists, *args[2 + most :])


def paths(*ops: str) -> list[Any]:
    """``path`` parameters (indirect) for a test of ``ops``: every path that has a kernel of
    each of them, the ``cuda`` one marked ``gpu`` and ``cuda_emulation``."""
    unknown = [op for op in ops if op not in OP_CASES]
    if unknown:
        raise ValueError(f"no case in _op_cases.OP_CASES for {unknown}")
    return [_param(name) for name in PATHS if all(name in OP_CASES[op].paths for op in ops)]


def kernel_paths(*ops: str) -> list[Any]:
    """``path`` parameters (indirect) for a test of norm or SyncBN ops (``KERNEL_OP_PATHS``):
    every path that has a kernel of each of them, the ``cuda`` one marked as in :func:`paths`."""
    unknown = [op for op in ops if op not in KERNEL_OP_PATHS]
    if unknown:
        raise ValueError(f"no entry in _op_cases.KERNEL_OP_PATHS for {unknown}")
    return [_param(name) for name in PATHS if all(name in KERNEL_OP_PATHS[op] for op in ops)]


def _param(name: str) -> Any:
    marks = [pytest.mark.gpu, pytest.mark.cuda_emulation] if name == "cuda" else []
    return pytest.param(name, marks=marks, id=name)


def open_path(name: str, request: pytest.FixtureRequest) -> Iterator[OpPath]:
    """The ``path`` fixture's body: the path ``name``, open for the test's duration."""
    if name == "reference":
        from amp_fused_ops import amp_C, extensions

        with extensions.use_reference() as counts:
            yield OpPath(name, "cpu", _CPU_SIZES, _CHUNKS, amp_C, counts)
    elif name == "cpu":
        from _cpu_extension_helpers import load_from, session_cache

        factory = request.getfixturevalue("tmp_path_factory")
        yield OpPath(name, "cpu", _CPU_SIZES, _CHUNKS, load_from(session_cache(factory).cache))
    elif name == "cuda":
        from _kernel_target import extension

        chunks = (333,) if SMALL_SIZES else _CHUNKS
        yield OpPath(name, CUDA_DEVICE, _CUDA_SIZES, chunks, extension())
    else:
        raise ValueError(f"unknown path {name!r}: expected one of {PATHS}")


# --- lists of every dtype mix -----------------------------------------------------------------

Lists = list[list[Tensor]]
CHANNELS_LAST_SHAPE = (2, 6, 5, 7)  # 420 elements; channels-last strides differ from rows


def mixed_lists(
    path: OpPath,
    allowed: Sequence[Sequence[torch.dtype]],
    seed: int,
    init: Sequence[Callable[[Tensor], Tensor]],
    keep: Callable[[tuple[torch.dtype, ...]], bool],
) -> Lists:
    """One list per entry of ``allowed``; position k has the k-th dtype combination that
    ``keep`` accepts (combinations repeat until every size of ``path.sizes`` has appeared).

    Every third position holds channels-last 4-D tensors, the others 1-D tensors of the path's
    sizes in turn, the largest once. ``init[l]`` maps standard normal values to list l's values
    (float32).
    """
    combos = [c for c in itertools.product(*allowed) if keep(c)]
    positions = max(len(combos), (3 * len(path.sizes) + 1) // 2)
    generator = torch.Generator().manual_seed(seed)
    lists: Lists = [[] for _ in allowed]
    n_flat = 0
    for k in range(positions):
        channels_last = k % 3 == 2
        if channels_last:
            shape: tuple[int, ...] = CHANNELS_LAST_SHAPE
        else:
            # Every size once, then all but the largest in turn (one large tensor is enough).
            n = len(path.sizes) if n_flat < len(path.sizes) else len(path.sizes) - 1
            shape, n_flat = (path.sizes[n_flat % n],), n_flat + 1
        for index, dtype in enumerate(combos[k % len(combos)]):
            values = init[index](torch.randn(shape, generator=generator))
            t = values.to(device=path.device, dtype=dtype)
            if channels_last:
                t = t.contiguous(memory_format=torch.channels_last)
            lists[index].append(t)
    return lists


def call_grouped(
    op: Callable[..., Any],
    chunk: int,
    flag: Tensor,
    lists: Lists,
    *args: Any,
    per_tensor: int | None = None,
) -> None:
    """``op`` once per combination of dtypes of ``lists`` (each list of a call holds one dtype),
    in place, all with ``flag``.

    ``args[per_tensor]`` is a tensor of one value per position (NovoGrad's norms): each call
    takes the values of its positions, and what it writes there is copied back.
    """
    groups: dict[tuple[torch.dtype, ...], list[int]] = {}
    for k in range(len(lists[0])):
        groups.setdefault(tuple(ts[k].dtype for ts in lists), []).append(k)
    for positions in groups.values():
        call_args = list(args)
        if per_tensor is not None:
            call_args[per_tensor] = args[per_tensor][positions]
        op(chunk, flag, [[ts[k] for k in positions] for ts in lists], *call_args)
        if per_tensor is not None:
            args[per_tensor][positions] = call_args[per_tensor]
