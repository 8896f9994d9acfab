"""Apex's ``SyncBatchNorm``, ``convert_syncbn_model`` and ``create_syncbn_process_group``."""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.instancenorm import _InstanceNorm

from ._comm import ProcessGroup, require_initialized
from ._syncbn_function import SyncBNFunction, batch_stats

__all__ = ["SyncBatchNorm", "convert_syncbn_model", "create_syncbn_process_group"]

log = logging.getLogger(__name__)


class SyncBatchNorm(_BatchNorm):
    """Batch norm whose training statistics are computed over all ranks of a process group.

    In training, per-channel mean and variance are those of the batch concatenated over the
    group (ranks may hold different batch sizes); the running statistics use the unbiased
    variance. In eval mode the running statistics are used locally. fp16/bf16 inputs are
    normalized with fp32 statistics; the output has the input's dtype. Works on CPU (Gloo)
    and CUDA (NCCL); without an initialized process group it is a plain batch norm.

    Args:
        num_features: Number of channels ``C``.
        eps: Added to the variance.
        momentum: Running-statistics momentum; ``None`` for a cumulative average.
        affine: Learnable per-channel weight and bias.
        track_running_stats: Keep running statistics (else eval uses batch statistics).
        process_group: Group to synchronize over; the default group when ``None`` (see
            :func:`create_syncbn_process_group`).
        channel_last: The input's *last* dimension is the channel dimension (``[N, H, W, C]``).
        fuse_relu: Apply ReLU after the normalization (and after adding ``z``).

    Example:
        >>> bn = SyncBatchNorm(64, fuse_relu=True)
        >>> y = bn(x, z=residual)  # relu(bn(x) + residual)
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: ProcessGroup | None = None,
        channel_last: bool = False,
        fuse_relu: bool = False,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_group = process_group
        self.channel_last = channel_last
        self.fuse_relu = fuse_relu

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(
                f"SyncBatchNorm expects an input of at least 2 dimensions, got {input.dim()}."
            )
        channels = input.shape[-1] if self.channel_last else input.shape[1]
        if channels != self.num_features:
            where = "last dimension (channel_last=True)" if self.channel_last else "dimension 1"
            raise ValueError(
                f"SyncBatchNorm({self.num_features}) got an input with {channels} channels in its "
                f"{where}, shape {tuple(input.shape)}. Pass channel_last=True for [N, ..., C] "
                "inputs."
            )

    def _sync_enabled(self) -> bool:
        if not (dist.is_available() and dist.is_initialized()):
            return False
        return dist.get_world_size(self.process_group) > 1

    def forward(self, input: Tensor, z: Tensor | None = None) -> Tensor:
        """Normalize ``input``; add ``z`` (same shape) before the optional fused ReLU.

        .. note:: In training with more than one rank, the statistics need one host sync
           (the global element count, for the unbiased running variance).
        """
        self._check_input_dim(input)
        if z is not None and z.shape != input.shape:
            raise ValueError(
                f"z must have the input's shape {tuple(input.shape)}, got {tuple(z.shape)}."
            )
        use_batch_stats = self.training or self.running_mean is None
        if use_batch_stats:
            sync = self.training and self._sync_enabled()
            with torch.no_grad():
                mean, var, count, counts = batch_stats(
                    input, self.channel_last, self.process_group, sync
                )
            if count == 1:  # as torch's batch norm (every rank sees the same total)
                size = tuple(input.shape)
                where = f" (over {counts.numel()} ranks)" if sync else ""
                raise ValueError(
                    f"Expected more than 1 value per channel when training, got input size "
                    f"{size}{where}: a variance needs at least 2 values per channel; use a "
                    "larger batch, or eval() mode with running statistics."
                )
            with torch.no_grad():
                self._update_running_stats(mean, var, count)
        else:
            assert self.running_mean is not None and self.running_var is not None
            sync = False
            counts = torch.zeros(1, dtype=torch.int32, device=input.device)
            mean, var = self.running_mean.float(), self.running_var.float()
        invstd = torch.rsqrt(var + self.eps)
        out: Tensor = SyncBNFunction.apply(
            input,
            z,
            self.weight,
            self.bias,
            mean,
            invstd,
            counts,
            self.process_group,
            sync,
            use_batch_stats,
            self.channel_last,
            self.fuse_relu,
        )
        return out

    def _update_running_stats(self, mean: Tensor, var: Tensor, count: int) -> None:
        if not (self.training and self.track_running_stats):
            return
        assert self.running_mean is not None and self.running_var is not None
        assert self.num_batches_tracked is not None
        self.num_batches_tracked.add_(1)
        if count == 0:
            return  # an empty batch (on every rank): no statistics, as torch's batch norm
        if self.momentum is None:
            factor = 1.0 / float(self.num_batches_tracked.item())
        else:
            factor = self.momentum
        unbiased = var * (count / (count - 1)) if count > 1 else var
        self.running_mean.lerp_(mean.to(self.running_mean.dtype), factor)
        self.running_var.lerp_(unbiased.to(self.running_var.dtype), factor)

    def extra_repr(self) -> str:
        return (
            super().extra_repr() + f", channel_last={self.channel_last}, fuse_relu={self.fuse_relu}"
        )


def convert_syncbn_model(
    module: nn.Module, process_group: ProcessGroup | None = None, channel_last: bool = False
) -> nn.Module:
    """Replace every ``BatchNorm*d`` in ``module`` by :class:`SyncBatchNorm`.

    The new layers reuse the old parameter and buffer objects (so weights, running
    statistics, devices, dtypes and an already-built optimizer stay valid) and the training
    mode. Instance norms are left alone.

    Args:
        module: The model (or a single batch-norm layer).
        process_group: Group the new layers synchronize over.
        channel_last: Passed to every new layer.

    Returns:
        The converted module (``module`` itself unless it is a batch norm).

    Example:
        >>> model = convert_syncbn_model(model).to(device)
    """
    converted = module
    if isinstance(module, _BatchNorm) and not isinstance(module, _InstanceNorm | SyncBatchNorm):
        converted = SyncBatchNorm(
            module.num_features,
            module.eps,
            module.momentum,
            module.affine,
            module.track_running_stats,
            process_group,
            channel_last=channel_last,
        )
        if module.affine:
            converted.weight = module.weight
            converted.bias = module.bias
        converted.running_mean = module.running_mean
        converted.running_var = module.running_var
        converted.num_batches_tracked = module.num_batches_tracked
        converted.train(module.training)
    for name, child in module.named_children():
        converted.add_module(name, convert_syncbn_model(child, process_group, channel_last))
    return converted


def create_syncbn_process_group(group_size: int) -> ProcessGroup | None:
    """Split the world into consecutive groups of ``group_size`` ranks for SyncBatchNorm.

    Every rank must call it (it creates every group); each gets back its own group.

    Args:
        group_size: Ranks per group; ``0`` means the whole world (returns ``None``).

    Returns:
        This rank's group, or ``None`` for ``group_size == 0``.

    Raises:
        RuntimeError: If no process group is initialized.
        ValueError: If ``group_size`` does not divide the world size.

    Example:
        >>> group = create_syncbn_process_group(4)  # 8 GPUs -> two groups of 4
        >>> model = convert_syncbn_model(model, process_group=group)
    """
    if group_size == 0:
        return None
    require_initialized("create_syncbn_process_group")
    world = dist.get_world_size()
    if group_size < 0 or group_size > world or world % group_size != 0:
        raise ValueError(
            f"group_size={group_size} must divide the world size {world} (and be <= it); "
            "pass 0 to synchronize over the whole world."
        )
    mine: ProcessGroup | None = None
    rank = dist.get_rank()
    for start in range(0, world, group_size):
        group = dist.new_group(ranks=list(range(start, start + group_size)))
        if start <= rank < start + group_size:
            mine = group
    return mine
