"""A training script written for NVIDIA Apex, as many projects wrote them: it imports every Apex
module the amp toolkit provides, under Apex's names, and trains a small model with amp O2,
FusedAdam, FusedLayerNorm and, when started by torchrun, Apex's DistributedDataParallel and
SyncBatchNorm. Run it with ``python -m amp_legacy_fp16.apex_run train_with_apex.py``.

Prints ``names <n>``, one ``step <i> loss <x>`` per step, and ``rank <r> ok``.
"""

import argparse
import gc
import importlib
import importlib.metadata
import importlib.util
import os

import torch
import torch.distributed as dist

# The probes libraries run before they use Apex (transformers' is_apex_available).
assert importlib.util.find_spec("apex") is not None
assert importlib.metadata.version("apex")

import amp_C  # noqa: E402
import apex  # noqa: E402
import apex_C  # noqa: E402, F401
from apex import amp  # noqa: E402
from apex.fp16_utils import FP16_Optimizer  # noqa: E402, F401
from apex.multi_tensor_apply import multi_tensor_applier  # noqa: E402
from apex.normalization import FusedLayerNorm  # noqa: E402
from apex.normalization.fused_layer_norm import FusedLayerNormAffineFunction  # noqa: E402
from apex.optimizers import FusedAdam  # noqa: E402
from apex.parallel import DistributedDataParallel as DDP  # noqa: E402
from apex.parallel import convert_syncbn_model  # noqa: E402
from apex.parallel.distributed import flat_dist_call  # noqa: E402

# Apex's public names (release 24.04), module by module.
APEX_NAMES = {
    "apex.amp": [
        "init", "half_function", "float_function", "promote_function", "register_half_function",
        "register_float_function", "register_promote_function", "scale_loss", "disable_casts",
        "initialize", "state_dict", "load_state_dict", "master_params",
    ],
    "apex.optimizers": [
        "FusedSGD", "FusedAdam", "FusedNovoGrad", "FusedLAMB", "FusedAdagrad",
        "FusedMixedPrecisionLamb",
    ],
    "apex.optimizers.fused_adam": ["FusedAdam"],
    "apex.optimizers.fused_sgd": ["FusedSGD"],
    "apex.optimizers.fused_lamb": ["FusedLAMB"],
    "apex.optimizers.fused_novograd": ["FusedNovoGrad"],
    "apex.optimizers.fused_adagrad": ["FusedAdagrad"],
    "apex.optimizers.fused_mixed_precision_lamb": ["FusedMixedPrecisionLamb"],
    "apex.normalization": [
        "FusedLayerNorm", "MixedFusedLayerNorm", "FusedRMSNorm", "MixedFusedRMSNorm",
    ],
    "apex.normalization.fused_layer_norm": [
        "FusedLayerNorm", "MixedFusedLayerNorm", "FusedRMSNorm", "MixedFusedRMSNorm",
        "FusedLayerNormAffineFunction", "FusedLayerNormAffineMixedDtypesFunction",
        "FusedLayerNormFunction", "FusedRMSNormAffineFunction",
        "FusedRMSNormAffineMixedDtypesFunction", "FusedRMSNormFunction", "fused_layer_norm",
        "fused_layer_norm_affine", "fused_rms_norm", "fused_rms_norm_affine",
        "mixed_dtype_fused_layer_norm_affine", "mixed_dtype_fused_rms_norm_affine",
        "manual_rms_norm",
    ],
    "apex.multi_tensor_apply": ["MultiTensorApply", "multi_tensor_applier"],
    "apex.multi_tensor_apply.multi_tensor_apply": ["MultiTensorApply"],
    "apex.parallel": [
        "ReduceOp", "DistributedDataParallel", "Reducer", "SyncBatchNorm",
        "convert_syncbn_model", "create_syncbn_process_group",
    ],
    "apex.parallel.distributed": [
        "DistributedDataParallel", "Reducer", "flat_dist_call", "apply_flat_dist_call",
        "split_by_type", "split_half_float_double", "extract_tensors",
    ],
    "apex.parallel.LARC": ["LARC"],
    "apex.parallel.sync_batchnorm": ["SyncBatchNorm"],
    "apex.parallel.optimized_sync_batchnorm": ["SyncBatchNorm"],
    "apex.fp16_utils": [
        "BN_convert_float", "network_to_half", "prep_param_lists", "model_grads_to_master_grads",
        "master_params_to_model_params", "tofp16", "to_python_float", "clip_grad_norm",
        "convert_module", "convert_network", "FP16Model", "FP16_Optimizer", "LossScaler",
        "DynamicLossScaler",
    ],
    "apex.fp16_utils.fp16_optimizer": ["FP16_Optimizer"],
    "apex.fp16_utils.fp16util": ["network_to_half", "FP16Model", "prep_param_lists"],
    "apex.fp16_utils.loss_scaler": ["LossScaler", "DynamicLossScaler"],
    "amp_C": [
        "multi_tensor_scale", "multi_tensor_axpby", "multi_tensor_l2norm",
        "multi_tensor_adam", "multi_tensor_sgd", "multi_tensor_lamb", "multi_tensor_novograd",
        "multi_tensor_adagrad",
    ],
    "apex_C": ["flatten", "unflatten"],
}  # fmt: skip


def check_names() -> int:
    count = 0
    for module_name, names in APEX_NAMES.items():
        module = importlib.import_module(module_name)
        for name in names:
            getattr(module, name)  # AttributeError names what is missing
            count += 1
    # The objects are the toolkit's own.
    import amp_fused_ops
    import amp_optimizers

    assert FusedAdam is amp_optimizers.FusedAdam
    assert FusedLayerNorm is amp_fused_ops.FusedLayerNorm
    assert amp_C.multi_tensor_adam is amp_fused_ops.amp_C.multi_tensor_adam
    assert apex.optimizers is importlib.import_module("apex.optimizers")
    assert multi_tensor_applier.available
    return count


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.bn = torch.nn.BatchNorm1d(16)
        self.norm = FusedLayerNorm(16)
        self.fc2 = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn(self.fc1(x)))
        h = FusedLayerNormAffineFunction.apply(
            h, self.norm.weight, self.norm.bias, self.norm.normalized_shape, self.norm.eps
        )
        return self.fc2(h)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--opt-level", default="O2")
    args = parser.parse_args()

    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    print(f"names {check_names()}", flush=True)

    torch.manual_seed(0)
    model = Net()
    if distributed:
        # As NVIDIA's BERT scripts start: rank 0's weights everywhere, one broadcast per type.
        with torch.no_grad():
            for p in model.parameters():
                p.add_(rank)
        flat_dist_call([p.data for p in model.parameters()], dist.broadcast, (0,))
        torch.manual_seed(0)
        fresh = Net().parameters()
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), fresh, strict=True))
        averaged = torch.full((3,), float(rank))
        flat_dist_call([averaged], dist.all_reduce)
        assert torch.equal(averaged, torch.full((3,), 0.5)), averaged
    if distributed:
        model = convert_syncbn_model(model)
    optimizer = FusedAdam(model.parameters(), lr=1e-2)
    model, optimizer = amp.initialize(
        model, optimizer, opt_level=args.opt_level, loss_scale="dynamic", verbosity=0
    )
    if distributed:
        model = DDP(model)
    gen = torch.Generator().manual_seed(100 + rank)
    for step in range(args.steps):
        x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 4, generator=gen)
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        print(f"step {step} loss {loss.item():.6f}", flush=True)

    if distributed:  # every rank holds the same weights after synchronized steps
        flat = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
        gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, flat)
        assert all(torch.equal(g, gathered[0]) for g in gathered), "ranks diverged"
        # Free the DDP wrapper before the group goes: Gloo threads it holds that outlive
        # destroy_process_group can abort the process at exit.
        del model, optimizer
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
    print(f"rank {rank} ok", flush=True)


if __name__ == "__main__":
    main()
