"""A GPT-style decoder-only language model, built from its config alone (no downloads)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from search.workloads.base import Workload, require_positive_ints

__all__ = ["GPT", "check_gpt_shape"]

_INIT_STD = 0.02
"""GPT-2's weight init: keeps the logits small, so the initial loss is close to ln(vocab_size)."""


class _Attention(nn.Module):
    """Causal multi-head self-attention: one projection to queries, keys and values, one out."""

    def __init__(self, d_model: int, n_heads: int, dropout: float):
        super().__init__()
        self.n_heads, self.dropout = n_heads, dropout
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, d_model = x.shape
        qkv = self.qkv(x).view(batch, seq, 3, self.n_heads, d_model // self.n_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each (batch, heads, seq, head_dim)
        dropout_p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, d_model))


class _Block(nn.Module):
    """One pre-LayerNorm transformer block: causal self-attention, then a GELU MLP."""

    def __init__(self, d_model: int, n_heads: int, d_ff: int, dropout: float):
        super().__init__()
        self.n_heads = n_heads
        self.ln_attn = nn.LayerNorm(d_model)
        self.attn = _Attention(d_model, n_heads, dropout)
        self.ln_mlp = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, d_ff), nn.GELU(), nn.Linear(d_ff, d_model))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln_attn(x)))
        return x + self.drop(self.mlp(self.ln_mlp(x)))


@dataclass(frozen=True)
class _DecoderConfig:
    """What ``_Decoder`` is built from, beside it as torchtitan keeps a model's arguments: the
    training workload passes its own settings, the serving one a sequence as long as a prompt and
    its generated tokens."""

    vocab_size: int
    seq_len: int
    d_model: int
    n_layers: int
    n_heads: int
    d_ff: int
    dropout: float = 0.0


class _Decoder(nn.Module):
    """Token + learned position embeddings, blocks, final LayerNorm, output tied to the input
    embedding."""

    def __init__(self, config: _DecoderConfig):
        super().__init__()
        c = config
        self.tok_emb = nn.Embedding(c.vocab_size, c.d_model)
        self.pos_emb = nn.Embedding(c.seq_len, c.d_model)
        self.drop = nn.Dropout(c.dropout)
        self.blocks = nn.ModuleList(
            _Block(c.d_model, c.n_heads, c.d_ff, c.dropout) for _ in range(c.n_layers)
        )
        self.ln_f = nn.LayerNorm(c.d_model)
        self.apply(_init_weights)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.drop(self.tok_emb(tokens) + self.pos_emb(positions))
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln_f(x), self.tok_emb.weight)  # tied: no separate output matrix


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=_INIT_STD)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


@dataclass(eq=False)
class GPT(Workload):
    """Next-token prediction on random token ids; throughput is counted in tokens.

    Its fields are the keyword arguments a space's ``workload`` passes (and
    ``space.workload.d_model=...`` overrides), checked in ``__post_init__``; ``d_ff`` defaults to
    4 * ``d_model``. Compared by identity, as a hand-written class is."""

    unit = "tokens"

    vocab_size: int
    seq_len: int
    d_model: int
    n_layers: int
    n_heads: int
    d_ff: int | None = None
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if self.d_ff is None:
            self.d_ff = 4 * self.d_model
        check_gpt_shape(
            vocab_size=self.vocab_size,
            seq_len=self.seq_len,
            d_model=self.d_model,
            n_layers=self.n_layers,
            n_heads=self.n_heads,
            d_ff=self.d_ff,
        )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"`0 <= dropout < 1` must hold, but got dropout={self.dropout}.")

    @property
    def config(self) -> dict[str, Any]:
        """The settings by name, ``d_ff`` resolved: what the model is built from."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(GPT)}

    def build_model(self) -> nn.Module:
        return _Decoder(_DecoderConfig(**self.config))

    def make_batch(self, size: int, generator: torch.Generator) -> torch.Tensor:
        # One extra token per row: inputs are [:, :-1], targets the same row shifted by one.
        shape = (size, self.seq_len + 1)
        return torch.randint(self.vocab_size, shape, generator=generator)

    def loss(self, model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        logits = model(batch[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())

    def items_per_sample(self) -> int:
        return self.seq_len

    def flops_per_item(self) -> float:
        """6 per weight of every matrix product (forward 2, backward 4) plus causal attention's
        score and value products counted in full, 12 * layers * d_model * seq_len (PaLM's
        convention, appendix B): per token of a training step."""
        c = self.config
        d, layers = c["d_model"], c["n_layers"]
        # tied output head
        matmul_weights = layers * (4 * d * d + 2 * d * c["d_ff"]) + c["vocab_size"] * d
        return 6.0 * matmul_weights + 12.0 * layers * d * c["seq_len"]

    def recompute_modules(self, model: nn.Module) -> list[nn.Module]:
        return list(cast(nn.ModuleList, model.blocks))

    def recompute_parts(self, model: nn.Module) -> dict[str, list[nn.Module]]:
        """``attention`` (its projections and scores) and ``mlp`` (its 4x wide hidden layer) of
        every block; the LayerNorms before them stay kept."""
        blocks = cast(list[_Block], self.recompute_modules(model))
        return {"attention": [b.attn for b in blocks], "mlp": [b.mlp for b in blocks]}


def check_gpt_shape(**sizes: int) -> None:
    """Every size is an int >= 1 and ``n_heads`` divides ``d_model``; else ValueError saying
    which."""
    require_positive_ints(**sizes)
    if sizes["d_model"] % sizes["n_heads"]:
        raise ValueError(
            f"`d_model % n_heads == 0` must hold, but got (d_model={sizes['d_model']}, "
            f"n_heads={sizes['n_heads']}); pick n_heads that divides d_model."
        )
