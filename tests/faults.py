"""A workload that misbehaves on request, the way real ones do: the fault-injection tests run it
in real trials and real studies (``_target_: faults.Faulty``, with ``tests/`` on the path)."""

from __future__ import annotations

import multiprocessing.reduction
import os
import signal
import subprocess
import sys
import time
from typing import ClassVar

import torch
from torch import nn

from search.workloads import Workload

FAULTS = (
    "none",
    "oom",
    "segv",
    "abort",
    "exit",
    "error",
    "hang",
    "hostmem",
    "chatty",
    "cut",
    "not_finite",
    "float_loss",
)


class Faulty(Workload):
    """A small linear model; ``fault`` picks what goes wrong while the model is built (or, for
    ``not_finite``, a loss that is NaN whatever the precision; for ``float_loss``, one returned as
    a Python number).

    ``hang`` also starts a child process that would outlive its parent, and writes the worker's
    and the child's pid to ``pid_file``, so a test can check what a timeout or a kill ends.
    """

    def __init__(self, fault: str = "none", pid_file: str | None = None):
        if fault not in FAULTS:
            raise ValueError(f"fault must be one of {FAULTS}, but got {fault!r}")
        self.fault, self.pid_file = fault, pid_file

    def build_model(self):
        fault = self.fault
        if fault == "oom":
            raise torch.OutOfMemoryError(
                "CUDA out of memory. Tried to allocate 20.00 GiB (injected)"
            )
        if fault == "segv":
            os.kill(os.getpid(), signal.SIGSEGV)
        if fault == "abort":
            os.abort()
        if fault == "exit":
            print("faults: giving up with exit code 3", file=sys.stderr, flush=True)
            os._exit(3)
        if fault == "error":
            raise RuntimeError("injected: the batch has the wrong shape")
        if fault == "hang":
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
            if self.pid_file:
                with open(self.pid_file, "w") as f:
                    f.write(f"{os.getpid()} {child.pid}")
            time.sleep(3600)
        if fault == "chatty":  # 200 MB of log lines, then a failure
            line = b"x" * 1023 + b"\n"
            for _ in range(200_000):
                os.write(2, line)
            raise ValueError("injected: failed after a long log")
        if fault == "cut":  # the worker dies halfway through sending its answer
            from multiprocessing.connection import Connection

            def half(self, obj):
                data = multiprocessing.reduction.ForkingPickler.dumps(obj)
                os.write(self.fileno(), len(data).to_bytes(4, "big") + data[: len(data) // 2])
                os._exit(0)

            Connection.send = half  # in this worker only: its answer is cut in two
        if fault == "hostmem":
            hog = []
            for _ in range(400):  # up to 20 GB in 50 MB steps, touched so it is resident
                hog.append(torch.ones(12_500_000))
            raise AssertionError("the memory limit never stopped this trial")
        return nn.Linear(64, 64)

    def make_batch(self, size, generator):
        return torch.randn(size, 64, generator=generator)

    def loss(self, model, batch):
        loss = model(batch).square().mean()
        if self.fault == "float_loss" and not loss.is_meta:  # the contract check reads it on meta
            return float(loss)
        return loss * float("nan") if self.fault == "not_finite" else loss


class NeedsAMissingPackage(Faulty):
    """A workload that imports a package which is not installed: the space is refused before
    anything runs, with the line saying how to install it."""

    requires: ClassVar[dict[str, str]] = {
        "no_such_package_for_search": "pip install 'search[nothing]'"
    }
