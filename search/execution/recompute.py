"""Activation recompute (checkpointing): which activations a training step recomputes in backward
instead of keeping them from forward.

A setting is one of:

- ``none``: keep every activation (``false`` in a space means this);
- ``all``: recompute every block of ``Workload.recompute_modules()`` (``true`` means this);
- ``every-K``: recompute every K-th block (blocks 0, K, 2K, ...; torchtitan's selective
  checkpointing by layer), which saves about 1/K of what ``all`` saves for 1/K of its cost;
- a part's name (``attention``, ``mlp``, ...): recompute that part of every block, where the
  workload names the parts of its blocks (``Workload.recompute_parts()``);
- ``budget-F`` (``budget-0.5``): a compiled step's own choice under a memory budget, torch's
  ``activation_memory_budget``: the compiler's partitioner keeps at most the fraction F (0 to 1)
  of the activations a compiled step keeps and recomputes the cheapest of the rest, whatever the
  workload's blocks; eager, there is no partitioner, so it is refused with ``compile=off``;
- ``selective``: every block, but its matrix products, convolutions and attention are kept from
  forward and only the rest (norms, activations, residual adds, casts) is recomputed: torch's
  selective activation checkpointing (``create_selective_checkpoint_contexts``), as torchtitan's
  op-level policy. The cheap operators hold much of a block's activations (a SwiGLU's gate and up
  products' activations, every norm's output in fp32 under autocast) for a small share of its
  FLOPs, so it saves a share of ``all``'s memory for a fraction of its time.

Each setting computes the same step as ``none`` (recomputation repeats the same operators on the
same inputs), which the fidelity check confirms like any other knob.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from search.core.errors import KnobError
from search.workloads.base import Workload, is_counting

__all__ = [
    "RECOMPUTE_NONE",
    "SELECTIVE",
    "apply_recompute",
    "is_recompute_setting",
    "memory_budget",
    "named_by",
    "recompute_setting",
    "recompute_targets",
]

RECOMPUTE_NONE = "none"
SELECTIVE = "selective"
_ALL = "all"
_EVERY = re.compile(r"every-([1-9][0-9]*)")
_PART = re.compile(r"[a-z][a-z0-9_]*")
_BUDGET = re.compile(r"budget-(0?\.[0-9]*[1-9][0-9]*)")
"""``budget-F``: F a fraction strictly between 0 and 1 (0.5, .25)."""


def recompute_setting(value: object) -> str:
    """``value`` as a setting's name: a flag (a space's ``type: bool``) is ``all`` or ``none``;
    ``every-1`` is ``all``."""
    if isinstance(value, bool):
        return _ALL if value else RECOMPUTE_NONE
    if value == "every-1":
        return _ALL
    return str(value)


def is_recompute_setting(value: object) -> bool:
    """Whether ``value`` has a setting's form (a part's name is checked against the workload only
    when the step is built)."""
    if isinstance(value, bool):
        return True
    return isinstance(value, str) and any(
        rule.fullmatch(value) for rule in (_EVERY, _PART, _BUDGET)
    )


def memory_budget(setting: str) -> float | None:
    """The fraction of a compiled step's activations ``budget-F`` keeps (F); None for any other
    setting."""
    budget = _BUDGET.fullmatch(setting)
    return float(budget.group(1)) if budget else None


def named_by(setting: str) -> str | None:
    """The workload method that names what ``setting`` recomputes: ``recompute_modules`` (the
    blocks: all, every-K), ``recompute_parts`` (a part's name); None for none and for a memory
    budget (the compiler chooses)."""
    if setting == RECOMPUTE_NONE or memory_budget(setting) is not None:
        return None
    if setting in (_ALL, SELECTIVE) or _EVERY.fullmatch(setting):
        return "recompute_modules"
    return "recompute_parts"


def recompute_targets(workload: Workload, model: nn.Module, setting: str) -> list[nn.Module]:
    """The modules whose forward ``setting`` recomputes in backward; ``KnobError`` where the
    workload names no such blocks or part."""
    if setting == RECOMPUTE_NONE or memory_budget(setting) is not None:
        return []  # a memory budget wraps nothing: the compiler's partitioner recomputes
    name = type(workload).__name__
    if setting in (_ALL, SELECTIVE) or _EVERY.fullmatch(setting):
        blocks = workload.recompute_modules(model)
        if not blocks:
            raise KnobError(
                f"recompute={setting} needs blocks to recompute, but {name}.recompute_modules() "
                "returns no modules; set recompute to none or override recompute_modules()."
            )
        every = _EVERY.fullmatch(setting)
        step = int(every.group(1)) if every else 1
        return blocks[::step]
    parts = workload.recompute_parts(model)
    if setting not in parts:
        named = ", ".join(sorted(parts)) or "none"
        raise KnobError(
            f"recompute={setting!r} is no setting of {name}: it takes none, all, every-K and the "
            f"parts its recompute_parts() names ({named}); pick one of those."
        )
    return parts[setting]


def apply_recompute(workload: Workload, model: nn.Module, setting: str) -> None:
    """Make every target module of ``setting`` recompute its activations in backward (under
    ``selective``, all but what ``_SAVED`` keeps)."""
    for module in recompute_targets(workload, model, setting):
        module.forward = _checkpointed(module.forward, selective=setting == SELECTIVE)


def _saved_ops() -> frozenset[Any]:
    """The operators ``selective`` keeps from forward: the matrix products, convolutions and
    attention kernels (those this torch build has), where a block's FLOPs are."""
    aten = torch.ops.aten
    names = ["mm", "addmm", "bmm", "baddbmm", "linear", "_scaled_mm", "convolution"] + [
        name
        for name in dir(aten)
        if name.startswith("_scaled_dot_product") and "backward" not in name
    ]
    return frozenset(getattr(aten, n).default for n in names if hasattr(aten, n))


_SAVED = _saved_ops()


def _keep_the_products(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVED else CheckpointPolicy.PREFER_RECOMPUTE


def _checkpointed(forward: Callable, selective: bool = False) -> Callable:
    policy: dict[str, Any] = (
        {"context_fn": partial(create_selective_checkpoint_contexts, _keep_the_products)}
        if selective
        else {}
    )

    def run(*args, **kwargs):
        if is_counting():  # model FLOPs, not the repeats
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **policy, **kwargs)

    return run
