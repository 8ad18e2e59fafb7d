"""fp8 as a precision: torchao's float8 training of the linear layers where it can gain.

``fp8-tensorwise`` and ``fp8-rowwise`` swap the model's ``nn.Linear`` layers for torchao's
``Float8Linear`` with that scaling recipe (one scale per tensor, or per row: finer, slower), and
run the rest of the step under bf16 autocast, as torchao's recipes are used. Matrix products in
fp8 need tensor cores that have it (CUDA compute capability 8.9 or newer: Ada, Hopper and later).
torchao's own size rules (``_auto_filter_for_recipe``) pick the layers: both dimensions divisible
by 16, and large enough that fp8's casts pay (on an H100, rowwise skips every layer of a model
768 wide). A model none of whose layers passes is refused with one line: its fp8 step would be
bf16's under another name. The output head stays in bf16 (torchtitan leaves it out too: its
logits feed the loss, where fp8's error is least welcome).
"""

from __future__ import annotations

import importlib.util

import torch
from torch import nn

from search.core.errors import KnobError

__all__ = ["FP8_PRECISIONS", "FP8_SKIPPED", "convert_fp8", "fp8_layers", "fp8_unsupported"]

FP8_PRECISIONS: dict[str, str] = {"fp8-tensorwise": "tensorwise", "fp8-rowwise": "rowwise"}
"""Each fp8 precision's torchao recipe name."""

FP8_CAPABILITY = (8, 9)
"""The first CUDA compute capability with fp8 tensor cores (Ada; Hopper is 9.0)."""

FP8_SKIPPED = ("lm_head", "head", "output")
"""Names of output layers left in bf16 (torchao's ``filter_fqns``: a layer whose name contains one
of them is skipped)."""

_SIZE_RULES = {
    "tensorwise": "more than 1024 outputs or more than 4096 inputs",
    "rowwise": "more than 2048 outputs and 1024 inputs, and more than 4096 outputs or 2048 inputs",
}
"""torchao 0.17's thresholds (``_auto_filter_for_tensorwise``, ``_auto_filter_for_rowwise``), in
words for the refusal: below them its H100 benchmarks found fp8 slower than bf16."""


def fp8_unsupported(value: object, device: torch.device) -> str | None:
    """Why ``device`` cannot run precision ``value`` when it is an fp8 one (None: it can, or it is
    not fp8)."""
    if value not in FP8_PRECISIONS:
        return None
    if device.type != "cuda":
        return f"{value} needs a CUDA GPU with fp8 tensor cores (compute capability 8.9 or newer)"
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_CAPABILITY:
        return (
            f"{value} needs fp8 tensor cores (compute capability 8.9 or newer), but this GPU "
            f"has {capability[0]}.{capability[1]}"
        )
    if importlib.util.find_spec("torchao") is None:
        return (
            f"{value} needs torchao, which is not installed; install it with: "
            "pip install 'search[gpu]'"
        )
    return None


def fp8_layers(model: nn.Module, precision: str) -> list[str]:
    """The names of ``model``'s linear layers that torchao's size rules for ``precision``'s recipe
    would convert (works on a model on the meta device: only shapes are read)."""
    # torchao's own filter, so the layers counted are the ones its recipe is tuned for.
    from torchao.float8 import _auto_filter_for_recipe

    keep = _auto_filter_for_recipe(FP8_PRECISIONS[precision], filter_fqns=list(FP8_SKIPPED))
    return [name for name, module in model.named_modules() if keep(module, name)]


def convert_fp8(model: nn.Module, precision: str) -> int:
    """Swap ``model``'s linear layers that gain for torchao's ``Float8Linear`` with
    ``precision``'s recipe, in place; returns how many were swapped. Nothing for a precision that
    is not fp8. ``KnobError`` where no layer would be."""
    if precision not in FP8_PRECISIONS:
        return 0
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    recipe = FP8_PRECISIONS[precision]
    chosen = set(fp8_layers(model, precision))
    if not chosen:
        shapes = sorted(
            {(m.out_features, m.in_features) for m in model.modules() if isinstance(m, nn.Linear)}
        )
        raise KnobError(
            f"precision={precision}: none of this model's linear layers (outputs x inputs "
            f"{', '.join(f'{o}x{i}' for o, i in shapes)}) passes torchao's size rules for "
            f"{recipe} fp8 (both divisible by 16, {_SIZE_RULES[recipe]}; output layers "
            "excluded), so its step would be bf16's; leave fp8 out"
        )
    config = Float8LinearConfig.from_recipe_name(recipe)
    convert_to_float8_training(
        model, config=config, module_filter_fn=lambda module, name: name in chosen
    )
    return len(chosen)
