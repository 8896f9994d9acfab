"""Word-level language model trained with the legacy ``FP16_Optimizer``.

A rebuild of Apex's ``examples/word_language_model/main_fp16_optimizer.py``: the model is
cast to half precision by hand (float16 on CUDA, bfloat16 on CPU), ``FP16_Optimizer`` keeps
fp32 master weights, scales the loss in ``optimizer.backward(loss)`` and clips the master
gradients with ``clip_master_grads``. New code should use amp (see ``main.py``); this script
shows the migration starting point.

Usage:
    python examples/word_language_model/main_fp16_optimizer.py --smoke
    python examples/word_language_model/main_fp16_optimizer.py --dynamic-loss-scale
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch
from common import LOG, finish_args, load, make_model, make_optimizer, make_parser, setup, train
from torch import Tensor

from amp_legacy_fp16 import FP16_Optimizer


def main(argv: Sequence[str] | None = None) -> int:
    parser = make_parser((__doc__ or "").splitlines()[0])
    parser.add_argument("--static-loss-scale", type=float, default=None)
    parser.add_argument("--dynamic-loss-scale", action="store_true")
    args = finish_args(parser, argv)
    device, half = setup(args)
    corpus = load(args)
    model = make_model(args, corpus, device).to(half)  # all half, as in Apex's example
    optimizer = make_optimizer(args, model)  # over the half parameters; FP16_Optimizer
    # builds the fp32 master copies and hands them to it
    # bfloat16 has float32's exponent range: no loss scaling needed unless asked for.
    static = args.static_loss_scale
    if static is None:
        static = 128.0 if half == torch.float16 and not args.dynamic_loss_scale else 1.0
    fp16_optimizer = FP16_Optimizer(
        optimizer,
        static_loss_scale=static,
        dynamic_loss_scale=args.dynamic_loss_scale,
        verbose=False,
    )
    LOG.info(
        "%s, %s, FP16_Optimizer, model %s, loss scale %s, %s lr %g, torch %s",
        args.model,
        device,
        str(half).removeprefix("torch."),
        "dynamic" if args.dynamic_loss_scale else static,
        args.optimizer,
        args.lr,
        torch.__version__,
    )

    def step(loss: Tensor) -> None:
        fp16_optimizer.zero_grad()
        fp16_optimizer.backward(loss)  # scales, backprops, copies unscaled grads to masters
        fp16_optimizer.clip_master_grads(args.clip)
        fp16_optimizer.step()

    train(args, model, fp16_optimizer, corpus, device, step)
    LOG.info("final loss scale %s", fp16_optimizer.loss_scale)
    return 0


if __name__ == "__main__":
    sys.exit(main())
