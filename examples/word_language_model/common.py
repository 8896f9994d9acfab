"""What main.py (amp) and main_fp16_optimizer.py (legacy FP16_Optimizer) share.

Each script supplies a ``StepFn``: it gets the loss of one BPTT segment and does the backward
pass, gradient clipping and optimizer step its own way. Everything else (arguments, corpus,
model, the training and evaluation loops, the per-epoch report) lives here.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from data import Corpus, batchify, get_batch, load_corpus
from model import build_model, detach
from torch import Tensor, nn

LOG = logging.getLogger("word_language_model")

HALF_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
StepFn = Callable[[Tensor], None]
SMOKE = {
    "epochs": 2, "max_files": 40, "max_tokens": 30_000, "vocab_size": 500, "emsize": 64,
    "nhid": 64, "nlayers": 1, "bptt": 32, "batch_size": 16, "eval_batch_size": 16,
}  # fmt: skip


def make_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--model", choices=("LSTM", "Transformer"), default="LSTM")
    parser.add_argument("--emsize", type=int, default=512, help="embedding size")
    parser.add_argument("--nhid", type=int, default=512, help="hidden / feed-forward size")
    parser.add_argument("--nlayers", type=int, default=2)
    parser.add_argument("--nhead", type=int, default=4, help="Transformer heads")
    parser.add_argument("--dropout", type=float, default=0.2)
    parser.add_argument("--optimizer", choices=("sgd", "fused_adam"), default="sgd")
    parser.add_argument(
        "--lr",
        type=float,
        default=None,
        help="default: SGD 20 (LSTM) or 5 (Transformer); Adam 2e-3 (1e-2 with --smoke)",
    )
    parser.add_argument("--clip", type=float, default=0.25, help="max gradient norm")
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--eval-batch-size", type=int, default=10)
    parser.add_argument("--bptt", type=int, default=64, help="sequence length")
    parser.add_argument("--max-files", type=int, default=10_000, help="stdlib files to read")
    parser.add_argument("--max-tokens", type=int, default=3_000_000)
    parser.add_argument("--vocab-size", type=int, default=20_000)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--half-dtype", choices=("auto", *HALF_DTYPES), default="auto")
    parser.add_argument("--seed", type=int, default=1111)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--smoke", action="store_true", help="tiny CPU-sized run (seconds)")
    return parser


def finish_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    args = parser.parse_args(argv)
    if args.smoke:
        for key, value in SMOKE.items():  # flags given explicitly win
            if parser.get_default(key) == getattr(args, key):
                setattr(args, key, value)
    if args.lr is None:
        if args.optimizer == "fused_adam":
            # The smoke model is tiny and trains for 2 short epochs: a larger step suits it.
            args.lr = 1e-2 if args.smoke else 2e-3
        else:
            args.lr = 20.0 if args.model == "LSTM" else 5.0
    return args


def setup(args: argparse.Namespace) -> tuple[torch.device, torch.dtype]:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    name = args.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for, but torch.cuda.is_available() is False")
    device = torch.device(name)
    if args.half_dtype == "auto":
        half = torch.float16 if device.type == "cuda" else torch.bfloat16
    else:
        half = HALF_DTYPES[args.half_dtype]
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    return device, half


def make_model(args: argparse.Namespace, corpus: Corpus, device: torch.device) -> nn.Module:
    return build_model(
        args.model,
        len(corpus.vocab),
        args.emsize,
        args.nhid,
        args.nlayers,
        args.nhead,
        args.dropout,
    ).to(device)


def make_optimizer(args: argparse.Namespace, model: nn.Module) -> torch.optim.Optimizer:
    if args.optimizer == "fused_adam":
        try:
            from amp_optimizers import FusedAdam
        except ImportError as error:
            raise RuntimeError(
                f"--optimizer fused_adam needs amp_optimizers.FusedAdam, which failed to "
                f"import ({error}); install amp-optimizers or use --optimizer sgd"
            ) from error
        optimizer: torch.optim.Optimizer = FusedAdam(model.parameters(), lr=args.lr)
        return optimizer
    return torch.optim.SGD(model.parameters(), lr=args.lr)


def load(args: argparse.Namespace) -> Corpus:
    corpus = load_corpus(args.max_files, args.max_tokens, args.vocab_size)
    LOG.info(
        "corpus: %d stdlib files (%s .. %s), vocabulary %d, tokens train %d / valid %d / test %d",
        len(corpus.files),
        corpus.files[0],
        corpus.files[-1],
        len(corpus.vocab),
        corpus.train.numel(),
        corpus.valid.numel(),
        corpus.test.numel(),
    )
    # The bar a model must clear to show it uses context: the perplexity of word frequencies
    # alone (add-one counts of the training split) on the test split.
    counts = torch.bincount(corpus.train, minlength=len(corpus.vocab)).double() + 1.0
    log_freq = (counts / counts.sum()).log()
    LOG.info("unigram test_ppl %.2f", math.exp(-log_freq[corpus.test].mean().item()))
    return corpus


@torch.no_grad()
def evaluate(model: nn.Module, source: Tensor, bptt: int) -> float:
    """Mean next-word cross entropy (nats per token) over ``source`` (T_total, B)."""
    model.eval()
    total, count, hidden = 0.0, 0, None
    for i in range(0, source.shape[0] - 1, bptt):
        inputs, targets = get_batch(source, i, bptt)
        logits, hidden = model(inputs, hidden)  # (T, B, V)
        total += F.cross_entropy(logits.float().flatten(0, 1), targets, reduction="sum").item()
        count += targets.numel()
    return total / count


def set_lr(optimizer: object, lr: float) -> None:
    for group in optimizer.param_groups:  # type: ignore[attr-defined]
        group["lr"] = lr


def train(
    args: argparse.Namespace,
    model: nn.Module,
    optimizer: object,
    corpus: Corpus,
    device: torch.device,
    step: StepFn,
) -> float:
    """Train for ``args.epochs``, print one line per epoch, return the test perplexity.

    The learning rate is divided by 4 after every epoch whose validation loss did not
    improve, as in PyTorch's word_language_model example.
    """
    train_data = batchify(corpus.train, args.batch_size, device)  # (T, B)
    valid_data = batchify(corpus.valid, args.eval_batch_size, device)
    test_data = batchify(corpus.test, args.eval_batch_size, device)
    lr, best = args.lr, math.inf
    for epoch in range(args.epochs):
        model.train()
        hidden, total, count = None, 0.0, 0
        start = time.perf_counter()
        for i in range(0, train_data.shape[0] - 1, args.bptt):
            inputs, targets = get_batch(train_data, i, args.bptt)
            hidden = detach(hidden)
            logits, hidden = model(inputs, hidden)  # (T, B, V)
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets)
            step(loss)
            total += loss.item() * targets.numel()
            count += targets.numel()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - start
        valid_loss = evaluate(model, valid_data, args.bptt)
        LOG.info(
            "epoch %d/%d lr %.4g train_loss %.4f tokens/s %.0f valid_loss %.4f valid_ppl %.2f",
            epoch + 1,
            args.epochs,
            lr,
            total / count,
            count / elapsed,
            valid_loss,
            math.exp(valid_loss),
        )
        if valid_loss < best:
            best = valid_loss
        else:
            lr /= 4.0
            set_lr(optimizer, lr)
    test_loss = evaluate(model, test_data, args.bptt)
    LOG.info("test_loss %.4f test_ppl %.2f", test_loss, math.exp(test_loss))
    return math.exp(test_loss)
