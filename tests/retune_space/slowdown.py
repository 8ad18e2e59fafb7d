"""A synthetic workload for the re-tune tests and benchmark: its step time is set by its settings.

Each micro-batch's loss does ``base`` units of work times ``factor`` (half that when the step's
precision is the ``fast`` one), so ``factor`` makes a model slower and ``fast`` moves the optimum.
``work: wait`` waits ``base`` ms per unit on the wall clock, spinning: for tests, since its time is
the clock's, whatever the machine's speed or load (a preempted spin ends at the same instant).
``work: sleep`` sleeps instead: its wake-ups wait for a core, so its speed follows the host's load,
which an unchanged model once read as a 16% regression 30 s after its baseline.
``work: matmul`` multiplies 128x128 matrices ``base`` times: real compute, with the machine's own
noise, for the benchmark.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from search.workloads import Workload


class Slowdown(Workload):
    def __init__(
        self, factor: float = 1.0, fast: str = "fp32", work: str = "wait", base: float = 4.0
    ):
        if work not in ("wait", "sleep", "matmul"):
            raise ValueError(f"work must be wait, sleep or matmul, but got {work!r}")
        self.factor, self.fast, self.work, self.base = factor, fast, work, base

    def build_model(self):
        return nn.Linear(8, 1)

    def make_batch(self, size, generator):
        return torch.randn(size, 8, generator=generator)

    def loss(self, model, batch):
        bf16 = (
            torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
        )
        units = self.base * self.factor * (0.5 if ("bf16" if bf16 else "fp32") == self.fast else 1)
        if self.work == "wait":
            until = time.perf_counter() + units / 1000
            while time.perf_counter() < until:
                pass
        elif self.work == "sleep":
            time.sleep(units / 1000)
        else:
            with torch.no_grad(), torch.autocast("cpu", enabled=False):
                a = torch.full((128, 128), 0.01)
                for _ in range(round(units)):
                    a = torch.tanh(a @ a)
        # The model itself in fp32 whatever the precision: the step's time is the work above, not
        # the CPU's bf16 kernels, which under a busy core once ran a fresh process 4x slower than
        # another (re-validation: 252 and 1,090 samples/s), so the re-tune test's optimum was
        # called unstable, rightly, and its verdict was not the one under test.
        with torch.autocast("cpu", enabled=False):
            return model(batch).square().mean()
