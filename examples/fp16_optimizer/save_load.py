"""Checkpoint and resume FP16_Optimizer: the resumed run matches the uninterrupted one bitwise.

Trains a few steps, saves ``model.state_dict()`` and ``optimizer.state_dict()`` (fp32 masters,
loss scaler, the wrapped Adam's state), trains on; then builds a fresh model and optimizer,
loads the checkpoint and trains the same steps again, and compares every parameter.

Usage:
    python examples/fp16_optimizer/save_load.py [--dtype bf16|fp16] [--checkpoint PATH] [--smoke]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import warnings

import torch
import torch.nn.functional as F

from amp_legacy_fp16 import FP16_Optimizer, convert_network

LOG = logging.getLogger("save_load")
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def build(dtype: torch.dtype, device: torch.device) -> tuple[torch.nn.Module, FP16_Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 1)
    ).to(device)
    model = convert_network(model, dtype)  # the batchnorm stays fp32: a mixed optimizer
    optimizer = FP16_Optimizer(
        torch.optim.Adam(model.parameters(), lr=1e-2),
        dynamic_loss_scale=True,
        dynamic_loss_args={"init_scale": 2.0**16},
        verbose=False,
    )
    return model, optimizer


def train(model: torch.nn.Module, optimizer: FP16_Optimizer, steps: range, dtype: torch.dtype):
    device = next(model.parameters()).device
    for step in steps:
        g = torch.Generator().manual_seed(step)  # the batch depends on the step only
        x = torch.randn(32, 8, generator=g).to(device)
        y = x.sum(dim=1, keepdim=True)
        optimizer.zero_grad()
        loss = F.mse_loss(model(x.to(dtype)).float(), y)
        optimizer.backward(loss)
        optimizer.step()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = "fp16" if torch.cuda.is_available() else "bf16"
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=default)
    parser.add_argument("--checkpoint", default=None, help="where to save (a temp file if unset)")
    parser.add_argument(
        "--smoke", action="store_true", help="3 steps before and after the checkpoint, not 10"
    )
    args = parser.parse_args(argv)
    half = 3 if args.smoke else 10
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    warnings.simplefilter("ignore", FutureWarning)  # this example uses the legacy API on purpose
    dtype = DTYPES[args.dtype]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    model, optimizer = build(dtype, device)
    train(model, optimizer, range(0, half), dtype)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.checkpoint or os.path.join(tmp, "checkpoint.pt")
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)
        train(model, optimizer, range(half, 2 * half), dtype)  # the uninterrupted run

        resumed_model, resumed_optimizer = build(dtype, device)
        checkpoint = torch.load(path, weights_only=True)
    resumed_model.load_state_dict(checkpoint["model"])
    resumed_optimizer.load_state_dict(checkpoint["optimizer"])
    train(resumed_model, resumed_optimizer, range(half, 2 * half), dtype)

    same = all(
        torch.equal(a, b)
        for a, b in zip(
            model.state_dict().values(), resumed_model.state_dict().values(), strict=True
        )
    )
    same &= all(
        torch.equal(a, b)
        for a, b in zip(
            optimizer.all_fp32_from_fp16_params,
            resumed_optimizer.all_fp32_from_fp16_params,
            strict=True,
        )
    )
    LOG.info("resumed run matches the uninterrupted one bitwise: %s", same)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
