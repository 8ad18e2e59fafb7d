"""The workloads and requests the trial tests run: small models that fit, fail or overflow, and
the fault-injecting ``faults.Faulty`` (tests/faults.py) asked for a fault."""

from __future__ import annotations

import os
import signal

import torch
from torch import nn

from search.execution.trial import TrialRequest
from search.measurement.protocol import MeasureSettings
from search.workloads import Workload, is_counting

QUICK = MeasureSettings(
    warmup_steps=1, warmup_s=0.0, window_s=0.01, min_windows=2, max_windows=3, max_time_s=0.5
)


class Wide(Workload):
    """A single 2048x2048 linear layer: weights, grads and two AdamW states hold about 67 MB."""

    def build_model(self):
        return nn.Linear(2048, 2048)

    def make_batch(self, size, generator):
        return torch.randn(size, 2048, generator=generator)

    def loss(self, model, batch):
        return model(batch).square().mean()


class Layers(Wide):
    """256 small layers (weights, grads and AdamW state: about 68 MB in chunks of 64 kB).

    Chunks this small stay in the C allocator's heap after a trial frees them, so a process that
    is reused reads the next trial's growth far too low (seen here: 156, then 32, then 17 MB).
    """

    def build_model(self):
        return nn.Sequential(*[nn.Linear(128, 128) for _ in range(256)])

    def make_batch(self, size, generator):
        return torch.randn(size, 128, generator=generator)


class NeedsWidth(Wide):
    def __init__(self, width: int):
        self.width = width


class Overflows(Workload):
    """Activations of about 1e5: beyond fp16's largest value (65504), fine in fp32."""

    def build_model(self):
        return nn.Linear(16, 16)

    def make_batch(self, size, generator):
        return torch.randn(size, 16, generator=generator)

    def loss(self, model, batch):
        return (model(batch) * 1e5).square().mean() * 1e-10


class Raises(Wide):
    def loss(self, model, batch):
        raise RuntimeError("shape mismatch in the user's loss\nsecond line")


class OutOfMemory(Wide):
    def loss(self, model, batch):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


class MemoryWall(Workload):
    """A simulated device whose activations take ``bytes per element x samples x width``: with
    its budget, bf16 fits a micro-batch of 8 and fp32 (4 bytes, twice bf16's) only one of 4. The
    step raises CUDA's own out-of-memory error past the budget, as a real device would."""

    WIDTH, BUDGET_BYTES = 64, 8 * 64 * 2

    def build_model(self):
        return nn.Sequential(nn.Linear(self.WIDTH, self.WIDTH), nn.GELU(), nn.Linear(self.WIDTH, 1))

    def make_batch(self, size, generator):
        x = torch.randn(size, self.WIDTH, generator=generator)
        return x, torch.randn(size, 1, generator=generator)

    def loss(self, model, batch):
        x, y = batch
        autocast = torch.is_autocast_enabled(x.device.type)
        dtype = torch.get_autocast_dtype(x.device.type) if autocast else x.dtype
        needed = x.shape[0] * self.WIDTH * dtype.itemsize
        if needed > self.BUDGET_BYTES:
            raise torch.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate {needed} bytes of {self.BUDGET_BYTES}"
            )
        return nn.functional.mse_loss(model(x), y)


class Segfaults(Wide):
    def build_model(self):
        os.kill(os.getpid(), signal.SIGSEGV)


class Small(Workload):
    """Two small layers: a compile of forward and backward takes seconds."""

    def build_model(self):
        return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1))

    def make_batch(self, size, generator):
        return torch.randn(size, 8, generator=generator), torch.randn(size, 1, generator=generator)

    def loss(self, model, batch):
        x, y = batch
        return nn.functional.mse_loss(model(x), y)


class HeavyWhenCounted(Small):
    """Holds 150 MB while its work is counted, and little while it is measured."""

    def loss(self, model, batch):
        hog = torch.ones(150_000_000 // 4) if is_counting() else None  # touched: resident
        loss = super().loss(model, batch)
        del hog
        return loss


class MiscompiledSmall(Small):
    """Computes another loss when compiled: what a compiler bug looks like from outside."""

    def loss(self, model, batch):
        scale = 1.5 if torch.compiler.is_compiling() else 1.0
        return super().loss(model, batch) * scale


class BreaksEverywhere(Small):
    """Nine graph breaks in one step, one more than ``MAX_GRAPH_BREAKS``: a storm. They come before
    any operator, so the compiler has a single small graph to make."""

    def loss(self, model, batch):
        # In a row, not in a loop: a break inside a loop makes dynamo run the whole frame eagerly.
        torch._dynamo.graph_break()
        torch._dynamo.graph_break()
        torch._dynamo.graph_break()
        torch._dynamo.graph_break()
        torch._dynamo.graph_break()
        torch._dynamo.graph_break()
        torch._dynamo.graph_break()
        torch._dynamo.graph_break()
        torch._dynamo.graph_break()
        return super().loss(model, batch)


def request(workload: dict, **knobs) -> TrialRequest:
    return TrialRequest(
        workload=workload, config={"batch_size": 4, **knobs}, device="cpu", seed=0, measure=QUICK
    )


def target(cls: type) -> dict:
    return {"_target_": f"{__name__}.{cls.__name__}"}


FAULTY = {"_target_": "faults.Faulty"}  # tests/faults.py; tests/ is on sys.path under pytest


def faulty(fault: str, **kwargs) -> TrialRequest:
    return TrialRequest(
        workload=FAULTY | {k: v for k, v in kwargs.items() if k == "pid_file"},
        config={"batch_size": 4, "fault": fault},
        device="cpu",
        seed=0,
        measure=QUICK,
        timeout_s=kwargs.get("timeout_s", 60),
        memory_limit_mb=kwargs.get("memory_limit_mb"),
    )
