"""Generic knobs: *how* any workload's step executes.

A ``Workload`` says what one step computes; ``Knobs`` choose how it runs (batch split, precision,
concurrent lanes, activation recompute, compilation); the training step
(``search.execution.train_step``) and the serving step (``search.execution.serving``) run under
them.

Which knobs there are, for which tasks, is the registry ``search.core.knob_registry``; this
module holds the code that applies them: a ``Knobs`` field each, the values a space may give it
(``value_rule``), for a knob that depends on the device, why a device cannot run a value
(``unsupported_reason``), and what both steps build alike (the model, the lanes).
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import nn

from search.core.errors import KnobError
from search.core.knob_registry import NUMERIC_KNOBS
from search.execution.attention import (
    ATTENTION_KERNELS,
    HALF_INPUTS_ON_CUDA,
    attention_unsupported,
)
from search.execution.compiling import COMPILE_MODES, compile_unsupported
from search.execution.fp8 import FP8_PRECISIONS, fp8_unsupported
from search.execution.kernels import KERNELS, kernels_unsupported
from search.execution.optimizers import OPTIMIZER_IMPLEMENTATIONS, optimizer_unsupported
from search.execution.random_draws import as_drawn
from search.execution.recompute import (
    RECOMPUTE_NONE,
    is_recompute_setting,
    memory_budget,
    recompute_setting,
)
from search.workloads.base import Batch, ServingWorkload, Workload, is_counting

__all__ = [
    "AUTOCAST_DTYPES",
    "attention_precision_unsupported",
    "KNOB_CHOICES",
    "Knobs",
    "MATMUL_PRECISIONS",
    "PRECISIONS",
    "build_model",
    "concurrently",
    "knobs_off_default",
    "lane_threads",
    "make_streams",
    "map_tensors",
    "refuse_unsupported",
    "tensor_shapes",
    "together_unsupported",
    "unsupported_reason",
    "value_rule",
]

PRECISIONS = ("fp32", "tf32", "bf16", "fp16", *FP8_PRECISIONS)
KNOB_CHOICES: dict[str, tuple[str, ...]] = {
    "precision": PRECISIONS,
    "compile": COMPILE_MODES,
    "optimizer": OPTIMIZER_IMPLEMENTATIONS,
    "kernels": KERNELS,
    "attention": ATTENTION_KERNELS,
}
"""The values a knob that is a choice of names may take, by knob name."""

# fp8 runs its linear layers in fp8 (torchao) and the rest of the step in bf16, as torchao's
# recipes are used.
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
AUTOCAST_DTYPES.update({p: torch.bfloat16 for p in FP8_PRECISIONS})
# Every precision sets the float32 matmul precision, so no step inherits another's TF32 setting.
MATMUL_PRECISIONS = {p: "high" if p == "tf32" else "highest" for p in PRECISIONS}


T = TypeVar("T")


def lane_threads(lanes: int) -> list[ThreadPoolExecutor]:
    """One thread of its own for each lane. A shared pool of ``lanes`` threads starts a second
    thread only when no started one is idle, so a lane that ended before the next was handed over
    took that one too, and the two ran one after the other on one thread (seen on a loaded 2-core
    machine: every micro-batch of two lanes on one thread)."""
    return [ThreadPoolExecutor(1, thread_name_prefix=f"lane{lane}") for lane in range(lanes)]


def concurrently(
    threads: Sequence[ThreadPoolExecutor], calls: Sequence[Callable[[], T]]
) -> list[T]:
    """Run each of ``calls`` on its own of ``threads`` (``lane_threads``) at the same time and
    return their results in order; one after another in this thread while work is counted
    (``counting``), and a single call in this thread: one lane has nothing to run beside, and
    handing it to a thread and waiting for it cost 0.2-0.5 ms of every step on a 2-core CPU (a
    tiny model's step measured 0.75 ms against its plain loop's 0.28 ms), host time the step was
    charged with that a training loop of the user's does not pay."""
    if is_counting() or len(calls) == 1:
        return [call() for call in calls]
    futures = [thread.submit(call) for thread, call in zip(threads, calls, strict=True)]
    return [future.result() for future in futures]


@dataclass(kw_only=True, frozen=True)
class Knobs:
    """The generic knobs of one training step; the defaults run the plain fp32 step."""

    batch_size: int
    """Samples per optimizer step."""
    micro_batch_size: int | None = None
    """Samples per forward/backward; gradients accumulate over the micro-batches.
    None: ``batch_size``."""
    precision: str = "fp32"
    """fp32 | tf32 (CUDA only) | bf16 | fp16 (bf16/fp16 via autocast; fp16 adds a GradScaler)."""
    streams: int = 1
    """Lanes running micro-batches concurrently: a CUDA stream each on a GPU, a thread each on a
    CPU."""
    recompute: str = RECOMPUTE_NONE
    """Which activations backward recomputes instead of keeping them: none, all, every-K (blocks),
    selective (every block but its matrix products) or a part of every block
    (``search.execution.recompute``); a flag is read as all or none."""
    compile: str = "off"
    """off | default | reduce-overhead (CUDA only) | max-autotune: ``torch.compile``'s mode for the
    step's function (``search.execution.compiling``)."""
    optimizer: str = "default"
    """default | for-loop | foreach | fused: the optimizer's implementation
    (``search.execution.optimizers``)."""
    kernels: str = "torch"
    """torch | liger: the model's own operators or fused kernels patched in
    (``search.execution.kernels``)."""
    attention: str = "default"
    """default | math | flash | efficient (CUDA only) | cudnn (CUDA only): the kernel that runs
    ``scaled_dot_product_attention`` (``search.execution.attention``)."""

    def __post_init__(self) -> None:
        if not (isinstance(self.batch_size, int) and self.batch_size >= 1):
            raise KnobError(f"`batch_size >= 1` must hold, but got batch_size={self.batch_size!r}.")
        if not 1 <= self.micro_samples <= self.batch_size or self.batch_size % self.micro_samples:
            divisors = [d for d in range(1, self.batch_size + 1) if self.batch_size % d == 0]
            raise KnobError(
                "`micro_batch_size` must divide `batch_size`, but got "
                f"(batch_size={self.batch_size}, micro_batch_size={self.micro_batch_size}); "
                f"pick one of {divisors}."
            )
        if not is_recompute_setting(self.recompute):
            raise KnobError(
                "`recompute` must be none, all, every-K, selective, budget-F (0 < F < 1) or the "
                f"name of a part of a block, but got {self.recompute!r}."
            )
        object.__setattr__(self, "recompute", recompute_setting(self.recompute))
        if self.precision not in PRECISIONS:
            raise KnobError(f"`precision` must be one of {PRECISIONS}, but got {self.precision!r}.")
        for name in ("compile", "optimizer", "kernels", "attention"):
            if getattr(self, name) not in KNOB_CHOICES[name]:
                raise KnobError(
                    f"`{name}` must be one of {KNOB_CHOICES[name]}, but got "
                    f"{getattr(self, name)!r}."
                )
        if not 1 <= self.streams <= self.n_micro_batches:
            raise KnobError(
                f"`1 <= streams <= batch_size / micro_batch_size` must hold (every lane needs a "
                f"micro-batch), but got (streams={self.streams}, batch_size={self.batch_size}, "
                f"micro_batch_size={self.micro_batch_size}); lower streams or micro_batch_size."
            )

    @property
    def micro_samples(self) -> int:
        """Samples per forward/backward, with ``None`` resolved to ``batch_size``."""
        return self.batch_size if self.micro_batch_size is None else self.micro_batch_size

    @property
    def n_micro_batches(self) -> int:
        """Forward/backward passes per optimizer step."""
        return self.batch_size // self.micro_samples

    def numerics_apart_from(self, other: Knobs) -> tuple[str, ...]:
        """The knobs that can change the numerics (``search.core.knob_registry``) on which this step
        runs otherwise than ``other``; ``micro_batch_size`` as it runs (None is ``batch_size``)."""
        return tuple(n for n in NUMERIC_KNOBS if self._running(n) != other._running(n))

    def _running(self, name: str) -> object:
        return self.micro_samples if name == "micro_batch_size" else getattr(self, name)


_DEFAULTS = {
    f.name: f.default for f in dataclasses.fields(Knobs) if f.default is not dataclasses.MISSING
}
_FIELD_TYPES = typing.get_type_hints(Knobs)


def knobs_off_default(knobs: Knobs, names: Sequence[str]) -> list[str]:
    """Those of ``names`` that ``knobs`` sets to something other than the plain step's default."""
    return [name for name in names if getattr(knobs, name) != _DEFAULTS[name]]


def value_rule(name: str) -> tuple[Callable[[object], bool], str]:
    """Whether a value suits knob ``name``'s ``Knobs`` field, and the words for what does: one of
    ``KNOB_CHOICES``, true or false for a flag, a positive int for a size or a count."""
    if name in KNOB_CHOICES:
        choices = KNOB_CHOICES[name]
        return (lambda v: v in choices, f"one of {', '.join(choices)}")
    if name == "recompute":
        return (
            is_recompute_setting,
            "none, all, every-K, selective, budget-F (0 < F < 1), a part's name, or true or false",
        )
    if _FIELD_TYPES[name] is bool:
        return (lambda v: isinstance(v, bool), "true or false")
    if _FIELD_TYPES[name] in (int, int | None):
        return (
            lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1,
            "a positive int",
        )
    raise TypeError(f"knob {name}: no rule for a {_FIELD_TYPES[name]} field; add one here")


def _precision_unsupported(value: object, device: torch.device) -> str | None:
    if value in FP8_PRECISIONS:
        return fp8_unsupported(value, device)
    if value == "tf32" and device.type != "cuda":
        return "tf32 needs a CUDA device"
    if device.type != "cuda" or value not in ("tf32", "bf16"):
        return None
    # Asked of this device, not of the current one (cuda:1 may differ from cuda:0).
    if torch.cuda.get_device_capability(device) < (8, 0):
        return (
            f"{value} needs a GPU of compute capability 8.0 or newer "
            "(tf32 would silently run as fp32)"
        )
    return None


_DEVICE_REFUSALS: dict[str, Callable[[object, torch.device], str | None]] = {
    "precision": _precision_unsupported,
    "compile": compile_unsupported,
    "optimizer": optimizer_unsupported,
    "kernels": kernels_unsupported,
    "attention": attention_unsupported,
}
"""Why a device cannot run a knob's value (None: it can), for the knobs that depend on the
device."""


def unsupported_reason(knob: str, value: object, device: torch.device) -> str | None:
    """Why ``device`` cannot run ``knob=value``; None when it can or the knob does not depend on it.

    Lets a study drop choices before it starts; the steps raise ``KnobError`` for the same
    reasons.
    """
    refusal = _DEVICE_REFUSALS.get(knob)
    return None if refusal is None else refusal(value, device)


def refuse_unsupported(knobs: Knobs, device: torch.device) -> None:
    """Raise ``KnobError`` for the first knob ``device`` cannot run (``unsupported_reason``), or
    for two that it cannot run together."""
    for name in _DEVICE_REFUSALS:
        value = getattr(knobs, name)
        reason = unsupported_reason(name, value, device)
        if reason:
            raise KnobError(
                f"{name}={value!r} cannot run on {device}: {reason}; pick another {name}."
            )
    reason = together_unsupported(knobs, device)
    if reason:
        raise KnobError(reason)


def attention_precision_unsupported(
    kernel: str, precision: str, device: torch.device
) -> str | None:
    """Why ``kernel`` cannot run a step of ``precision`` on ``device`` (None: it can): run, torch
    would fail every call with "No available kernel", a fault of the trial, where this is a
    configuration that cannot exist (infeasible, and not counted as a failure). A precision
    without autocast (fp32, tf32) runs attention in fp32."""
    if device.type == "cuda" and kernel in HALF_INPUTS_ON_CUDA and precision not in AUTOCAST_DTYPES:
        return (
            f"CUDA's {kernel} kernel takes fp16 and bf16 inputs only, and a step in {precision} "
            "runs attention in fp32"
        )
    return None


def together_unsupported(knobs: Knobs, device: torch.device) -> str | None:
    """Why ``device`` cannot run two of ``knobs`` together, each of which it can run (None: it
    can): an attention kernel that takes no input of the step's precision; a memory budget for
    recompute in a step that is not compiled (only the compiler's partitioner reads it)."""
    if memory_budget(knobs.recompute) is not None and knobs.compile == "off":
        return (
            f"recompute={knobs.recompute!r} is the compiler's activation memory budget, and "
            "compile=off runs eagerly; compile the step, or pick another recompute setting."
        )
    reason = attention_precision_unsupported(knobs.attention, knobs.precision, device)
    if reason is None:
        return None
    return (
        f"attention={knobs.attention!r} with precision={knobs.precision!r} cannot run on "
        f"{device}: {reason}; pick a half precision (bf16, fp16) or another attention."
    )


def build_model(workload: Workload | ServingWorkload, device: torch.device, seed: int) -> nn.Module:
    """``workload.build_model()`` under ``seed``, its tensors created on ``device`` (the default
    device while it builds): a 1.1B-parameter model initialises in seconds on a GPU, against
    17 s on a 2-core CPU, and every trial builds it up to three times (the step, the fidelity
    check's two passes). Same device and seed, same initial weights."""
    # fork_rng: the global generators are left as found, not reseeded.
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        with torch.device(device):
            model = workload.build_model()
    return as_drawn(model.to(device).train())  # the fidelity check's passes: no random draws


def make_streams(n_lanes: int, device: torch.device) -> list[torch.cuda.Stream | None]:
    if device.type == "cuda":
        return [torch.cuda.Stream(device) for _ in range(n_lanes)]
    return [None] * n_lanes


def tensor_shapes(batch: Batch) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
    """The shape and dtype of every tensor in ``batch``, in ``map_tensors``' order."""
    shapes: list[tuple[tuple[int, ...], torch.dtype]] = []

    def note(tensor: torch.Tensor) -> torch.Tensor:
        shapes.append((tuple(tensor.shape), tensor.dtype))
        return tensor

    map_tensors(note, batch)
    return tuple(shapes)


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], batch: Batch) -> Batch:
    """Apply ``fn`` to every tensor in a tensor, or a tuple/list/dict of them."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, dict):
        return {key: map_tensors(fn, value) for key, value in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(map_tensors(fn, value) for value in batch)
    return batch
