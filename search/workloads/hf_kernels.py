"""Liger-Kernel's fused kernels on one transformers model, and on no other.

Liger patches a model family in two places: the model given (its norms, MLPs and loss, in place)
and transformers' modeling module of that family (its classes, for every model built after, and
its rotary function, which every attention layer looks up each time it runs). The fidelity check
builds its fp32 reference in the same process, after the patched model: it must run transformers'
own code. So whatever the patch changed in the module is put back at once, and the functions a
forward looks up there are set at each forward to those of the model running (``use_globals``):
the patched model's own, or transformers' for any other.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any, cast

from torch import nn

__all__ = ["liger_patch", "liger_refusal", "use_globals", "use_liger"]

_PLAIN: dict[tuple[str, str], Any] = {}
"""transformers' own value of each module global a Liger patch changed: (module, name) -> value,
kept from the first patch on (the module may hold another Liger model's, left by its forward)."""

_MISSING = object()


def liger_patch(model_type: str) -> Any:
    """Liger-Kernel's patch for ``model_type`` (``apply_liger_kernel_to_llama``); None where it
    has none. Imports Liger-Kernel."""
    from liger_kernel import transformers as liger

    return getattr(liger, f"apply_liger_kernel_to_{model_type}", None)


def liger_refusal(model_type: str) -> str | None:
    """Why ``model_type`` cannot take ``kernels=liger`` (Liger-Kernel has no patch for it), with
    the architectures it has; None where it can, or where Liger-Kernel is not installed (the
    device's own check says so)."""
    try:
        from liger_kernel import transformers as liger
    except ImportError:
        return None
    if liger_patch(model_type) is not None:
        return None
    prefix = "apply_liger_kernel_to_"
    known = sorted(name[len(prefix) :] for name in dir(liger) if name.startswith(prefix))
    return f"Liger-Kernel has no kernels for {model_type} (it has: {', '.join(known)})"


def use_liger(model: nn.Module, model_type: str) -> None:
    """Patch Liger's kernels into ``model`` alone: its modules in place; what the patch set in
    transformers' module put back, and the functions among it kept on the model for its own
    forward passes (``use_globals``)."""
    patch = liger_patch(model_type)
    if patch is None:
        raise NotImplementedError(liger_refusal(model_type) or f"no Liger kernels: {model_type}")
    module = _modeling_module(model)
    _set_plain(module)
    before = dict(vars(module))
    try:
        patch(model=cast(Any, model))  # typed PreTrainedModel
    finally:
        changed = {
            name: value
            for name, value in vars(module).items()
            if before.get(name, _MISSING) is not value
        }
        for name in changed:
            plain = before.get(name, _MISSING)
            _PLAIN.setdefault((module.__name__, name), plain)
            if plain is _MISSING:
                delattr(module, name)
            else:
                setattr(module, name, plain)
    # classes only matter to models built later; functions are looked up as the model runs
    own = {n: v for n, v in changed.items() if not isinstance(v, type)}
    object.__setattr__(model, "liger_globals", own)  # a plain attribute, not a module's state


def use_globals(model: nn.Module) -> None:
    """Before ``model``'s forward: the module globals a Liger patch changed, as this model runs
    them (its own where it was patched, transformers' otherwise). Nothing where no model of this
    process was patched."""
    if not _PLAIN:
        return
    module = _modeling_module(model)
    own: dict[str, Any] = getattr(model, "liger_globals", {})
    for (where, name), plain in _PLAIN.items():
        if where == module.__name__ and plain is not _MISSING:
            setattr(module, name, own.get(name, plain))


def _set_plain(module: ModuleType) -> None:
    """Put transformers' own values back in ``module`` where a Liger model's forward left its."""
    for (where, name), plain in _PLAIN.items():
        if where == module.__name__ and plain is not _MISSING:
            setattr(module, name, plain)


def _modeling_module(model: nn.Module) -> ModuleType:
    """The transformers module that defines ``model``'s class (``modeling_llama``)."""
    return sys.modules[type(model).__module__]
