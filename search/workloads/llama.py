"""A Llama decoder from transformers (``LlamaForCausalLM``), built from its config alone: random
weights, synthetic tokens, nothing downloaded.

This is the model users bring, with its own attention (SDPA), rotary embeddings, RMSNorm, SwiGLU
MLP, grouped-query attention and its own loss path (``labels=``: the logits upcast to fp32, as in
training with transformers). transformers is an optional dependency (the ``llama`` extra): the
module imports it only when a model is built, so the rest of the package never needs it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, cast

import torch
from torch import nn

from search.workloads.base import Workload, require_positive_ints

__all__ = ["Llama"]


@dataclass(eq=False)
class Llama(Workload):
    """Next-token prediction on random token ids with ``transformers.LlamaForCausalLM``;
    throughput is counted in tokens (every position of every sequence). Its fields are the
    keyword arguments a space's ``workload`` passes, checked in ``__post_init__``, as ``GPT``'s."""

    unit = "tokens"
    requires: ClassVar[dict[str, str]] = {"transformers": "pip install 'search[llama]'"}

    vocab_size: int
    seq_len: int
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    intermediate_size: int

    def __post_init__(self) -> None:
        require_positive_ints(**self.config)
        if self.hidden_size % self.n_heads or self.n_heads % self.n_kv_heads:
            raise ValueError(
                "`hidden_size % n_heads == 0` and `n_heads % n_kv_heads == 0` must hold, but got "
                f"(hidden_size={self.hidden_size}, n_heads={self.n_heads}, "
                f"n_kv_heads={self.n_kv_heads}); pick heads that divide the width, and key-value "
                "heads that divide the heads."
            )

    @property
    def config(self) -> dict[str, Any]:
        """The settings by name."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(Llama)}

    def build_model(self) -> nn.Module:
        from transformers import LlamaConfig, LlamaForCausalLM

        c = self.config
        config = LlamaConfig(
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"],
            num_hidden_layers=c["n_layers"],
            num_attention_heads=c["n_heads"],
            num_key_value_heads=c["n_kv_heads"],
            max_position_embeddings=c["seq_len"],
            tie_word_embeddings=False,  # TinyLlama's and Llama's: a separate output matrix
            use_cache=False,  # training: no key-value cache
        )  # attention: SDPA, transformers' default
        return LlamaForCausalLM(config)

    def make_batch(self, size: int, generator: torch.Generator) -> torch.Tensor:
        shape = (size, self.seq_len)
        return torch.randint(self.vocab_size, shape, generator=generator)

    def loss(self, model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        _use_rope(model)
        # transformers shifts the labels itself: position t predicts token t + 1.
        return model(input_ids=batch, labels=batch).loss

    def use_kernels(self, model: nn.Module, kernels: str) -> None:
        """``liger``: Liger-Kernel's RMSNorm, SwiGLU MLP, rotary embedding and fused linear
        cross-entropy (the loss without materialising the logits), on this model alone.

        Liger patches some of them into transformers' module for every model built after it (the
        classes and the rotary function); those are put back at once, so the fidelity check's
        reference, built in the same process, stays plain. This model's layers are patched in
        place; its rotary function is set at each of its forward passes (``_use_rope``)."""
        if kernels != "liger":
            raise NotImplementedError(f"Llama names no kernels called {kernels!r}")
        from liger_kernel.transformers import apply_liger_kernel_to_llama
        from transformers.models.llama import modeling_llama

        # What liger 0.8.5 sets in the module given a model (its cross-entropy patch is off, and
        # the fused loss goes on this model's forward alone). The rotary function as transformers
        # made it: the module may hold another Liger model's, left there by its last forward.
        _PLAIN_ROPE.setdefault("rope", modeling_llama.apply_rotary_pos_emb)
        plain = {
            "apply_rotary_pos_emb": _PLAIN_ROPE["rope"],
            "LlamaRMSNorm": modeling_llama.LlamaRMSNorm,
            "LlamaMLP": modeling_llama.LlamaMLP,
        }
        try:
            apply_liger_kernel_to_llama(model=cast(Any, model))  # typed PreTrainedModel
            liger_rope = modeling_llama.apply_rotary_pos_emb
        finally:
            for name, value in plain.items():
                setattr(modeling_llama, name, value)
        model.liger_rope = liger_rope

    def items_per_sample(self) -> int:
        return self.seq_len

    def flops_per_item(self) -> float:
        """6 per weight of every matrix product (the projections with grouped key-value heads,
        the SwiGLU MLP's three, the output head) plus causal attention's score and value products
        counted in full, 12 * layers * hidden * seq_len (PaLM's convention, as ``GPT``)."""
        c = self.config
        d, layers = c["hidden_size"], c["n_layers"]
        kv = d // c["n_heads"] * c["n_kv_heads"]
        per_layer = 2 * d * d + 2 * d * kv + 3 * d * c["intermediate_size"]
        matmul_weights = layers * per_layer + c["vocab_size"] * d
        return 6.0 * matmul_weights + 12.0 * layers * d * c["seq_len"]

    def recompute_modules(self, model: nn.Module) -> list[nn.Module]:
        return list(cast(nn.ModuleList, cast(Any, model).model.layers))

    def recompute_parts(self, model: nn.Module) -> dict[str, list[nn.Module]]:
        """``attention`` (projections, rotary embedding, scores) and ``mlp`` (SwiGLU: the two
        wide projections and their product) of every decoder layer; the RMSNorms stay kept."""
        layers = cast(list[Any], self.recompute_modules(model))
        return {
            "attention": [layer.self_attn for layer in layers],
            "mlp": [layer.mlp for layer in layers],
        }


_PLAIN_ROPE: dict[str, Any] = {}
"""transformers' own rotary function, kept once a model had Liger's patched in."""


def _use_rope(model: nn.Module) -> None:
    """Set transformers' rotary function to ``model``'s: Liger's where it was patched in, else the
    plain one (the module global every Llama attention layer looks up when it runs)."""
    if not _PLAIN_ROPE:
        return  # no Liger model in this process: the module is as transformers made it
    from transformers.models.llama import modeling_llama

    modeling_llama.apply_rotary_pos_emb = getattr(model, "liger_rope", _PLAIN_ROPE["rope"])
