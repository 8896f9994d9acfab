"""Apex's ``DistributedDataParallel`` on top of torch's DDP engine.

The class *is* a ``torch.nn.parallel.DistributedDataParallel`` (so code that checks for one,
``.module``, ``no_sync()`` and ``state_dict`` keys ``module.*`` keep working), built with
Apex's constructor and options. Apex's all-reduce semantics live in one communication hook
(:mod:`amp_parallel._ddp_hook`).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ._comm import ProcessGroup, broadcast_tensors, require_initialized
from ._ddp_hook import HookState, allreduce_hook

__all__ = ["DistributedDataParallel"]

log = logging.getLogger(__name__)

_WRAPPED_MARK = "_amp_parallel_ddp_wrapped"
_MIB = 1024 * 1024


def _pg_timeout_s(group: ProcessGroup | None, device: torch.device) -> float | None:
    """The process group's timeout in seconds, or None where torch does not expose it."""
    try:
        pg = group if group is not None else dist.group.WORLD
        assert pg is not None
        timeout = pg._get_backend(device).options._timeout
    except Exception:  # only quoted in error messages; never fail on it
        return None
    return timeout.total_seconds() if isinstance(timeout, timedelta) else None


def _check_module(module: nn.Module) -> torch.device:
    if isinstance(module, nn.parallel.DistributedDataParallel | nn.DataParallel):
        raise ValueError(
            f"The module is already a {type(module).__name__}. Wrap the plain model once: "
            "DistributedDataParallel(model), not DistributedDataParallel("
            "DistributedDataParallel(model))."
        )
    if getattr(module, _WRAPPED_MARK, False):
        raise ValueError(
            f"This {type(module).__name__} is already wrapped by an "
            "amp_parallel.DistributedDataParallel; wrapping it twice would all-reduce every "
            "gradient twice. Reuse the existing wrapper."
        )
    devices = {p.device for p in module.parameters()}
    if len(devices) > 1:
        raise ValueError(
            f"The module's parameters are on several devices ({sorted(map(str, devices))}). "
            "DistributedDataParallel expects one device per process: move the model with "
            "model.to(device) (one GPU per rank, torch.cuda.set_device(local_rank)) "
            "before wrapping."
        )
    if not devices:
        raise ValueError(
            f"{type(module).__name__} has no parameters; DistributedDataParallel has nothing "
            "to synchronize."
        )
    (device,) = devices
    if device.type not in ("cpu", "cuda"):
        raise ValueError(
            f"Parameters on {device} are not supported; use CPU (Gloo) or CUDA (NCCL)."
        )
    return device


def _amp_master_weights(module: nn.Module) -> list[Tensor]:
    """The fp32 master weights amp-core keeps for ``module``'s params (O2), in param order."""
    try:  # amp-core is not a dependency of this package: without it there are no masters
        from amp_core import model_master_weights
    except ImportError:
        return []
    masters = model_master_weights(module)
    return [masters[p] for p in module.parameters() if p in masters]


class DistributedDataParallel(nn.parallel.DistributedDataParallel):
    """Apex's data-parallel wrapper: all-reduces gradients during backward.

    Parameters are broadcast from rank 0 at construction. During backward, gradients are
    gathered into buckets of ``message_size`` elements whose all-reduce overlaps the rest of
    backward (torch's DDP reducer does the bucketing and overlap; this class sets Apex's
    semantics through a communication hook).

    Args:
        module: The model, on one device (CPU or one GPU). Under amp, pass the model that
            ``amp.initialize`` returned.
        message_size: Bucket size in *elements* (Apex counts elements, torch counts MiB).
        delay_allreduce: All-reduce only after backward has finished (no overlap).
        shared_param: Removed in Apex; passing anything raises ``ValueError``.
        allreduce_trigger_params: Parameters whose gradients trigger an all-reduce of every
            gradient received so far (replaces ``message_size``-based triggering).
        retain_allreduce_buffers: Keep the reduced flat buffers in ``self.allreduce_buffers``
            (fp32 when ``allreduce_always_fp32``). Gradients are updated as well.
        allreduce_always_fp32: Up-cast half/bf16 gradients to fp32 for the all-reduce.
        num_allreduce_streams: Number of process groups used round-robin for the messages
            (concurrent NCCL streams on CUDA). Needs ``delay_allreduce=False``.
        allreduce_communicators: ``(process_groups, streams)`` to use instead of creating
            ``num_allreduce_streams`` groups; both lists must have ``num_allreduce_streams``
            entries. The streams are accepted for compatibility; torch's process groups
            manage their own streams.
        gradient_average: Divide the summed gradients by the world size.
        gradient_predivide_factor: Divide gradients by this before the all-reduce and multiply
            by ``factor / world_size`` after (with ``gradient_average=False`` the result is
            ``sum / factor``, as in Apex).
        gradient_average_split_factor: Deprecated name of ``gradient_predivide_factor``.
        prof: Label each all-reduce with ``torch.profiler.record_function`` (Apex: NVTX).
        process_group: Keyword-only. Process group to reduce over; the default group when None.
        broadcast_buffers: Keyword-only. Also broadcast the buffers from rank 0 at construction.
        find_unused_parameters: Keyword-only. Passed to torch: allow parameters that get no
            gradient in some iterations (costs a graph traversal per step).

    Raises:
        RuntimeError: If no process group is initialized.
        ValueError: For ``shared_param``, a module that is already wrapped, parameters on
            several devices, and option combinations Apex refused.

    Example:
        >>> torch.distributed.init_process_group("gloo")
        >>> model, optimizer = amp.initialize(model, optimizer, opt_level="O2")
        >>> model = DistributedDataParallel(model)
        >>> with amp.scale_loss(loss_fn(model(x), y), optimizer) as scaled:
        ...     scaled.backward()  # gradients are averaged across ranks here
        >>> optimizer.step()
    """

    def __init__(
        self,
        module: nn.Module,
        message_size: int = 10000000,
        delay_allreduce: bool = False,
        shared_param: Any = None,
        allreduce_trigger_params: Iterable[nn.Parameter] | None = None,
        retain_allreduce_buffers: bool = False,
        allreduce_always_fp32: bool = False,
        num_allreduce_streams: int = 1,
        allreduce_communicators: tuple[Sequence[ProcessGroup], Sequence[Any]] | None = None,
        gradient_average: bool = True,
        gradient_predivide_factor: float = 1.0,
        gradient_average_split_factor: float | None = None,
        prof: bool = False,
        *,
        process_group: ProcessGroup | None = None,
        broadcast_buffers: bool = False,
        find_unused_parameters: bool = False,
    ) -> None:
        require_initialized("amp_parallel.DistributedDataParallel")
        if shared_param is not None:
            raise ValueError(
                "shared_param is no longer supported (it was removed from Apex as well): "
                "overlapping communication with computation works with shared parameters. "
                "To all-reduce only after backward, pass delay_allreduce=True instead."
            )
        if gradient_average_split_factor is not None:
            warnings.warn(
                "gradient_average_split_factor has been renamed to gradient_predivide_factor; "
                "it still works for now, but pass gradient_predivide_factor instead.",
                FutureWarning,
                stacklevel=2,
            )
            gradient_predivide_factor = gradient_average_split_factor
        if gradient_predivide_factor <= 0:
            raise ValueError(
                f"gradient_predivide_factor must be positive, got {gradient_predivide_factor}."
            )
        if message_size < 1:
            raise ValueError(f"message_size counts elements and must be >= 1, got {message_size}.")
        if num_allreduce_streams < 1:
            raise ValueError(f"num_allreduce_streams must be >= 1, got {num_allreduce_streams}.")
        if num_allreduce_streams > 1 and delay_allreduce:
            raise ValueError(
                "num_allreduce_streams > 1 may only be used with delay_allreduce=False "
                "(with a delayed all-reduce there is nothing to overlap)."
            )
        groups: list[ProcessGroup | None]
        if allreduce_communicators is not None:
            comms, streams = allreduce_communicators
            if len(comms) != num_allreduce_streams or len(streams) != num_allreduce_streams:
                raise ValueError(
                    f"allreduce_communicators holds {len(comms)} communicators and "
                    f"{len(streams)} streams but num_allreduce_streams={num_allreduce_streams}; "
                    "pass num_allreduce_streams=len(communicators) and one stream per communicator."
                )
            groups = list(comms)
        elif num_allreduce_streams > 1:
            ranks = None if process_group is None else dist.get_process_group_ranks(process_group)
            groups = [dist.new_group(ranks=ranks) for _ in range(num_allreduce_streams)]
        else:
            groups = [process_group]
        trigger_ids: frozenset[int] | None = None
        if allreduce_trigger_params is not None:
            if delay_allreduce:
                raise ValueError(
                    "allreduce_trigger_params is only valid with delay_allreduce=False: "
                    "drop one of the two."
                )
            trigger_ids = frozenset(id(p) for p in allreduce_trigger_params)
            if not trigger_ids:
                raise ValueError("allreduce_trigger_params is empty; pass at least one parameter.")
        device = _check_module(module)
        own = {id(p) for p in module.parameters()}
        if trigger_ids is not None and not trigger_ids <= own:
            raise ValueError(
                "allreduce_trigger_params holds tensors that are not parameters of module."
            )

        itemsize = max(p.element_size() for p in module.parameters())
        # Trigger params: one parameter per bucket so messages can end exactly at a trigger.
        cap_bytes = 1 if trigger_ids is not None else message_size * itemsize
        with warnings.catch_warnings():
            # torch deprecates broadcast_buffers, but its replacement (forward_sync_buffers)
            # always syncs buffers at init; Apex never did, so keep broadcast_buffers=False.
            warnings.filterwarnings("ignore", "`broadcast_buffers` is deprecated", FutureWarning)
            super().__init__(
                module,
                device_ids=[device.index] if device.type == "cuda" else None,
                process_group=process_group,
                bucket_cap_mb=cap_bytes / _MIB,
                broadcast_buffers=False,
                find_unused_parameters=find_unused_parameters,
            )
        if broadcast_buffers:
            broadcast_tensors([b.data for b in module.buffers()], src=0, group=process_group)
        masters = _amp_master_weights(module)
        if masters:
            # amp O2 made fp32 masters on every rank before this wrap; the model's half weights
            # now hold rank 0's values, so the masters must too (else ranks diverge at step 1).
            broadcast_tensors(masters, src=0, group=process_group)
        setattr(module, _WRAPPED_MARK, True)

        self.message_size = message_size
        self.delay_allreduce = delay_allreduce
        self.retain_allreduce_buffers = retain_allreduce_buffers
        self.allreduce_always_fp32 = allreduce_always_fp32
        self.num_allreduce_streams = num_allreduce_streams
        self.gradient_average = gradient_average
        self.gradient_predivide_factor = gradient_predivide_factor
        self.prof = prof
        self._hook_state = HookState(
            groups=groups,
            world_size=dist.get_world_size(process_group),
            gradient_average=gradient_average,
            predivide=float(gradient_predivide_factor),
            always_fp32=allreduce_always_fp32,
            delay=delay_allreduce,
            trigger_ids=trigger_ids,
            retain=retain_allreduce_buffers,
            prof=prof,
            timeout_s=_pg_timeout_s(process_group, device),
            rank=dist.get_rank(),
        )
        self.register_comm_hook(self._hook_state, allreduce_hook)
        log.debug(
            "amp_parallel DDP: %d params on %s, bucket cap %d bytes, world %d",
            len(own),
            device,
            cap_bytes,
            self._hook_state.world_size,
        )

    @property
    def allreduce_buffers(self) -> list[torch.Tensor]:
        """The reduced flat buffers of the last backward (``retain_allreduce_buffers=True``)."""
        return list(self._hook_state.buffers)

    def enable_allreduce(self) -> None:
        """All-reduce gradients again in the following backward passes (the default)."""
        self.require_backward_grad_sync = True

    def disable_allreduce(self) -> None:
        """Skip the all-reduce in the following backward passes (gradient accumulation).

        Gradients accumulate locally until :meth:`enable_allreduce`; the backward after it
        all-reduces the accumulated sum. Same as torch's ``no_sync()`` without a context.
        """
        self.require_backward_grad_sync = False
