"""``MultiTensorApply``: Apex's launcher object for the multi-tensor ops.

Apex's fused optimizers and amp call every ``amp_C`` op through one callable::

    from amp_fused_ops import amp_C, multi_tensor_applier

    flag = torch.zeros(1, dtype=torch.int32, device=device)
    multi_tensor_applier(amp_C.multi_tensor_scale, flag, [grads, grads], 1.0 / loss_scale)

The applier only supplies its chunk size as the op's first argument: the ops themselves pick
the compiled kernel or the pure-PyTorch reference (see :mod:`amp_fused_ops.amp_C`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar, TypeVar

from torch import Tensor

from amp_fused_ops.ops._preconditions import MAX_CHUNK_SIZE

__all__ = ["MultiTensorApply", "multi_tensor_applier"]

_R = TypeVar("_R")


class MultiTensorApply:
    """Calls a multi-tensor op with a fixed chunk size (Apex's ``MultiTensorApply``).

    Args:
        chunk_size: Elements each kernel block handles per tensor chunk. Results never depend
            on it; it only tunes the compiled kernels.

    Raises:
        ValueError: ``chunk_size`` is not an int in [1, 2**30] (the range every kernel takes).

    Example:
        >>> applier = MultiTensorApply(2048 * 32)
        >>> flag = torch.zeros(1, dtype=torch.int32)
        >>> xs = [torch.ones(4)]
        >>> applier(amp_C.multi_tensor_l2norm, flag, [xs], False)[0]
        tensor([2.])
    """

    # The reference path always works, so the applier is always available (Apex set this
    # False when its extension had not been built).
    available: ClassVar[bool] = True
    warned: ClassVar[bool] = False

    def __init__(self, chunk_size: int) -> None:
        if (
            isinstance(chunk_size, bool)
            or not isinstance(chunk_size, int)
            or not 1 <= chunk_size <= MAX_CHUNK_SIZE
        ):
            raise ValueError(
                f"MultiTensorApply: chunk_size must be an int in [1, 2**30], got {chunk_size!r}"
            )
        self.chunk_size = chunk_size

    def check_avail(self) -> None:
        """Kept for Apex compatibility; never raises, since the reference path always exists."""

    def __call__(
        self,
        op: Callable[..., _R],
        noop_flag_buffer: Tensor,
        tensor_lists: Sequence[Sequence[Tensor]],
        *args: Any,
    ) -> _R:
        """Run ``op(self.chunk_size, noop_flag_buffer, tensor_lists, *args)``.

        Args:
            op: A multi-tensor op, for example ``amp_C.multi_tensor_scale``.
            noop_flag_buffer: One-element int32 tensor on the tensors' device.
            tensor_lists: The op's lists of tensors.
            *args: The op's remaining arguments.

        Returns:
            Whatever the op returns (``None`` for most, a pair of tensors for the norms).
        """
        return op(self.chunk_size, noop_flag_buffer, tensor_lists, *args)

    def __repr__(self) -> str:
        return f"MultiTensorApply(chunk_size={self.chunk_size})"


#: The shared applier Apex exposes as ``apex.multi_tensor_apply.multi_tensor_applier``.
multi_tensor_applier = MultiTensorApply(2048 * 32)
