"""Per-call host cost of the amp_C ops: how much Python runs between the call and the kernel.

Times ``amp_C.multi_tensor_scale`` (2 lists; also through ``multi_tensor_applier``, as Apex's
callers make it) and ``amp_C.multi_tensor_adam`` (4 lists) on tiny tensors, where the kernels'
own work is negligible, and ``FusedAdam.step`` on 100 tiny tensors beside
``torch.optim.AdamW(fused=True).step`` on the same, against ``torch._foreach_mul_`` (one ATen
call) as the floor of a dispatcher call from Python. Each
variant runs ``--calls`` times per round; rounds alternate the variants. ``--import-dtensor``
imports ``torch.distributed.tensor`` first, as FSDP2 code does, after which the ops look for
DTensor arguments.

    python benchmarks/bench_amp_C_call.py            # CPU
    python benchmarks/bench_amp_C_call.py --device cuda
    python benchmarks/bench_amp_C_call.py --import-dtensor
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import time
from pathlib import Path

import torch

from amp_fused_ops import amp_C, extensions, multi_tensor_applier
from amp_optimizers import FusedAdam

DEFAULT_OUT_DIR = Path(__file__).resolve().parent / "out"


def _variants(device: torch.device, tensors: int) -> dict[str, object]:
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    xs = [torch.ones(4, device=device) for _ in range(tensors)]
    ys = [torch.empty(4, device=device) for _ in range(tensors)]
    m = [torch.zeros(4, device=device) for _ in range(tensors)]
    v = [torch.zeros(4, device=device) for _ in range(tensors)]
    params = [torch.nn.Parameter(torch.ones(4, device=device)) for _ in range(100)]
    for p in params:
        p.grad = torch.full_like(p, 0.1)
    optimizer = FusedAdam(params, lr=1e-3)
    torch_params = [torch.nn.Parameter(torch.ones(4, device=device)) for _ in range(100)]
    for p in torch_params:
        p.grad = torch.full_like(p, 0.1)
    torch_fused = torch.optim.AdamW(torch_params, lr=1e-3, fused=True)
    return {
        "torch._foreach_mul_ (floor)": lambda: torch._foreach_mul_(ys, 1.0),
        "amp_C.multi_tensor_scale": lambda: amp_C.multi_tensor_scale(
            2048 * 32, flag, [xs, ys], 1.0
        ),
        "multi_tensor_applier(scale)": lambda: multi_tensor_applier(
            amp_C.multi_tensor_scale, flag, [xs, ys], 1.0
        ),
        "amp_C.multi_tensor_adam": lambda: amp_C.multi_tensor_adam(
            2048 * 32, flag, [ys, xs, m, v], 0.0, 0.9, 0.999, 1e-8, 1, 1, 1, 0.0
        ),
        "FusedAdam.step (100 tensors)": optimizer.step,
        "torch AdamW(fused=True).step (100 tensors)": torch_fused.step,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--tensors", type=int, default=1, help="tensors per list")
    parser.add_argument("--calls", type=int, default=2000, help="calls per variant and round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    parser.add_argument(
        "--import-dtensor", action="store_true", help="import torch.distributed.tensor first"
    )
    args = parser.parse_args()
    if args.import_dtensor:
        importlib.import_module("torch.distributed.tensor")
    device = torch.device(args.device)
    extensions.get_extension(args.device)
    variants = _variants(device, args.tensors)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for call in variants.values():  # warm-up (and first-use loading)
        call()  # type: ignore[operator]
    for _ in range(args.rounds):
        for name, call in variants.items():
            sync()
            start = time.perf_counter()
            for _ in range(args.calls):
                call()  # type: ignore[operator]
            sync()
            samples[name].append((time.perf_counter() - start) / args.calls * 1e6)
    dtensor = ", torch.distributed.tensor imported" if args.import_dtensor else ""
    print(f"{device.type}, torch {torch.__version__}, {torch.get_num_threads()} threads{dtensor}")
    print(f"{'variant':34s} {'median us':>10s} {'min us':>8s}")
    for name, values in samples.items():
        print(f"{name:34s} {statistics.median(values):10.2f} {min(values):8.2f}")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    suffix = "_dtensor" if args.import_dtensor else ""
    out = args.out_dir / f"amp_C_call_{device.type}{suffix}.json"
    record = {"torch": torch.__version__, "dtensor": args.import_dtensor, "samples_us": samples}
    out.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
