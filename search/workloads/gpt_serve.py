"""Serving the built-in GPT: prompts in, greedily decoded tokens out, with or without a KV cache."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from search.workloads.base import ServingWorkload
from search.workloads.gpt import _Block, _Decoder, _DecoderConfig, check_gpt_shape

__all__ = ["GPTServe", "KVCache"]

KVCache = list[tuple[torch.Tensor, torch.Tensor]]
"""Each block's keys and values so far, ``(batch, heads, positions, head_dim)`` each."""


@dataclass(eq=False)
class GPTServe(ServingWorkload):
    """Autoregressive inference of the built-in GPT (``search.workloads.GPT``) on random prompts.

    ``kv_cache=True`` keeps every block's keys and values, so each new token runs the model on one
    position; ``False`` keeps only the tokens and runs the whole prefix again for every new token
    (more compute, no cache memory). Both compute the same logits. Its fields are the keyword
    arguments a space's ``workload`` passes, checked in ``__post_init__``, as ``GPT``'s.
    """

    vocab_size: int
    prompt_len: int
    gen_len: int
    d_model: int
    n_layers: int
    n_heads: int
    d_ff: int | None = None
    kv_cache: bool = True

    def __post_init__(self) -> None:
        if self.d_ff is None:
            self.d_ff = 4 * self.d_model
        sizes = {k: v for k, v in self.config.items() if k != "kv_cache"}
        check_gpt_shape(**sizes)
        if not isinstance(self.kv_cache, bool):
            raise ValueError(
                f"`kv_cache` must be true or false, but got kv_cache={self.kv_cache!r}."
            )

    @property
    def config(self) -> dict[str, Any]:
        """The settings by name, ``d_ff`` resolved."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(GPTServe)}

    def build_model(self) -> nn.Module:
        c = self.config
        return _Decoder(
            _DecoderConfig(
                vocab_size=c["vocab_size"],
                seq_len=c["prompt_len"] + c["gen_len"],
                d_model=c["d_model"],
                n_layers=c["n_layers"],
                n_heads=c["n_heads"],
                d_ff=c["d_ff"],
                dropout=0.0,
            )
        )

    def make_prompts(self, size: int, generator: torch.Generator) -> torch.Tensor:
        return torch.randint(self.vocab_size, (size, self.prompt_len), generator=generator)

    def generation_length(self) -> int:
        return self.gen_len

    def forward(
        self, model: nn.Module, tokens: torch.Tensor, state: Any
    ) -> tuple[torch.Tensor, Any]:
        decoder = cast(_Decoder, model)
        if not self.kv_cache:
            prefix = tokens if state is None else torch.cat([state, tokens], dim=1)
            logits, _ = _run(decoder, prefix, None)
            return logits, prefix
        return _run(decoder, tokens, state)

    def reference(self) -> GPTServe:
        """The same model without a cache: every token from the whole prefix."""
        return GPTServe(**{**self.config, "kv_cache": False})


def _run(
    model: _Decoder, tokens: torch.Tensor, cache: KVCache | None
) -> tuple[torch.Tensor, KVCache]:
    """``tokens`` after the positions ``cache`` holds (none: from position 0); the last position's
    logits and the cache extended by ``tokens``."""
    start = 0 if cache is None else cache[0][0].shape[2]
    positions = torch.arange(start, start + tokens.shape[1], device=tokens.device)
    x = model.tok_emb(tokens) + model.pos_emb(positions)
    extended: KVCache = []
    for i, block in enumerate(cast(nn.ModuleList, model.blocks)):
        x, kv = _block(cast(_Block, block), x, None if cache is None else cache[i])
        extended.append(kv)
    return F.linear(model.ln_f(x[:, -1]), model.tok_emb.weight), extended


def _block(
    block: _Block, x: torch.Tensor, past: tuple[torch.Tensor, torch.Tensor] | None
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """``_Block.forward`` for new positions after ``past`` keys and values."""
    h = block.ln_attn(x)
    batch, seq, d_model = h.shape
    qkv = block.attn.qkv(h).view(batch, seq, 3, block.n_heads, d_model // block.n_heads)
    q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each (batch, heads, seq, head_dim)
    if past is not None:
        if seq > 1:
            raise ValueError(f"after the prompt, tokens come one at a time, but got {seq}")
        k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
    # Causal among the prompt's positions; one new position attends to everything before it.
    y = F.scaled_dot_product_attention(q, k, v, is_causal=past is None and seq > 1)
    x = x + block.attn.proj(y.transpose(1, 2).reshape(batch, seq, d_model))
    return x + block.mlp(block.ln_mlp(x)), (k, v)
