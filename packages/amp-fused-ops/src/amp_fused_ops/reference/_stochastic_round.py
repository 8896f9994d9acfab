"""Stochastic rounding of float32 results to bfloat16: the reference of the compiled kernels'.

The compiled kernels (``csrc/common/stochastic_round.h``) and this module compute the same bits
for the same ``(seed, step)``: each element's 16 random bits are the top half of the first word
of Philox4x32-10 keyed by the 64-bit seed, on the counter
``(offset & 0xFFFFFFFF, offset >> 32, tensor, step & 0xFFFFFFFF)``, where ``tensor`` is the
element's tensor's index in the op's lists and ``offset`` its index inside the tensor (in
storage order). The rounding adds them to the float32 bits and clears the low 16 bits
(inf and nan are kept; the largest finite values may round up to inf). The result is unbiased:
``E[round(x)] = x``.

The unsigned 32-bit arithmetic runs on int64 tensors, the 32 x 32-bit products in 16-bit halves
so that nothing overflows.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "check_stochastic_round",
    "round_params",
    "stochastic_round_bf16",
    "stochastic_round_bits",
    "storage_offsets",
]

_MASK32 = 0xFFFFFFFF
_M0 = 0xD2511F53
_M1 = 0xCD9E8D57
_W0 = 0x9E3779B9
_W1 = 0xBB67AE85
_ROUNDS = 10


def _mulhilo(multiplier: int, x: Tensor) -> tuple[Tensor, Tensor]:
    """``(hi, lo)`` 32-bit halves of ``multiplier * x`` for ``x`` in [0, 2**32) (int64)."""
    m_lo, m_hi = multiplier & 0xFFFF, multiplier >> 16
    x_lo, x_hi = x & 0xFFFF, x >> 16
    low = x_lo * m_lo
    mid = x_lo * m_hi + x_hi * m_lo + (low >> 16)
    lo = ((mid & 0xFFFF) << 16) | (low & 0xFFFF)
    hi = x_hi * m_hi + (mid >> 16)
    return hi, lo


def _philox_first(c0: Tensor, c1: Tensor, c2: int, c3: int, k0: int, k1: int) -> Tensor:
    """The first output word of Philox4x32-10 (int64 tensors holding uint32 values)."""
    c2_t = torch.full_like(c0, c2)
    c3_t = torch.full_like(c0, c3)
    for _ in range(_ROUNDS):
        hi0, lo0 = _mulhilo(_M0, c0)
        hi1, lo1 = _mulhilo(_M1, c2_t)
        c0, c1, c2_t, c3_t = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3_t ^ k1, lo0
        k0 = (k0 + _W0) & _MASK32
        k1 = (k1 + _W1) & _MASK32
    return c0


def storage_offsets(like: Tensor) -> Tensor:
    """Each element's index in the storage order of ``like`` (a dense tensor), in its shape.

    The kernels walk a dense tensor in storage order; for a contiguous tensor this is
    ``arange(numel)`` reshaped, for a channels-last one it is not.
    """
    index = torch.empty_like(like, dtype=torch.int64)
    index.as_strided((like.numel(),), (1,)).copy_(
        torch.arange(like.numel(), dtype=torch.int64, device=like.device)
    )
    return index


def stochastic_round_bits(seed: int, step: int, tensor: int, offsets: Tensor) -> Tensor:
    """The 16 random bits (int64, in [0, 65536)) of the elements at ``offsets`` of ``tensor``.

    Args:
        seed: The seed (any int; its low 64 bits are used, as the kernels' int64).
        step: The step (its low 32 bits are used).
        tensor: The tensor's index in the op's lists.
        offsets: The elements' indices inside the tensor (int64, any shape).
    """
    seed64 = seed & 0xFFFFFFFFFFFFFFFF
    out = _philox_first(
        offsets & _MASK32,
        offsets >> 32,
        tensor & _MASK32,
        step & _MASK32,
        seed64 & _MASK32,
        seed64 >> 32,
    )
    return out >> 16


def stochastic_round_bf16(
    values: Tensor, like: Tensor, seed: int, step: int, tensor: int
) -> Tensor:
    """``values`` (float32) rounded stochastically to bfloat16, for writing into ``like``.

    Args:
        values: The float32 results, in ``like``'s shape.
        like: The tensor they are written to (its storage order gives the elements' offsets).
        seed: The seed of the launch.
        step: The step of the launch.
        tensor: The index of ``like`` in the op's lists.

    Returns:
        A bfloat16 tensor of ``values``' shape.
    """
    x = values.float().reshape(like.shape)
    bits = stochastic_round_bits(seed, step, tensor, storage_offsets(like))
    u = x.contiguous().view(torch.int32).to(torch.int64) & _MASK32
    special = (u & 0x7F800000) == 0x7F800000  # inf or nan: kept
    rounded = (u + bits) & 0xFFFF0000
    # Back to int32 bits (two's complement) and float32: the low 16 bits are zero, so the
    # conversion to bfloat16 below is exact.
    rounded = torch.where(rounded >= 1 << 31, rounded - (1 << 32), rounded).to(torch.int32)
    out = torch.where(special, x, rounded.view(torch.float32))
    return out.to(torch.bfloat16)


# --- the optimizer ops' stochastic rounding of their params (sr_seed) ---------------------------


def check_stochastic_round(op: str, tensor_lists: Sequence[Sequence[Tensor]], lists: int) -> None:
    """The preconditions of ``sr_seed``: bfloat16 params, no list of model copies."""
    if len(tensor_lists) != lists:
        raise ValueError(
            f"{op}: stochastic rounding (sr_seed) rounds the params themselves; pass {lists} "
            f"tensor lists (no model copies), got {len(tensor_lists)}"
        )
    for i, p in enumerate(tensor_lists[1]):
        if p.dtype != torch.bfloat16:
            raise ValueError(
                f"{op}: stochastic rounding (sr_seed) needs bfloat16 params, got {p.dtype} for "
                f"tensor_lists[1][{i}]; pass sr_seed=None for other dtypes"
            )


def round_params(
    params: Sequence[Tensor],
    new_p: list[Tensor] | tuple[Tensor, ...],
    sr_seed: int | None,
    sr_step: int,
) -> list[Tensor] | tuple[Tensor, ...]:
    """``new_p`` rounded stochastically for ``params`` when ``sr_seed`` is given, else as is."""
    if sr_seed is None:
        return new_p
    return [
        stochastic_round_bf16(v, p, sr_seed, sr_step, i)
        for i, (p, v) in enumerate(zip(params, new_p, strict=True))
    ]
