"""Any transformers model, built from its config alone: random weights, synthetic tokens, and the
library's own loss for its head. Nothing but a ``config.json`` is ever fetched, and only for a hub
name; a model type (``gpt2``, ``llama``, ``bert``, ...) or a local ``config.json`` needs no
network.

The knobs map onto what the library's models already have: ``recompute`` onto the decoder or
encoder layers (the longest stack of like layers) and their ``attention`` and ``mlp`` children
where an architecture names them so; ``attention`` onto the kernel of the SDPA attention
transformers picks by default (``attn_implementation="sdpa"``); ``kernels: liger`` onto
Liger-Kernel's patch for the architecture, on the model alone; a value an architecture cannot
take is refused before the study (``refuses``). transformers is an optional dependency (the
``hf`` extra), imported only here.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, cast

import torch
from torch import nn

from search.core.errors import first_line
from search.workloads.base import Workload
from search.workloads.hf_kernels import liger_refusal, use_globals, use_liger

__all__ = ["HEADS", "HF"]

HEADS = {
    "causal-lm": "AutoModelForCausalLM",
    "masked-lm": "AutoModelForMaskedLM",
    "sequence-classification": "AutoModelForSequenceClassification",
}
"""The heads a model is built with, each trained with the library's own loss (``labels=``)."""

SIZES = {
    "layers": "num_hidden_layers",
    "width": "hidden_size",
    "heads": "num_attention_heads",
    "kv_heads": "num_key_value_heads",
    "intermediate_size": "intermediate_size",
    "vocab_size": "vocab_size",
}
"""The size overrides by their short name: transformers maps each config's own names onto these
(GPT-2's ``n_layer`` is ``num_hidden_layers``)."""

_ATTENTION_PARTS = ("self_attn", "attn", "attention", "self_attention")
_MLP_PARTS = ("mlp", "feed_forward", "ffn")
_MASKED_SHARE = 0.15  # BERT's share of masked positions


@dataclass(eq=False)
class HF(Workload):
    """A transformers model trained on random token ids; throughput in tokens. ``model``: a
    model type (``gpt2``), a local ``config.json`` (or its folder), or a hub name
    (``Qwen/Qwen2.5-0.5B``: its config alone is fetched); the sizes override the config's."""

    unit = "tokens"
    requires: ClassVar[dict[str, str]] = {"transformers": "pip install 'search[hf]'"}
    # What building the first model imports: 5.2 s of a 2-core CPU in every trial's process
    # (2.0 s transformers and its auto classes, then 3.2 s of modules the first model's build
    # imports: activations, modeling_layers, masking_utils; a second model type then builds in
    # 0.03 s), read with python -X importtime.
    preload: ClassVar[tuple[str, ...]] = (
        "transformers",
        "transformers.models.auto.configuration_auto",
        "transformers.models.auto.modeling_auto",
        "transformers.activations",
        "transformers.modeling_layers",
        "transformers.masking_utils",
    )

    model: str | None = None
    head: str = "causal-lm"
    seq_len: int = 128
    layers: int | None = None
    width: int | None = None
    heads: int | None = None
    kv_heads: int | None = None
    intermediate_size: int | None = None
    vocab_size: int | None = None
    num_labels: int = 2
    settings: dict[str, Any] = field(default_factory=dict)
    """Any other attribute of the config, by its own name (``{"rope_theta": 1e6}``)."""
    part: str | None = None
    """Of a composite config (a vision-language model's, say), the sub-config to build and train
    (``text_config``): the sizes and settings apply to it. None: the config itself."""

    def __post_init__(self) -> None:
        if self.head not in HEADS:
            raise ValueError(f"head must be one of {', '.join(HEADS)}, but got {self.head!r}")
        if not self.model:
            raise ValueError(
                "no model named: pass model= a model type (gpt2, llama, bert, ...), a local "
                "config.json, or a hub name (python -m search +space=hf model=gpt2)"
            )
        self.config = _sized(_part(_config(self.model), self), self)
        _refuse_a_missing_head(self.config, self.head)
        self._mask_id = self.config.to_dict().get("mask_token_id")
        self._flops: float | None = None
        self._meta: nn.Module | None = None

    @property
    def model_type(self) -> str:
        return str(self.config.model_type)

    def build_model(self) -> nn.Module:
        import transformers

        # fp32 weights whatever the config says (Qwen2.5's says bfloat16): precision is a knob
        return getattr(transformers, HEADS[self.head]).from_config(self.config, dtype=torch.float32)

    def make_batch(self, size: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        vocab = int(self.config.vocab_size)
        ids = torch.randint(vocab, (size, self.seq_len), generator=generator)
        if self.head == "causal-lm":  # transformers shifts the labels itself
            return {"input_ids": ids, "labels": ids}
        if self.head == "sequence-classification":
            labels = torch.randint(self.num_labels, (size,), generator=generator)
            return {"input_ids": ids, "labels": labels}
        masked = torch.rand(ids.shape, generator=generator) < _MASKED_SHARE
        masked[:, 0] = True  # every sequence predicts at least one token
        inputs = ids if self._mask_id is None else ids.masked_fill(masked, self._mask_id)
        return {"input_ids": inputs, "labels": ids.masked_fill(~masked, -100)}

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        use_globals(model)  # Liger's rotary function for a patched model, transformers' else
        return model(**batch).loss

    def use_kernels(self, model: nn.Module, kernels: str) -> None:
        """``liger``: Liger-Kernel's kernels for this architecture (its RMSNorm, SwiGLU or GeGLU,
        rotary embedding and the fused linear cross-entropy, as it has them), on this model
        alone (``search.workloads.hf_kernels``)."""
        if kernels != "liger":
            raise NotImplementedError(f"{self.model_type} names no kernels called {kernels!r}")
        use_liger(model, self.model_type)

    def items_per_sample(self) -> int:
        return self.seq_len

    def flops_per_item(self) -> float:
        """6 per weight of every matrix product (counted on the model built on the meta device:
        its linear layers, GPT-2's ``Conv1D``, the output head even where it is tied), plus the
        attention's score and value products, 12 * layers * width * seq_len (PaLM's convention,
        as ``GPT``)."""
        if self._flops is None:
            products = (
                m
                for m in self._on_meta().modules()
                if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"
            )
            weights = sum(int(cast(torch.Tensor, m.weight).numel()) for m in products)
            layers, width = int(self.config.num_hidden_layers), int(self.config.hidden_size)
            self._flops = 6.0 * weights + 12.0 * layers * width * self.seq_len
        return self._flops

    def _on_meta(self) -> nn.Module:
        """The model on the meta device: its structure and settings, no memory, no weights
        (built once)."""
        if self._meta is None:
            with torch.device("meta"):
                self._meta = self.build_model()
        return self._meta

    def recompute_modules(self, model: nn.Module) -> list[nn.Module]:
        """The layers: the longest stack of the classes the library names as its layers
        (``_no_split_modules``), else the longest stack of like modules (``model.layers``, GPT-2's
        ``transformer.h``, BERT's ``encoder.layer``)."""
        stacks = [
            list(m)
            for m in model.modules()
            if isinstance(m, nn.ModuleList) and len({type(x) for x in m}) == 1
        ]
        # the library names its layers' classes (a mixture of experts' experts are a longer stack)
        named = set(getattr(model, "_no_split_modules", None) or ())
        layers = [stack for stack in stacks if type(stack[0]).__name__ in named]
        return max(layers or stacks, key=len, default=[])

    def recompute_parts(self, model: nn.Module) -> dict[str, list[nn.Module]]:
        """``attention`` and ``mlp`` of every layer, where every layer has a child so named."""
        layers = self.recompute_modules(model)
        parts: dict[str, list[nn.Module]] = {}
        for part, names in (("attention", _ATTENTION_PARTS), ("mlp", _MLP_PARTS)):
            found = [_child(layer, names) for layer in layers]
            if layers and all(x is not None for x in found):
                parts[part] = [x for x in found if x is not None]
        return parts

    def refuses(self, knob: str, value: Any) -> str | None:
        """Why this architecture cannot take ``knob=value``; None where it can."""
        model = self._on_meta()
        if knob == "recompute" and value in ("attention", "mlp"):
            if value not in self.recompute_parts(model):
                return (
                    f"{self.model_type}'s layers have no {value} part named "
                    f"{' or '.join(_ATTENTION_PARTS if value == 'attention' else _MLP_PARTS)}; "
                    "recompute all, every-K or selective instead"
                )
        if knob == "kernels" and value == "liger":
            return liger_refusal(self.model_type)
        # as the library chose it for this model (sdpa where the architecture supports it)
        attention = getattr(model.config, "_attn_implementation", None) or "eager"
        if knob == "attention" and value != "default" and attention != "sdpa":
            return (
                f"{self.model_type} runs its attention as {attention!r} here, not through "
                "scaled_dot_product_attention, so no kernel can be chosen for it"
            )
        return None


def _child(layer: nn.Module, names: tuple[str, ...]) -> nn.Module | None:
    children = (getattr(layer, name, None) for name in names)
    return next((c for c in children if isinstance(c, nn.Module)), None)


def _config(model: str) -> Any:
    """The config ``model`` names: a model type, a local file or folder, or a hub name."""
    from transformers import CONFIG_MAPPING, AutoConfig

    path = Path(model).expanduser()
    if path.is_file() or path.is_dir():
        try:
            return AutoConfig.from_pretrained(str(path))
        except (OSError, ValueError, KeyError, json.JSONDecodeError) as e:
            first = first_line(e)
            raise ValueError(f"model {model!r}: not a transformers config ({first})") from None
    if model in CONFIG_MAPPING:
        return AutoConfig.for_model(model)
    if "/" not in model:
        close = difflib.get_close_matches(model, list(CONFIG_MAPPING.keys()), n=3)
        hint = f" (close: {', '.join(close)})" if close else ""
        raise ValueError(
            f"model {model!r} is neither a transformers model type{hint}, a local config.json, "
            "nor a hub name (owner/name)"
        )
    try:  # the hub's cache first: once fetched, no trial's process asks the network again
        return AutoConfig.from_pretrained(model, local_files_only=True)
    except (OSError, ValueError):
        pass
    try:
        return AutoConfig.from_pretrained(model)
    except (OSError, ValueError) as e:
        first = first_line(e)
        raise ValueError(
            f"model {model!r}: its config.json could not be fetched from the hub ({first}); "
            "with no network, pass a local config.json or its model type"
        ) from None


def _refuse_a_missing_head(config: Any, head: str) -> None:
    """One line before the study where transformers builds no ``head`` model for the config's
    model type (T5 has no causal-lm one), naming the heads it does build."""
    from transformers.models.auto import modeling_auto

    mappings = {
        "causal-lm": modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        "masked-lm": modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES,
        "sequence-classification": modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
    }
    if config.model_type in mappings[head]:
        return
    others = [name for name, mapping in mappings.items() if config.model_type in mapping]
    hint = f"space.workload.head={' or '.join(others)}" if others else "name another model"
    raise ValueError(
        f"transformers builds no {head} model of {config.model_type} ({HEADS[head]}): {hint}"
    )


_SIZED_BY = ("num_hidden_layers", "hidden_size")
"""What the workload reads of every config it builds: the size overrides and the FLOP count."""


def _part(config: Any, workload: HF) -> Any:
    """The config to build: ``config``, or its sub-config ``workload.part``. A composite config
    (a vision-language model's) has no layers or width of its own: set on it, the sizes would be
    ignored and the whole model built at its full size, so it is refused until a part is named."""
    parts = [n for n in getattr(config, "sub_configs", {}) if getattr(config, n, None) is not None]
    named = f"model {workload.model!r}"
    if workload.part is not None:
        if workload.part not in parts:
            has = f"its parts: {', '.join(parts)}" if parts else "it is not composite: drop part"
            raise ValueError(f"{named} has no part {workload.part!r} ({has})")
        return getattr(config, workload.part)
    missing = [name for name in _SIZED_BY if not hasattr(config, name)]
    if missing and parts:
        text = next((p for p in parts if "text" in p), parts[0])
        raise ValueError(
            f"{named} is a composite config ({', '.join(parts)}) with no {missing[0]} of its "
            f"own, and this workload trains one model on token ids: name the part to build, "
            f"space.workload.part={text} (the sizes and settings then apply to it)"
        )
    if missing:
        raise ValueError(f"{named}'s config has no {' or '.join(missing)} to size and count by")
    return config


def _sized(config: Any, workload: HF) -> Any:
    """``config`` with the workload's sizes and settings, built again so that what the config
    derives from them follows (Qwen2's ``layer_types``, one per layer); trained without a cache;
    positions for at least ``seq_len`` tokens and special tokens inside the vocabulary (its
    weights are random anyway)."""
    # What the workload would set, by the config's name and the override's: one the config lacks
    # would be set anyway and never read by the model, so it is refused.
    asked = {SIZES[s]: s for s in SIZES if getattr(workload, s) is not None}
    asked.update({name: name for name in workload.settings})
    unknown = {name: given for name, given in asked.items() if not hasattr(config, name)}
    if unknown:
        raise ValueError(
            f"{config.model_type}'s config has no {', '.join(unknown)}: "
            f"drop {', '.join(unknown.values())}"
        )
    before = {name: getattr(config, name, None) for name in SIZES.values()}
    for short, name in SIZES.items():
        if getattr(workload, short) is not None:
            setattr(config, name, int(getattr(workload, short)))
    for name, value in workload.settings.items():
        setattr(config, name, value)
    _follow_the_width(config, workload, before)
    if (getattr(config, "max_position_embeddings", None) or workload.seq_len) < workload.seq_len:
        config.max_position_embeddings = workload.seq_len
    config.use_cache = False
    derived = {k: v for k, v in config.to_dict().items() if k != "layer_types"}
    vocab = derived.get("vocab_size")
    for name in _TOKEN_IDS:  # a shrunk vocabulary: an id beyond it would index nothing
        # cleared before the config is built again, whose checks would warn of it on stderr
        if isinstance(derived.get(name), int) and isinstance(vocab, int) and derived[name] >= vocab:
            derived[name] = None
    config = type(config).from_dict(derived)
    if workload.head == "sequence-classification":
        config.num_labels = workload.num_labels
        if getattr(config, "pad_token_id", None) is None:  # each row's last token is found by it
            config.pad_token_id = 0
    return config


_TOKEN_IDS = ("pad_token_id", "mask_token_id", "bos_token_id", "eos_token_id", "sep_token_id")


def _follow_the_width(config: Any, workload: HF, before: dict[str, Any]) -> None:
    """Where the sizes changed and these were not given: the feed-forward keeps its ratio to the
    width (Llama's 11,008 is not for width 128), one key-value head per head, the head's width
    the width over the heads."""
    width, heads = int(config.hidden_size), int(config.num_attention_heads)
    if workload.width is not None and workload.intermediate_size is None:
        if before.get("intermediate_size") and before.get("hidden_size"):
            ratio = int(before["intermediate_size"]) / int(before["hidden_size"])
            config.intermediate_size = max(1, round(ratio * width))
    if (
        workload.heads is not None
        and workload.kv_heads is None
        and before.get("num_key_value_heads")
    ):
        config.num_key_value_heads = heads
    if getattr(config, "head_dim", None) and (workload.width or workload.heads):
        config.head_dim = width // heads
