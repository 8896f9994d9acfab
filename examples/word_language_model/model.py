"""The two language models: a multi-layer LSTM and a small causal Transformer."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

Hidden = tuple[Tensor, Tensor] | None


class LSTMModel(nn.Module):
    """Embedding -> LSTM -> linear decoder, with the decoder weight tied to the embedding."""

    def __init__(self, ntoken: int, ninp: int, nhid: int, nlayers: int, dropout: float) -> None:
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.LSTM(ninp, nhid, nlayers, dropout=dropout if nlayers > 1 else 0.0)
        self.project = nn.Linear(nhid, ninp) if nhid != ninp else nn.Identity()
        self.decoder = nn.Linear(ninp, ntoken)
        self.decoder.weight = self.encoder.weight  # weight tying (Press & Wolf 2017)
        nn.init.uniform_(self.encoder.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)

    def forward(self, tokens: Tensor, hidden: Hidden) -> tuple[Tensor, Hidden]:
        emb = self.drop(self.encoder(tokens))  # (T, B, E)
        out, hidden = self.rnn(emb, hidden)  # (T, B, H)
        logits = self.decoder(self.drop(self.project(out)))  # (T, B, V)
        return logits, hidden


class TransformerModel(nn.Module):
    """Embedding + sinusoidal positions -> causal TransformerEncoder -> tied decoder."""

    def __init__(
        self, ntoken: int, ninp: int, nhead: int, nhid: int, nlayers: int, dropout: float
    ) -> None:
        super().__init__()
        self.ninp = ninp
        self.encoder = nn.Embedding(ntoken, ninp)
        layer = nn.TransformerEncoderLayer(ninp, nhead, nhid, dropout, norm_first=True)
        self.transformer = nn.TransformerEncoder(layer, nlayers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(ninp)
        self.drop = nn.Dropout(dropout)
        self.decoder = nn.Linear(ninp, ntoken)
        self.decoder.weight = self.encoder.weight
        nn.init.uniform_(self.encoder.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)
        position = torch.arange(4096).unsqueeze(1)
        div = torch.exp(torch.arange(0, ninp, 2) * (-math.log(10000.0) / ninp))
        pe = torch.zeros(4096, 1, ninp)
        pe[:, 0, 0::2] = torch.sin(position * div)
        pe[:, 0, 1::2] = torch.cos(position * div)
        self.register_buffer("pe", pe, persistent=False)

    def forward(self, tokens: Tensor, hidden: Hidden) -> tuple[Tensor, Hidden]:
        length = tokens.shape[0]
        mask = torch.triu(
            torch.full((length, length), float("-inf"), device=tokens.device), diagonal=1
        )  # (T, T): position t sees 0..t
        x = self.encoder(tokens) * math.sqrt(self.ninp) + self.pe[:length].to(
            self.encoder.weight.dtype
        )  # (T, B, E)
        x = self.transformer(self.drop(x), mask=mask.to(x.dtype), is_causal=True)
        return self.decoder(self.drop(self.norm(x))), None  # (T, B, V); no recurrent state


def build_model(
    kind: str, ntoken: int, emsize: int, nhid: int, nlayers: int, nhead: int, dropout: float
) -> nn.Module:
    if kind == "LSTM":
        return LSTMModel(ntoken, emsize, nhid, nlayers, dropout)
    if kind == "Transformer":
        return TransformerModel(ntoken, emsize, nhead, nhid, nlayers, dropout)
    raise ValueError(f"--model must be LSTM or Transformer, got {kind!r}")


def detach(hidden: Hidden) -> Hidden:
    """Cut the graph between BPTT segments (truncated backpropagation through time)."""
    if hidden is None:
        return None
    return (hidden[0].detach(), hidden[1].detach())
