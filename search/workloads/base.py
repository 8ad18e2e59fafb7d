"""The workload contract: what a PyTorch model must provide to be tuned.

A workload describes *what* one training step computes; the knobs (``search.knobs``) decide *how*
it executes (batch and micro-batch sizes, precision, lanes, recompute). A user's own workload is a
subclass named by ``_target_`` in a space file; its constructor receives the space's ``workload``
settings plus every searched parameter that is not a generic knob.
"""

from __future__ import annotations

import abc
from typing import Any

import torch
from torch import nn

Batch = Any
"""A tensor, or a tuple/list/dict of tensors, holding ``size`` samples on the CPU."""


class Workload(abc.ABC):
    """A training step to tune: a model, synthetic batches and a loss.

    Subclasses implement three methods. Everything else has a default that suits most models.
    """

    unit: str = "samples"
    """What one item is; throughput is reported in ``{unit}/s`` (e.g. ``tokens``)."""

    @abc.abstractmethod
    def build_model(self) -> nn.Module:
        """Build the model on the CPU with its initial weights (deterministic under the torch
        seed)."""

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
        """Submodules whose activations may be recomputed in backward (the ``recompute`` knob).

        Default: none, so a space that searches ``recompute`` over this workload is rejected with
        a message naming this method.
        """
        return []

    def make_optimizer(self, params: Any) -> torch.optim.Optimizer:
        """The optimizer of the training step. Default: AdamW, lr 1e-4."""
        return torch.optim.AdamW(params, lr=1e-4)
