"""A workload of known kinds, for ``benchmarks/coverage_by_kind.py``: each micro-batch does one
fixed piece of work whose kind the ``kind`` setting names.

- ``steady``: waits ``work_ms`` (sleeps): the host idles, as in a step bound by a device or I/O;
- ``overhead``: ``ops`` tiny tensor operations from Python: bound by the interpreter;
- ``compute``: ``matmuls`` fp32 products of 384x384 matrices: real matrix products;
- ``stalling``: waits ``work_ms``, and 2% of micro-batches wait ten times as long.

The work is fixed (a count, or a sleep), not a time budget, so a faster process runs it faster:
each kind moves between fresh processes as its kind of work does.
"""

from __future__ import annotations

import os
import random
import time

import torch
from torch import nn

from search.workloads import Workload

STALL_SHARE, STALL_FACTOR = 0.02, 10.0
"""A stalling micro-batch: one in fifty, ten times as long."""


class _Work(nn.Module):
    def __init__(self, kind: str, work_ms: float, ops: int, matmuls: int) -> None:
        super().__init__()
        self.kind, self.work_s, self.ops, self.matmuls = kind, work_ms / 1e3, ops, matmuls
        self.matrix = nn.Parameter(torch.randn(384, 384) / 20, requires_grad=False)
        self.stalls = random.Random(os.getpid())  # each process draws its own stalls

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind in ("steady", "stalling"):
            stalled = self.kind == "stalling" and self.stalls.random() < STALL_SHARE
            time.sleep(self.work_s * (STALL_FACTOR if stalled else 1.0))
        elif self.kind == "overhead":
            one = torch.ones(1)
            for _ in range(self.ops):
                one = one + 1e-6
        elif self.kind == "compute":
            product = self.matrix
            for _ in range(self.matmuls):
                product = torch.tanh(product @ self.matrix)
        return x


class Kinds(Workload):
    """A linear layer behind a piece of work of one kind per micro-batch (module docstring)."""

    def __init__(
        self, kind: str = "steady", work_ms: float = 4.0, ops: int = 400, matmuls: int = 6
    ) -> None:
        if kind not in ("steady", "overhead", "compute", "stalling"):
            raise ValueError(f"kind must be steady, overhead, compute or stalling, not {kind!r}")
        self.kind, self.work_ms, self.ops, self.matmuls = kind, work_ms, ops, matmuls

    def build_model(self) -> nn.Module:
        return nn.Sequential(
            _Work(self.kind, self.work_ms, self.ops, self.matmuls), nn.Linear(8, 1)
        )

    def make_batch(self, size: int, generator: torch.Generator):
        return torch.randn(size, 8, generator=generator), torch.randn(size, 1, generator=generator)

    def loss(self, model: nn.Module, batch) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(model(x), y)
