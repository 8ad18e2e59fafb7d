"""The workload contract: what a PyTorch model must provide to be tuned.

A workload describes *what* one step computes; the knobs (``search.execution.knobs``) decide *how*
it executes (batch and micro-batch sizes, precision, lanes, recompute). Two tasks exist: a training
step (``Workload``: forward, loss, backward, optimizer step) and serving (``ServingWorkload``: a
batch of requests, each a prompt followed by generated tokens). A user's own workload is a subclass
of either, named by ``_target_`` in a space file; its constructor receives the space's ``workload``
settings plus every searched parameter that is not a generic knob.
"""

from __future__ import annotations

import abc
import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any, ClassVar

import torch
from torch import nn

from search.core.knob_registry import knob_names

__all__ = [
    "Batch",
    "SERVE_KNOBS",
    "ServingWorkload",
    "State",
    "TRAIN_KNOBS",
    "Workload",
    "counting",
    "is_counting",
    "require_positive_ints",
]

Batch = Any
"""A tensor, or a tuple/list/dict of tensors, holding ``size`` samples on the CPU."""
State = Any
"""What a serving workload carries from one forward to the next (a KV cache, the prefix, ...)."""

TRAIN_KNOBS = knob_names("train")
"""The generic knobs of a training step (``search.core.knob_registry``)."""
SERVE_KNOBS = knob_names("serve")
"""Serving has no backward pass, so nothing to recompute: a knob that trades compute for memory
there is the workload's own (e.g. ``kv_cache``)."""


_COUNTING = contextvars.ContextVar("counting", default=False)


@contextlib.contextmanager
def counting() -> Iterator[None]:
    """While a step's work is counted (``search.analysis.diagnosis``): what would run on other
    threads runs in this one (torch's dispatch modes, which count, are per thread), and recompute
    is off (model FLOPs, not the repeats). Part of the contract because a workload that runs
    threads of its own must honour it (``is_counting``)."""
    token = _COUNTING.set(True)
    try:
        yield
    finally:
        _COUNTING.reset(token)


def is_counting() -> bool:
    """Whether a step's work is being counted (``counting``): run everything in this thread.

    Never inside compiled code: a counted step runs its eager function, and dynamo cannot trace
    a ``ContextVar`` read (a graph break at each recomputed part: 9 a step on the llama CPU
    preset, which refused it as a break storm)."""
    if torch.compiler.is_compiling():
        return False
    return _COUNTING.get()


class Workload(abc.ABC):
    """A training step to tune: a model, synthetic batches and a loss.

    Subclasses implement three methods. Everything else has a default that suits most models.
    """

    task: str = "train"
    """What one step is: ``train`` (an optimizer step) or ``serve`` (``ServingWorkload``)."""

    knobs: tuple[str, ...] = TRAIN_KNOBS
    """The generic knobs that apply to this task; a space searching another one is refused."""

    unit: str = "samples"
    """What one item is; throughput is reported in ``{unit}/s`` (e.g. ``tokens``)."""

    requires: ClassVar[dict[str, str]] = {}
    """Optional packages it imports beyond the tool's own dependencies: import name -> how to
    install it. A space naming a workload whose package is missing is refused with that line."""

    preload: ClassVar[tuple[str, ...]] = ()
    """Modules every trial's process imports before building it (its library's, beyond torch):
    the fork server that trial workers are forked from imports them once, so each worker starts
    with them (``search.execution.worker_server.serve_workers_with``). One that fails to import
    is left for the worker to meet."""

    @abc.abstractmethod
    def build_model(self) -> nn.Module:
        """Build the model with its initial weights (deterministic under the torch seed). It is
        called with the step's device as torch's default device, so its tensors start there."""

    @abc.abstractmethod
    def make_batch(self, size: int, generator: torch.Generator) -> Batch:
        """Return ``size`` synthetic samples as CPU tensors, drawn only from ``generator``."""

    @abc.abstractmethod
    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """Return the scalar loss of ``model`` on ``batch``, averaged over its samples."""

    def items_per_sample(self) -> int:
        """How many items (``unit``) one sample holds: e.g. tokens per sequence. Default 1."""
        return 1

    def flops_per_item(self) -> float | None:
        """Model FLOPs of one training step per item (forward and backward, not counting what
        ``recompute`` repeats), for model FLOP utilisation. Default None: not counted."""
        return None

    def recompute_modules(self, model: nn.Module) -> list[nn.Module]:
        """The blocks whose activations may be recomputed in backward, in the order forward runs
        them (the ``recompute`` knob: ``all`` of them, or ``every-K``-th from the first).

        Default: none, so a space that searches ``recompute`` over this workload is rejected with
        a message naming this method.
        """
        return []

    def recompute_parts(self, model: nn.Module) -> dict[str, list[nn.Module]]:
        """The parts of the blocks that may be recomputed alone, by name: e.g. ``attention`` and
        ``mlp``, each the list of that part's module in every block (``recompute: mlp``
        recomputes the MLP of every block). Default: none named."""
        return {}

    def use_kernels(self, model: nn.Module, kernels: str) -> None:
        """Patch the fused kernels named ``kernels`` (``liger``) into ``model``, in place (the
        ``kernels`` knob, ``search.execution.kernels``). Default: none, so a space that searches
        ``kernels`` beyond ``torch`` over this workload is rejected with a message naming this
        method."""
        raise NotImplementedError(f"{type(self).__name__} names no fused kernels")

    def make_optimizer(self, params: Any) -> torch.optim.Optimizer:
        """The optimizer of the training step. Default: AdamW, lr 1e-4."""
        return torch.optim.AdamW(params, lr=1e-4)

    def refuses(self, knob: str, value: Any) -> str | None:
        """Why this workload, as its settings built it, cannot take the generic ``knob`` at
        ``value`` (an architecture whose layers have no part of that name, say); None where it
        can. Asked before the study for every value a space searches, so that a value no trial
        could run is refused in one line. Default: none refused."""
        return None


class ServingWorkload(abc.ABC):
    """Autoregressive generation to tune: a batch of requests, each a prompt of its own, then
    greedy decoding of ``generation_length()`` tokens for each.

    One step serves one batch: the prompts are split into micro-batches, each prefilled and then
    decoded token by token on its lane (``search.execution.serving``). Time to first token is
    measured from the start of the step (every request of the batch arrives then) to the end of its
    micro-batch's prefill; time per output token over the rest of its generation. Throughput counts
    generated tokens. Subclasses implement four methods.
    """

    task: str = "serve"
    knobs: tuple[str, ...] = SERVE_KNOBS
    requires: ClassVar[dict[str, str]] = {}
    """As ``Workload.requires``."""
    preload: ClassVar[tuple[str, ...]] = ()
    """As ``Workload.preload``."""

    unit: str = "tokens"
    """Generated tokens: throughput is in tokens/s of output."""

    @abc.abstractmethod
    def build_model(self) -> nn.Module:
        """Build the model with its initial weights (deterministic under the torch seed). It is
        called with the step's device as torch's default device, so its tensors start there."""

    @abc.abstractmethod
    def make_prompts(self, size: int, generator: torch.Generator) -> torch.Tensor:
        """Return ``size`` synthetic prompts as a CPU tensor, drawn only from ``generator``."""

    @abc.abstractmethod
    def forward(
        self, model: nn.Module, tokens: torch.Tensor, state: State | None
    ) -> tuple[torch.Tensor, State]:
        """Run ``tokens`` (the prompts with ``state`` None, then the last generated token of
        each request, shape ``(batch, 1)``) and return the logits of the last position,
        ``(batch, vocab)``, with the state the next call continues from."""

    @abc.abstractmethod
    def generation_length(self) -> int:
        """Tokens generated per request (including the first)."""

    def items_per_sample(self) -> int:
        """Items per request: its generated tokens."""
        return self.generation_length()

    def reference(self) -> ServingWorkload:
        """The plainest implementation of the same computation (e.g. without a cache): the
        fidelity check compares every configuration with it, in fp32. Default: itself."""
        return self


def require_positive_ints(**sizes: object) -> None:
    """Each of ``sizes`` is an int >= 1 (not a bool); else ValueError naming it."""
    for name, value in sizes.items():
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            raise ValueError(f"`{name}` must be an int >= 1, but got {name}={value!r}.")
