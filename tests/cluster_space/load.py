"""A synthetic workload for the many-worker tests and benchmark: a step sleeps ``step_ms``
(scaled by ``variant``), so that a trial is fast, its figures steady, and the space has as many
configurations as ``variant`` has values."""

from __future__ import annotations

import time

import torch
from torch import nn

from search.workloads import Workload


class Load(Workload):
    def __init__(self, step_ms: float = 2.0, variant: int = 1):
        self.step_s, self.variant = step_ms / 1000, variant

    def build_model(self):
        return nn.Linear(4, 1)

    def make_batch(self, size, generator):
        return torch.randn(size, 4, generator=generator)

    def loss(self, model, batch):
        time.sleep(self.step_s * (1 + self.variant / 1000))
        return model(batch).square().mean()
