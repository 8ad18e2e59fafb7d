"""A Llama decoder from transformers (``LlamaForCausalLM``), built from its config alone: random
weights, synthetic tokens, nothing downloaded.

A case of ``HF`` (any transformers model by name), with the sizes of the ``llama`` space by their
Llama names and the output matrix apart from the embeddings (TinyLlama's and Llama's): its own
attention (SDPA), rotary embeddings, RMSNorm, SwiGLU MLP, grouped-query attention and loss path
(``labels=``: the logits upcast to fp32, as in training with transformers), and Liger's kernels
on this model alone (``search.workloads.hf_kernels``). transformers is an optional dependency (the
``llama`` extra), imported only when a model is built.
"""

from __future__ import annotations

from typing import ClassVar

from search.workloads.base import require_positive_ints
from search.workloads.hf import HF

__all__ = ["Llama"]


class Llama(HF):
    """Next-token prediction on random token ids with ``transformers.LlamaForCausalLM``;
    throughput is counted in tokens (every position of every sequence). Its arguments are the
    keywords a space's ``workload`` passes, checked before anything is built, as ``GPT``'s."""

    requires: ClassVar[dict[str, str]] = {"transformers": "pip install 'search[llama]'"}

    def __init__(
        self,
        vocab_size: int,
        seq_len: int,
        hidden_size: int,
        n_layers: int,
        n_heads: int,
        n_kv_heads: int,
        intermediate_size: int,
    ) -> None:
        require_positive_ints(
            vocab_size=vocab_size,
            seq_len=seq_len,
            hidden_size=hidden_size,
            n_layers=n_layers,
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            intermediate_size=intermediate_size,
        )
        if hidden_size % n_heads or n_heads % n_kv_heads:
            raise ValueError(
                "`hidden_size % n_heads == 0` and `n_heads % n_kv_heads == 0` must hold, but got "
                f"(hidden_size={hidden_size}, n_heads={n_heads}, n_kv_heads={n_kv_heads}); pick "
                "heads that divide the width, and key-value heads that divide the heads."
            )
        super().__init__(
            model="llama",
            seq_len=seq_len,
            layers=n_layers,
            width=hidden_size,
            heads=n_heads,
            kv_heads=n_kv_heads,
            intermediate_size=intermediate_size,
            vocab_size=vocab_size,
            settings={"tie_word_embeddings": False, "max_position_embeddings": seq_len},
        )
