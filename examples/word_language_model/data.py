"""The corpus of the word language model: the Python standard library's own source files.

The file list is deterministic (the ``*.py`` files directly in the standard library folder,
sorted by name, the first ``max_files``), the text is split into word and punctuation tokens
with one ``<eos>`` per line, the vocabulary is capped to the most frequent words (the rest
become ``<unk>``), and the token stream is cut 80/10/10 into train / valid / test.
"""

from __future__ import annotations

import re
import sysconfig
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

TOKEN = re.compile(r"[A-Za-z_][A-Za-z_0-9]*|\d+|[^\sA-Za-z_0-9]")
UNK, EOS = "<unk>", "<eos>"


@dataclass(frozen=True)
class Corpus:
    """Token ids of the three splits and the vocabulary (index = id)."""

    vocab: list[str]
    train: Tensor  # (N_train,) int64
    valid: Tensor  # (N_valid,)
    test: Tensor  # (N_test,)
    files: list[str]


def stdlib_files(max_files: int) -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.is_file())
    if not files:
        raise RuntimeError(
            f"no *.py files in the standard library folder {root}; this corpus needs a Python "
            "installed with its library sources"
        )
    return files[:max_files]


def tokenize(text: str) -> list[str]:
    tokens: list[str] = []
    for line in text.splitlines():
        words = TOKEN.findall(line)
        if words:
            tokens.extend(words)
            tokens.append(EOS)
    return tokens


def load_corpus(max_files: int, max_tokens: int, vocab_size: int) -> Corpus:
    """Tokens of the first ``max_files`` stdlib files, at most ``max_tokens`` of them."""
    files = stdlib_files(max_files)
    tokens: list[str] = []
    for path in files:
        tokens.extend(tokenize(path.read_text(encoding="utf-8", errors="replace")))
        if len(tokens) >= max_tokens:
            break
    tokens = tokens[:max_tokens]
    counts = Counter(tokens)
    # Most frequent first, ties broken by the word itself: the same vocabulary on every run.
    ranked = sorted(counts, key=lambda w: (-counts[w], w))
    vocab = [UNK, EOS, *[w for w in ranked if w not in (UNK, EOS)][: vocab_size - 2]]
    index = {w: i for i, w in enumerate(vocab)}
    ids = torch.tensor([index.get(w, 0) for w in tokens], dtype=torch.int64)
    n_train, n_valid = int(0.8 * len(ids)), int(0.1 * len(ids))
    return Corpus(
        vocab=vocab,
        train=ids[:n_train],
        valid=ids[n_train : n_train + n_valid],
        test=ids[n_train + n_valid :],
        files=[p.name for p in files],
    )


def batchify(ids: Tensor, batch_size: int, device: torch.device) -> Tensor:
    """(N,) -> (N // batch_size, batch_size): column b is the b-th contiguous stretch."""
    rows = ids.numel() // batch_size
    return ids[: rows * batch_size].view(batch_size, rows).t().contiguous().to(device)


def get_batch(source: Tensor, i: int, bptt: int) -> tuple[Tensor, Tensor]:
    """Inputs (T, B) and next-word targets (T * B,) starting at row ``i``."""
    length = min(bptt, len(source) - 1 - i)
    return source[i : i + length], source[i + 1 : i + 1 + length].reshape(-1)
