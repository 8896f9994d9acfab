"""Host cost of the fused norms: forward + backward on tiny inputs, against PyTorch's modules.

On a ``(4, 32)`` input the kernels' own work is negligible, so the time per step is what runs
on the host between the call and the kernels: the module, the op call, the autograd node and
the backward. Each step is ``module(x).sum().backward()``, or with ``--no-grad`` the forward
alone under ``torch.no_grad()`` (inference: no autograd node); the variants alternate in rounds
(one process, interleaved) and the table gives the median per step and the ratio to PyTorch's
own module of the same kind.

    python benchmarks/bench_norm_host.py            # CPU
    python benchmarks/bench_norm_host.py --device cuda
    python benchmarks/bench_norm_host.py --no-grad
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from amp_fused_ops import FusedLayerNorm, FusedRMSNorm, extensions

DEFAULT_OUT_DIR = Path(__file__).resolve().parent / "out"


def _variants(
    device: torch.device, rows: int, hidden: int, no_grad: bool
) -> dict[str, Callable[[], None]]:
    x = torch.randn(rows, hidden, device=device, requires_grad=not no_grad)
    modules = {
        "torch.nn.LayerNorm": torch.nn.LayerNorm(hidden),
        "FusedLayerNorm": FusedLayerNorm(hidden),
        "torch.nn.RMSNorm": torch.nn.RMSNorm(hidden),
        "FusedRMSNorm": FusedRMSNorm(hidden),
    }

    def step(module: torch.nn.Module) -> Callable[[], None]:
        module.to(device)

        def run() -> None:
            module(x).sum().backward()

        def infer() -> None:
            with torch.no_grad():
                module(x)

        return infer if no_grad else run

    return {name: step(module) for name, module in modules.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--calls", type=int, default=1000, help="steps per variant and round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    parser.add_argument(
        "--no-grad", action="store_true", help="time the forward alone under torch.no_grad()"
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    extensions.get_extension(args.device)  # the compiled kernels, as a user's first call would
    variants = _variants(device, args.rows, args.hidden, args.no_grad)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for call in variants.values():  # warm-up
        for _ in range(50):
            call()
    for _ in range(args.rounds):
        for name, call in variants.items():
            sync()
            start = time.perf_counter()
            for _ in range(args.calls):
                call()
            sync()
            samples[name].append((time.perf_counter() - start) / args.calls * 1e6)
    median = {name: statistics.median(values) for name, values in samples.items()}
    baseline = {"FusedLayerNorm": "torch.nn.LayerNorm", "FusedRMSNorm": "torch.nn.RMSNorm"}
    print(
        f"{device.type}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"input ({args.rows}, {args.hidden}), "
        f"{'forward under torch.no_grad()' if args.no_grad else 'forward + backward'} per step"
    )
    print(f"{'variant':22s} {'median us':>10s} {'min us':>8s} {'x torch':>8s}")
    for name, values in samples.items():
        ratio = f"{median[name] / median[baseline[name]]:8.2f}" if name in baseline else ""
        print(f"{name:22s} {median[name]:10.2f} {min(values):8.2f} {ratio}")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = args.out_dir / f"norm_host_{device.type}{'_no_grad' if args.no_grad else ''}.json"
    out.write_text(json.dumps({"torch": torch.__version__, "samples_us": samples}, indent=1))


if __name__ == "__main__":
    main()
