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

from dataclasses import dataclass
from typing import ClassVar

from search.workloads.base import require_positive_ints
from search.workloads.hf import HF

__all__ = ["Llama"]


@dataclass(eq=False, kw_only=True)
class Llama(HF):
    """Next-token prediction on random token ids with ``transformers.LlamaForCausalLM``;
    throughput is counted in tokens (every position of every sequence). Its fields are the
    keywords a space's ``workload`` passes, checked before anything is built, as ``GPT``'s; they
    set ``HF``'s sizes (``layers``, ``width``, ``heads``, ``kv_heads``)."""

    requires: ClassVar[dict[str, str]] = {"transformers": "pip install 'search[llama]'"}

    vocab_size: int
    seq_len: int
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    intermediate_size: int

    def __post_init__(self) -> None:
        sizes = ("vocab_size", "seq_len", "hidden_size", "n_layers", "n_heads", "n_kv_heads")
        require_positive_ints(
            **{name: getattr(self, name) for name in (*sizes, "intermediate_size")}
        )
        if self.hidden_size % self.n_heads or self.n_heads % self.n_kv_heads:
            raise ValueError(
                "`hidden_size % n_heads == 0` and `n_heads % n_kv_heads == 0` must hold, but got "
                f"(hidden_size={self.hidden_size}, n_heads={self.n_heads}, "
                f"n_kv_heads={self.n_kv_heads}); pick heads that divide the width, and key-value "
                "heads that divide the heads."
            )
        self.model = "llama"
        self.layers, self.width = self.n_layers, self.hidden_size
        self.heads, self.kv_heads = self.n_heads, self.n_kv_heads
        # TinyLlama's and Llama's: a separate output matrix; positions for the sequence
        own = {"tie_word_embeddings": False, "max_position_embeddings": self.seq_len}
        self.settings = {**own, **self.settings}
        super().__post_init__()
