"""FP16_Optimizer in its simplest form: a half model, fp32 masters, static or dynamic scaling.

Trains a small regression MLP for a few steps twice, once with a static loss scale and once
with a dynamic one, and checks that the loss went down. bf16 on CPU, fp16 on CUDA by default.

Usage:
    python examples/fp16_optimizer/minimal.py [--dtype bf16|fp16] [--steps 30] [--smoke]

Migration: ``from apex.fp16_utils import FP16_Optimizer`` ->
``from amp_legacy_fp16 import FP16_Optimizer``.
"""

from __future__ import annotations

import argparse
import logging
import sys
import warnings

import torch
import torch.nn.functional as F

from amp_legacy_fp16 import FP16_Optimizer, convert_network

LOG = logging.getLogger("minimal")
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def train(dtype: torch.dtype, device: torch.device, steps: int, dynamic: bool) -> list[float]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)
    ).to(device)
    model = convert_network(model, dtype)  # half params (batchnorm would stay fp32)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if dynamic:
        optimizer = FP16_Optimizer(optimizer, dynamic_loss_scale=True, verbose=False)
    else:
        optimizer = FP16_Optimizer(optimizer, static_loss_scale=128.0, verbose=False)
    x = torch.randn(64, 16, device=device)
    y = x[:, :1] * 2.0 - x[:, 1:2]
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = F.mse_loss(model(x.to(dtype)).float(), y)
        optimizer.backward(loss)  # instead of loss.backward()
        optimizer.step()
        losses.append(loss.item())
    LOG.info(
        "%s scaling: loss %.4f -> %.4f, final loss scale %s",
        "dynamic" if dynamic else "static",
        losses[0],
        losses[-1],
        optimizer.loss_scale,
    )
    return losses


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = "fp16" if torch.cuda.is_available() else "bf16"
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=default)
    parser.add_argument("--steps", type=int, default=None, help="training steps (default 30)")
    parser.add_argument("--smoke", action="store_true", help="15 steps (seconds on a CPU)")
    args = parser.parse_args(argv)
    if args.steps is None:
        args.steps = 15 if args.smoke else 30
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    warnings.simplefilter("ignore", FutureWarning)  # this example uses the legacy API on purpose
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ok = True
    for dynamic in (False, True):
        losses = train(DTYPES[args.dtype], device, args.steps, dynamic)
        ok &= losses[-1] < 0.5 * losses[0]
    if not ok:
        LOG.error("the loss did not halve")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
