"""FP16_Optimizer with closures: SGD (one call per step) and LBFGS (several calls per step).

The closure zeroes the grads, computes the loss and calls ``optimizer.backward(loss)``;
between LBFGS's calls the half params are refreshed from the fp32 masters it moves.

Usage:
    python examples/fp16_optimizer/closure.py [--dtype bf16|fp16] [--steps 10] [--smoke]
"""

from __future__ import annotations

import argparse
import logging
import sys
import warnings

import torch
import torch.nn.functional as F

from amp_legacy_fp16 import FP16_Optimizer

LOG = logging.getLogger("closure")
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def train(name: str, dtype: torch.dtype, device: torch.device, steps: int) -> tuple[float, float]:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1).to(device=device, dtype=dtype)
    x = torch.randn(128, 8, device=device)
    y = x @ torch.linspace(-1.0, 1.0, 8, device=device).unsqueeze(1) + 0.5
    if name == "lbfgs":
        inner: torch.optim.Optimizer = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=5)
    else:
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer = FP16_Optimizer(inner, dynamic_loss_scale=True, verbose=False)

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = F.mse_loss(model(x.to(dtype)).float(), y)
        optimizer.backward(loss)
        return loss

    def evaluate() -> float:
        with torch.no_grad():
            return F.mse_loss(model(x.to(dtype)).float(), y).item()

    first = evaluate()
    for _ in range(steps):
        optimizer.step(closure)
    last = evaluate()
    LOG.info("%s: loss %.4f -> %.4f", name, first, last)
    return first, last


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = "fp16" if torch.cuda.is_available() else "bf16"
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=default)
    parser.add_argument("--steps", type=int, default=None, help="training steps (default 10)")
    parser.add_argument("--smoke", action="store_true", help="5 steps (seconds on a CPU)")
    args = parser.parse_args(argv)
    if args.steps is None:
        args.steps = 5 if args.smoke else 10
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    warnings.simplefilter("ignore", FutureWarning)  # this example uses the legacy API on purpose
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ok = True
    for name in ("sgd", "lbfgs"):
        first, last = train(name, DTYPES[args.dtype], device, args.steps)
        ok &= last < 0.5 * first
    if not ok:
        LOG.error("the loss did not halve")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
