"""Word-level language model (LSTM or Transformer) trained under amp, opt levels O0-O3.

A rebuild of Apex's ``examples/word_language_model/main.py`` on the amp toolkit. The corpus
is the Python standard library's own source code (see ``data.py``); the script reports the
validation perplexity every epoch and the test perplexity at the end. Gradients are clipped
on amp's master parameters after ``amp.scale_loss`` has unscaled them.

Usage:
    python examples/word_language_model/main.py --smoke                     # CPU, seconds
    python examples/word_language_model/main.py --model Transformer --opt-level O2
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch
from common import LOG, finish_args, load, make_model, make_optimizer, make_parser, setup, train
from torch import Tensor

from amp_core import amp


def main(argv: Sequence[str] | None = None) -> int:
    parser = make_parser((__doc__ or "").splitlines()[0])
    parser.add_argument("--opt-level", choices=("O0", "O1", "O2", "O3"), default="O1")
    parser.add_argument("--loss-scale", type=str, default=None, help='"dynamic" or a number')
    args = finish_args(parser, argv)
    device, half = setup(args)
    corpus = load(args)
    model = make_model(args, corpus, device)
    optimizer = make_optimizer(args, model)
    loss_scale: str | float | None = args.loss_scale
    if loss_scale not in (None, "dynamic"):
        loss_scale = float(loss_scale)
    model, optimizer = amp.initialize(
        model,
        optimizer,
        opt_level=args.opt_level,
        loss_scale=loss_scale,
        verbosity=0,
        half_dtype=half,
    )
    LOG.info(
        "%s, %s, opt level %s, model %s, amp half %s, %s lr %g, torch %s",
        args.model,
        device,
        args.opt_level,
        str(next(model.parameters()).dtype).removeprefix("torch."),
        str(half).removeprefix("torch."),
        args.optimizer,
        args.lr,
        torch.__version__,
    )

    def step(loss: Tensor) -> None:
        optimizer.zero_grad()
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        # Leaving the context unscaled the gradients into the master parameters.
        torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), args.clip)
        optimizer.step()

    train(args, model, optimizer, corpus, device, step)
    LOG.info(
        "loss scale %s, skipped steps %d",
        amp.state_dict()["loss_scaler0"]["loss_scale"],
        amp.skipped_steps(optimizer),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
