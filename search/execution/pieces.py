"""The same samples in smaller pieces: how the fidelity check's fp32 reference fits where the
configuration it checks fits only in a narrower precision.

bf16 activations take half of fp32's, so the largest micro-batch that fits in bf16 may not fit in
fp32. The reference must still compute the configuration's step on the configuration's samples.
``Pieces`` draws the samples exactly as the configuration's step draws them (one ``make_batch``
per micro-batch from the seeded generator), cuts each micro-batch into equal pieces along its
first dimension, and hands them out, in order, to a step that runs one piece per pass. The loss
of a workload is the mean over its samples, and the step divides each pass's loss by the number
of passes, so equal pieces sum to the same mean and the same gradients, in exact arithmetic.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from search.execution.knobs import Knobs, map_tensors
from search.workloads.base import Batch, ServingWorkload, State, Workload

__all__ = ["ServingPieces", "TrainingPieces", "piece_sizes"]


def piece_sizes(micro_samples: int) -> Iterator[int]:
    """The piece sizes to try, largest first: ``micro_samples``, then each time divided by its
    smallest prime factor, down to 1 (every size divides the micro-batch, so pieces are equal)."""
    size = micro_samples
    while True:
        yield size
        if size == 1:
            return
        size //= next(p for p in range(2, size + 1) if size % p == 0)


def _drawn(draw, knobs: Knobs, seed: int, piece: int) -> list[Any]:
    """The configuration's micro-batches, drawn as its step draws them, each cut into pieces of
    ``piece`` samples along the first dimension of every tensor."""
    generator = torch.Generator().manual_seed(seed)
    micro_batches = [draw(knobs.micro_samples, generator) for _ in range(knobs.n_micro_batches)]
    return [
        _piece(batch, start, piece)
        for batch in micro_batches
        for start in range(0, knobs.micro_samples, piece)
    ]


def _piece(batch: Batch, start: int, size: int) -> Batch:
    return map_tensors(lambda t: t[start : start + size], batch)


class _Replay:
    """Hands out the pieces in order, whatever size and generator the step asks with."""

    def __init__(self, pieces: list[Any], piece: int):
        self._pieces, self._piece = iter(pieces), piece

    def next(self, size: int) -> Any:
        if size != self._piece:
            raise ValueError(f"pieces hold {self._piece} samples, but {size} were asked for")
        return next(self._pieces)


class TrainingPieces(Workload):
    """``workload`` whose batches are the pieces of ``knobs``'s micro-batches (module docstring);
    run it under ``Knobs(batch_size=knobs.batch_size, micro_batch_size=piece)``, once."""

    def __init__(self, workload: Workload, knobs: Knobs, seed: int, piece: int):
        self.inner = workload
        self.unit, self.task, self.knobs = workload.unit, workload.task, workload.knobs
        self._replay = _Replay(_drawn(workload.make_batch, knobs, seed, piece), piece)

    def build_model(self) -> nn.Module:
        return self.inner.build_model()

    def make_batch(self, size: int, generator: torch.Generator) -> Batch:
        return self._replay.next(size)

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        return self.inner.loss(model, batch)

    def items_per_sample(self) -> int:
        return self.inner.items_per_sample()

    def make_optimizer(self, params: Any) -> torch.optim.Optimizer:
        return self.inner.make_optimizer(params)


class ServingPieces(ServingWorkload):
    """``workload``'s reference whose prompts are the pieces of ``knobs``'s micro-batches: each
    request is served alone in every sense that matters (the greedy tokens of a request do not
    depend on the others), so pieces serve the same requests."""

    def __init__(self, workload: ServingWorkload, knobs: Knobs, seed: int, piece: int):
        self.inner = workload.reference()
        self.unit, self.task, self.knobs = workload.unit, workload.task, workload.knobs
        self._replay = _Replay(_drawn(self.inner.make_prompts, knobs, seed, piece), piece)

    def build_model(self) -> nn.Module:
        return self.inner.build_model()

    def make_prompts(self, size: int, generator: torch.Generator) -> torch.Tensor:
        return self._replay.next(size)

    def forward(
        self, model: nn.Module, tokens: torch.Tensor, state: State | None
    ) -> tuple[torch.Tensor, State]:
        return self.inner.forward(model, tokens, state)

    def generation_length(self) -> int:
        return self.inner.generation_length()
