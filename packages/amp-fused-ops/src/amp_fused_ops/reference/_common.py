"""Preconditions and device-side helpers shared by the reference ``amp_C`` ops.

Private to :mod:`amp_fused_ops.reference._ops`, :mod:`amp_fused_ops.reference._adam`,
:mod:`amp_fused_ops.reference._optim` and :mod:`amp_fused_ops.reference._layerwise`; see
:mod:`amp_fused_ops.reference._ops` for the conventions every reference op follows.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from amp_fused_ops.ops._preconditions import check_chunk_size

TensorLists = Sequence[Sequence[Tensor]]
# What torch._foreach_* accept and return.
_Tensors = list[Tensor] | tuple[Tensor, ...]

# Storage dtypes every op accepts; math always runs in float32.
_FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)
_FP32_ONLY: tuple[torch.dtype, ...] = (torch.float32,)


# ---------------------------------------------------------------------------------------------
# Preconditions
# ---------------------------------------------------------------------------------------------


def _dtype_names(dtypes: Sequence[torch.dtype]) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


def _check(
    op: str,
    chunk_size: int,
    noop_flag: Tensor,
    tensor_lists: TensorLists,
    list_names: Sequence[Sequence[str]],
    dtypes: Sequence[Sequence[torch.dtype]] | None = None,
) -> torch.device | None:
    """Validate the arguments every multi-tensor op shares.

    Args:
        op: Name of the op, used in error messages.
        chunk_size: Elements per chunk; must be a positive int (results do not depend on it).
        noop_flag: One-element int32 tensor on the device of the tensors.
        tensor_lists: The op's lists of tensors.
        list_names: Each accepted layout of ``tensor_lists``, as the names of its lists (for
            example ``[("grads", "params", "momentum_bufs")]``).
        dtypes: Allowed dtypes per list position; defaults to float32/float16/bfloat16 for all.

    Returns:
        The device of the tensors, or None when the lists hold no tensor.

    Raises:
        TypeError: An argument has the wrong type.
        ValueError: The lists have the wrong count or lengths, sizes mismatch, the noop flag or
            a dtype is not accepted, or one list holds two dtypes.
        RuntimeError: A tensor is not on the noop flag's device.

    The messages are those of the compiled kernels (``csrc/common/checks.h``), mistake by
    mistake.
    """
    check_chunk_size(op, chunk_size)
    if not isinstance(noop_flag, Tensor):
        raise TypeError(
            f"{op}: noop_flag must be a tensor, got {type(noop_flag).__name__}; "
            "create it with torch.zeros(1, dtype=torch.int32, device=...)"
        )
    if noop_flag.dtype != torch.int32 or noop_flag.numel() != 1:
        raise ValueError(
            f"{op}: noop_flag must be a one-element int32 tensor, got dtype "
            f"{noop_flag.dtype} with {noop_flag.numel()} elements; "
            "create it with torch.zeros(1, dtype=torch.int32, device=...)"
        )
    if not isinstance(tensor_lists, (list, tuple)):
        raise TypeError(
            f"{op}: tensor_lists must be a list of lists of tensors, got "
            f"{type(tensor_lists).__name__}"
        )
    counts = [len(names) for names in list_names]
    if len(tensor_lists) not in counts:
        raise ValueError(f"{op}: expected {_lists_of(counts)}, got {len(tensor_lists)}")
    n = len(tensor_lists[0])
    for i, tensors in enumerate(tensor_lists):
        if not isinstance(tensors, (list, tuple)):
            raise TypeError(
                f"{op}: tensor_lists[{i}] must be a list of tensors, got {type(tensors).__name__}"
            )
        if len(tensors) != n:
            raise ValueError(
                f"{op}: tensor_lists[{i}] has {len(tensors)} tensors but tensor_lists[0] has {n}; "
                "every list must hold one tensor per position"
            )
    if n == 0:
        return None
    device = noop_flag.device
    allowed_per_list = dtypes if dtypes is not None else [_FLOAT_DTYPES] * len(tensor_lists)
    # Position by position, list by list, as the compiled kernels check (csrc/common/checks.h).
    for j in range(n):
        for i, tensors in enumerate(tensor_lists):
            t = tensors[j]
            if not isinstance(t, Tensor):
                got = "None" if t is None else type(t).__name__
                raise TypeError(f"{op}: tensor_lists[{i}][{j}] must be a tensor, got {got}")
            if t.device != device:
                raise wrong_device_error(op, i, j, t, device)
            allowed = allowed_per_list[i]
            if t.dtype not in allowed:
                raise ValueError(
                    f"{op}: tensor_lists[{i}][{j}] has dtype {t.dtype}; this list accepts "
                    f"{_dtype_names(allowed)}"
                )
            first = tensor_lists[0][j]
            if isinstance(first, Tensor) and t.numel() != first.numel():
                raise ValueError(
                    f"{op}: tensor_lists[{i}][{j}] has {t.numel()} elements but "
                    f"tensor_lists[0][{j}] has {first.numel()}; tensors at the same "
                    "position must have the same number of elements"
                )
    _check_list_dtypes(op, tensor_lists)
    return device


def _check_list_dtypes(op: str, tensor_lists: TensorLists) -> None:
    """Raise ValueError unless the tensors of each list share one dtype.

    The compiled kernels dispatch on the first tensor of each list, as Apex's do; the
    optimizers launch one call per ``(device, dtype)`` group.
    """
    for i, tensors in enumerate(tensor_lists):
        for j, t in enumerate(tensors[1:], start=1):
            if t.dtype != tensors[0].dtype:
                raise ValueError(
                    f"{op}: tensor_lists[{i}][{j}] has dtype {t.dtype} but "
                    f"tensor_lists[{i}][0] has dtype {tensors[0].dtype}; the tensors of one "
                    "list must share one dtype (group them by dtype)"
                )


def _lists_of(counts: Sequence[int]) -> str:
    """``"2 tensor lists"``, ``"3 or 4 tensor lists"``, ``"1 tensor list"``: the accepted counts."""
    return f"{' or '.join(map(str, counts))} tensor list{'' if list(counts) == [1] else 's'}"


def wrong_device_error(op: str, i: int, j: int, t: Tensor, device: torch.device) -> RuntimeError:
    """The error for ``tensor_lists[i][j]`` not on the noop flag's ``device``.

    In the words of the compiled kernels' check (``csrc/common/checks.h``).
    """
    return RuntimeError(
        f"{op}: tensor_lists[{i}][{j}] is on {t.device} but noop_flag is on {device}; move all "
        "tensors of one call, noop_flag included, to the same device"
    )


def find_wrong_device(op: str, noop_flag: Tensor, tensor_lists: TensorLists) -> RuntimeError | None:
    """:func:`wrong_device_error` for the first tensor (position by position) that is not on
    the noop flag's device, or None when every tensor is on it."""
    for j in range(len(tensor_lists[0]) if tensor_lists else 0):
        for i, tensors in enumerate(tensor_lists):
            t = tensors[j] if j < len(tensors) else None
            if isinstance(t, Tensor) and t.device != noop_flag.device:
                return wrong_device_error(op, i, j, t, noop_flag.device)
    return None


def _check_state_dtype(op: str, tensor_lists: TensorLists, state: int, param: int) -> None:
    """Raise ValueError unless every tensor of list ``state`` is float32 or its param's dtype.

    The optimizer state of SGD (momentum buffers) and Adagrad (sums of squares): Apex keeps it
    in the params' dtype; float32 state for low-precision params is accepted as well.
    """
    for j, (s, p) in enumerate(zip(tensor_lists[state], tensor_lists[param], strict=True)):
        if s.dtype != torch.float32 and s.dtype != p.dtype:
            raise ValueError(
                f"{op}: tensor_lists[{state}][{j}] has dtype {s.dtype} but "
                f"tensor_lists[{param}][{j}] has dtype {p.dtype}; optimizer state must be "
                "float32 or the params' dtype"
            )


def _check_state_lists(
    op: str, tensor_lists: TensorLists, first: int, last: int, param: int
) -> None:
    """Raise ValueError unless the state lists ``first`` to ``last`` share one dtype, float32
    or the dtype of the params (list ``param``).

    Call after :func:`_check` (one dtype per list): the compiled kernels read all the state
    lists as one type.
    """
    if not tensor_lists[first]:
        return
    state = tensor_lists[first][0].dtype
    for i in range(first + 1, last + 1):
        dtype = tensor_lists[i][0].dtype
        if dtype != state:
            raise ValueError(
                f"{op}: tensor_lists[{i}][0] has dtype {dtype} but tensor_lists[{first}][0] "
                f"has dtype {state}; the optimizer state lists must share one dtype"
            )
    _check_state_dtype(op, tensor_lists, first, param)


def _same_view(a: Tensor, b: Tensor) -> bool:
    """Whether ``a`` and ``b`` are one view of the same memory: same first element, dtype,
    element count and layout (two contiguous tensors of different shapes are one view)."""
    if a.data_ptr() != b.data_ptr() or a.dtype != b.dtype or a.numel() != b.numel():
        return False
    both_contiguous = a.is_contiguous() and b.is_contiguous()
    return both_contiguous or (a.shape == b.shape and a.stride() == b.stride())


def _check_overlap(
    op: str,
    tensor_lists: TensorLists,
    written: Sequence[int],
    in_place: Sequence[tuple[int, int]] = (),
) -> None:
    """Raise ValueError when a tensor the op writes shares memory with another of the call.

    The compiled kernels read and write the lists as independent arrays, chunk by chunk in any
    order, so any sharing they cannot honour is refused, on every path alike (the reference
    itself would compute the right values):

    * ``tensor_lists[a][i]`` may be ``tensor_lists[b][i]`` itself (the very same view) when
      ``(a, b)`` is in ``in_place``: an elementwise update in place;
    * any other sharing that involves a list in ``written`` is refused: a partial overlap, two
      written tensors (at one position or two), a written tensor and an input at another
      position. Tensors that are only read may share memory.

    A tensor spans the memory from its first to its last element (two interleaved strided
    views count as overlapping: the kernels take dense tensors only). The first offending pair
    in order of address is named, as ``check_overlap`` of ``csrc/common/checks.h`` does, with
    its words.
    """
    allowed = {frozenset(pair) for pair in in_place}
    spans = []
    for i, tensors in enumerate(tensor_lists):
        for j, t in enumerate(tensors):
            if t.numel() == 0 or t.device.type == "meta":
                continue
            # Offset of the last element (strides are never negative in PyTorch).
            last = sum((n - 1) * stride for n, stride in zip(t.shape, t.stride(), strict=True))
            start = t.data_ptr()
            spans.append((start, i, j, start + (last + 1) * t.element_size()))
    spans.sort()
    for k, (_, list_a, index_a, end_a) in enumerate(spans):
        for start_b, list_b, index_b, _ in spans[k + 1 :]:
            if start_b >= end_a:
                break
            if list_a not in written and list_b not in written:
                continue
            same_position = index_a == index_b
            pair = same_position and list_a != list_b and frozenset((list_a, list_b)) in allowed
            if pair and _same_view(tensor_lists[list_a][index_a], tensor_lists[list_b][index_b]):
                continue
            (l1, i1), (l2, i2) = sorted(((list_a, index_a), (list_b, index_b)))
            if pair:
                fix = (
                    "only the very same tensor may be updated in place; pass it in both lists, "
                    "or tensors that do not overlap"
                )
            elif same_position:
                fix = "every list needs tensors of its own"
            else:
                fix = (
                    "a tensor the op writes may not overlap any other tensor of the call; "
                    "pass tensors of their own (clone the shared ones)"
                )
            raise ValueError(
                f"{op}: tensor_lists[{l1}][{i1}] and tensor_lists[{l2}][{i2}] share memory; {fix}"
            )


def _per_tensor(op: str, name: str, value: Tensor, n: int, device: torch.device) -> Tensor:
    """``value`` checked as a float32 tensor of ``n`` elements on ``device``, flattened."""
    if not isinstance(value, Tensor):
        raise TypeError(f"{op}: {name} must be a tensor, got {type(value).__name__}")
    if value.dtype != torch.float32 or value.numel() != n:
        raise ValueError(
            f"{op}: {name} must be a float32 tensor of {n} elements (one per tensor), got "
            f"dtype {value.dtype} with {value.numel()} elements"
        )
    if value.device != device:
        raise RuntimeError(
            f"{op}: {name} is on {value.device} but the tensors are on {device}; "
            "create it on the tensors' device"
        )
    return value.reshape(-1)


def _fp32(tensors: Sequence[Tensor], like: Sequence[Tensor] | None = None) -> _Tensors:
    """Float32 values of ``tensors``, reshaped to the shapes of ``like`` where those differ.

    The result may alias the input (a float32 tensor is returned as is): never modify it in
    place.
    """
    out = [t.float() for t in tensors]
    if like is not None:
        out = [
            t if t.shape == r.shape else t.reshape(r.shape) for t, r in zip(out, like, strict=True)
        ]
    return out


def _write(dst: Sequence[Tensor], src: Sequence[Tensor], skip: Tensor | None = None) -> None:
    """Copy ``src`` into ``dst`` (cast, layout kept); keep ``dst`` where ``skip`` is true."""
    for d, s in zip(dst, src, strict=True):
        if s.shape != d.shape:
            s = s.reshape(d.shape)
        d.copy_(s if skip is None else torch.where(skip, d, s))


def _any_nonfinite(tensors: Sequence[Tensor], device: torch.device) -> Tensor:
    """0-dim bool tensor: does any of ``tensors`` hold an inf or a nan."""
    if not tensors:
        return torch.zeros((), dtype=torch.bool, device=device)
    return torch.stack([~torch.isfinite(t).all() for t in tensors]).any()


def _raise_flag(noop_flag: Tensor, condition: Tensor) -> None:
    """Set ``noop_flag`` to 1 where the 0-dim bool ``condition`` holds (no host sync)."""
    noop_flag.masked_fill_(condition, 1)


def _scalar(op: str, name: str, value: Tensor | float, device: torch.device) -> Tensor:
    """A 0-dim float32 tensor on ``device`` from a Python number or a one-element tensor
    (argument ``name`` of ``op``; a ValueError in the compiled kernels' words otherwise)."""
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(f"{op}: {name} must have one element, got {value.numel()}")
        return value.reshape(()).to(device=device, dtype=torch.float32)
    return torch.tensor(float(value), dtype=torch.float32, device=device)


def resolve_step(op: str, step: int, step_tensor: Tensor | None) -> int:
    """The step count of an op that takes ``int step`` and ``Tensor? step_tensor``.

    ``step_tensor``, when given, holds the count and ``step`` is not read: the optimizers pass
    the count as a tensor under ``torch.compile``, so that it is data of the graph rather than
    a constant that changes every step (``docs/compile.rst``). It is read on the host, so it
    must be a one-element CPU tensor holding a whole number.

    Raises:
        ValueError: ``step_tensor`` is not a one-element CPU tensor, or not a whole number >= 0.
    """
    if step_tensor is None:
        return step
    if step_tensor.device.type != "cpu" or step_tensor.numel() != 1:
        raise ValueError(
            f"{op}: step_tensor must be a one-element CPU tensor (the step count is read on "
            f"the host), got {step_tensor.numel()} elements on {step_tensor.device}; keep the "
            "count on the CPU, or use the capturable ops for a count on the device"
        )
    value = float(step_tensor.item())
    if not (value >= 0 and value == int(value)):
        raise ValueError(f"{op}: step_tensor must hold a whole number >= 0, got {value}")
    return int(value)


def resolve_lr(op: str, lr: float, lr_tensor: Tensor | None) -> float:
    """The learning rate of an op that takes ``float lr`` and ``Tensor? lr_tensor``.

    ``lr_tensor``, when given, holds the rate and ``lr`` is not read: a tensor learning rate
    (which ``torch.optim`` accepts) stays data of a ``torch.compile`` graph, so a scheduler
    that changes it recompiles nothing (``docs/compile.rst``). It is read on the host, as
    ``step_tensor`` is: a one-element floating-point CPU tensor.

    Raises:
        ValueError: ``lr_tensor`` is not a one-element floating-point CPU tensor.
    """
    if lr_tensor is None:
        return lr
    if (
        lr_tensor.device.type != "cpu"
        or lr_tensor.numel() != 1
        or not lr_tensor.is_floating_point()
    ):
        raise ValueError(
            f"{op}: lr_tensor must be a one-element floating-point CPU tensor (the learning "
            f"rate is read on the host), got {lr_tensor.numel()} elements of {lr_tensor.dtype} "
            f"on {lr_tensor.device}; pass lr as a float, or keep the tensor on the CPU"
        )
    return float(lr_tensor.item())
