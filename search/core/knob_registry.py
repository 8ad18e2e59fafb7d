"""The knob registry: one entry for every generic knob, the ones any workload's step runs under.

An entry says what the knob is (name, description), how a configuration's label abbreviates it,
which tasks it applies to and whether it can change the numerics of a step (so the fidelity check
compares it with the fp32 reference). The knob lists of the workloads, the space checks, the split
of a configuration into knobs and workload settings, the fidelity check, serving and the labels of
configurations all read it; adding a knob is one entry here plus the code that applies it (a
``Knobs`` field and its use in the training step or serving, and its refusal on a device that
cannot run it).

Nothing here knows torch, a workload or a device.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "GENERIC_KNOBS",
    "KNOBS",
    "Knob",
    "NUMERIC_KNOBS",
    "SHORT_LABELS",
    "TASKS",
    "UNLABELLED",
    "knob_names",
    "levers_on",
]

TASKS = ("train", "serve")
"""The workload tasks (``Workload.task``): a training step, or serving a batch of requests."""


@dataclass(frozen=True, kw_only=True)
class Knob:
    """One generic knob: how a step executes, whatever the workload computes."""

    name: str
    """Its name in a space's ``params`` and a ``Knobs`` field."""
    short: str | None
    """The prefix a configuration's label puts before its value (``bs`` in ``bs32``); None: the
    label shows the value in the generic way (``search.core.records.config_name``)."""
    tasks: tuple[str, ...]
    """The workload tasks it applies to (``TASKS``); a space searching it for another is refused."""
    changes_numerics: bool
    """Whether a value other than the plain step's can change the step's numerics, so that the
    fidelity check must compare the configuration with the fp32 reference."""
    description: str
    """What it sets, in a sentence or two."""
    unlabelled: object = None
    """A value a configuration's label leaves out (the plain step's, where showing it on every
    label would be noise); None: every value is shown (a false flag never is)."""


KNOBS: tuple[Knob, ...] = (
    Knob(
        name="batch_size",
        short="bs",
        tasks=("train", "serve"),
        changes_numerics=False,
        description="Samples per optimizer step (requests per served batch).",
    ),
    Knob(
        name="micro_batch_size",
        short="mb",
        tasks=("train", "serve"),
        changes_numerics=True,
        description="Samples per forward/backward; gradients accumulate over the micro-batches "
        "(requests per prefill and decode). None: ``batch_size``.",
    ),
    Knob(
        name="precision",
        short=None,
        tasks=("train", "serve"),
        changes_numerics=True,
        description="fp32 | tf32 (CUDA only) | bf16 | fp16 | fp8-tensorwise | fp8-rowwise "
        "(bf16/fp16 via autocast, fp16 training adds a GradScaler; fp8: torchao's float8 "
        "training of the linear layers that gain, under bf16 autocast, CUDA compute capability "
        "8.9 or newer only).",
    ),
    Knob(
        name="streams",
        short="s",
        tasks=("train", "serve"),
        changes_numerics=True,
        description="Lanes running micro-batches concurrently: a CUDA stream each on a GPU, a "
        "thread each on a CPU.",
    ),
    Knob(
        name="recompute",
        short="recompute:",
        tasks=("train",),
        changes_numerics=True,
        description="none | all | every-K | selective | a part's name: recompute in backward, "
        "instead of keeping them, the activations of every block of "
        "``workload.recompute_modules()``, of every K-th, of every block but its matrix products "
        "(selective), or of one part of every block (``workload.recompute_parts()``); true and "
        "false mean all and none (serving has no backward pass).",
        unlabelled="none",
    ),
    Knob(
        name="compile",
        short="compile:",
        tasks=("train", "serve"),
        changes_numerics=True,
        description="off | default | reduce-overhead (CUDA only) | max-autotune: "
        "``torch.compile``'s mode for the step's function (the training loss, the serving "
        "forward); compiled before the timed windows, its compile time kept apart.",
        unlabelled="off",
    ),
    Knob(
        name="optimizer",
        short="opt:",
        tasks=("train",),
        changes_numerics=True,
        description="default | for-loop | foreach | fused: how the workload's optimizer (AdamW "
        "unless it builds another of torch.optim's) runs its update: torch's own choice for the "
        "device, one tensor at a time, batched over tensors, or one fused kernel; the same "
        "arithmetic, the fidelity check compares the update it takes.",
        unlabelled="default",
    ),
    Knob(
        name="kernels",
        short="kernels:",
        tasks=("train",),
        changes_numerics=True,
        description="torch | liger: the model's own operators, or Liger-Kernel's fused Triton "
        "kernels patched into it (RMSNorm, RoPE, SwiGLU, fused linear cross-entropy; CUDA only, "
        "for a workload that patches them in through ``Workload.use_kernels``).",
        unlabelled="torch",
    ),
    Knob(
        name="attention",
        short="attn:",
        tasks=("train", "serve"),
        changes_numerics=True,
        description="default | math | flash | efficient (CUDA) | cudnn (CUDA): the kernel that "
        "runs ``scaled_dot_product_attention``, torch's own pick for each call or the one named; "
        "moves only a model that calls it.",
        unlabelled="default",
    ),
)
"""Every generic knob, in the order a configuration lists them."""

GENERIC_KNOBS: tuple[str, ...] = tuple(knob.name for knob in KNOBS)
"""The names of every generic knob; any other name in a space is a setting of the workload."""

NUMERIC_KNOBS: tuple[str, ...] = tuple(knob.name for knob in KNOBS if knob.changes_numerics)
"""The knobs whose values the fidelity check compares with the plain fp32 step's."""

SHORT_LABELS: dict[str, str] = {knob.name: knob.short for knob in KNOBS if knob.short is not None}
"""The knobs a configuration's label abbreviates, with the prefix put before the value."""

UNLABELLED: dict[str, object] = {
    knob.name: knob.unlabelled for knob in KNOBS if knob.unlabelled is not None
}
"""The knobs whose plain value a configuration's label leaves out, with that value."""


def knob_names(task: str) -> tuple[str, ...]:
    """The names of the generic knobs that apply to ``task`` (``train`` or ``serve``)."""
    return tuple(knob.name for knob in KNOBS if task in knob.tasks)


def levers_on(config: Mapping[str, object]) -> tuple[str, ...]:
    """The knobs ``config`` sets off the plain step (``UNLABELLED``; a recompute flag that is set;
    more than one lane): what a plainer configuration does without. Of two that run equally fast,
    the plainer is the more predictable and the cheaper to run."""
    on = []
    for name, plain in UNLABELLED.items():
        value = config.get(name, plain)
        if isinstance(value, bool):
            value = plain if not value else "all"  # a flag: false is the plain step
        if value != plain:
            on.append(name)
    streams = config.get("streams", 1)
    if isinstance(streams, int) and streams > 1:
        on.append("streams")
    return tuple(on)
