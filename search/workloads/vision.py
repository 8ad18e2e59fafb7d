"""A two-branch CNN: two independent branches from one stem, joined before the head.

The ``branches`` knob runs them one after the other (``serial``) or at the same time
(``parallel``): the second branch on a CUDA stream of its own on a GPU, or on a thread of its own
on a CPU, while the first runs where the step runs. Whether that pays depends on how busy one
branch keeps the device; the synchronisation and the second thread's contention for the cores
can eat the gain.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from search.workloads.base import Workload, is_counting, require_positive_ints

__all__ = ["BRANCHES", "TwoBranchCNN"]

BRANCHES = ("serial", "parallel")


def _conv(c_in: int, c_out: int, kernel: int, dilation: int = 1) -> nn.Sequential:
    pad = dilation * (kernel - 1) // 2
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, kernel, padding=pad, dilation=dilation, bias=False),
        nn.BatchNorm2d(c_out),
        nn.ReLU(),
    )


class _TwoBranchNet(nn.Module):
    """Stem, then a local branch (3x3 convolutions) and a context branch (dilated 3x3, a wider
    view) on the same features, concatenated, mixed by a 1x1 convolution, pooled, classified."""

    def __init__(
        self, channels: int, width: int, depth: int, n_classes: int, parallel: bool
    ) -> None:
        super().__init__()
        self.parallel = parallel
        self.stem = _conv(channels, width, 3)
        self.local = nn.Sequential(*(_conv(width, width, 3) for _ in range(depth)))
        self.context = nn.Sequential(*(_conv(width, width, 3, dilation=2) for _ in range(depth)))
        self.join = _conv(2 * width, width, 1)
        self.head = nn.Linear(width, n_classes)
        # threads start on first use; one per lane that may call at once
        self._pool = ThreadPoolExecutor(4, thread_name_prefix="branch")
        self._side: dict[int, torch.cuda.Stream] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        local, context = self._branches(x) if self.parallel else (self.local(x), self.context(x))
        x = self.join(torch.cat([local, context], dim=1))
        return self.head(F.adaptive_avg_pool2d(x, 1).flatten(1))

    def _branches(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if x.device.type == "cuda":
            return self._on_streams(x)
        # Grad mode and autocast are thread-local: each branch's thread takes the caller's.
        grad, autocast = torch.is_grad_enabled(), torch.is_autocast_enabled("cpu")
        dtype = torch.get_autocast_dtype("cpu")

        def run(branch: nn.Module) -> torch.Tensor:
            with (
                torch.set_grad_enabled(grad),
                torch.autocast("cpu", dtype=dtype, enabled=autocast, cache_enabled=False),
            ):
                return branch(x)

        if is_counting():  # torch counts per thread: one thread while the work is counted
            return self.local(x), self.context(x)
        context = self._pool.submit(run, self.context)
        return self.local(x), context.result()

    def _on_streams(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The context branch on a side stream of the caller's stream (a lane's own, or the
        default), joined back before the result is used. Backward runs each op on its forward's
        stream, so the branches overlap there too."""
        main = torch.cuda.current_stream(x.device)
        if main.stream_id not in self._side:  # once per calling stream, outside later steps
            self._side[main.stream_id] = torch.cuda.Stream(x.device)
        side = self._side[main.stream_id]
        side.wait_stream(main)
        with torch.cuda.stream(side):
            context = self.context(x)
        local = self.local(x)
        main.wait_stream(side)
        x.record_stream(side)  # x is read on the side stream: keep it until that is done
        context.record_stream(main)  # made on the side stream, used on this one
        return local, context


class TwoBranchCNN(Workload):
    """Image classification on random images and labels; throughput is counted in images."""

    unit = "images"

    def __init__(
        self,
        image_size: int,
        channels: int,
        width: int,
        depth: int,
        n_classes: int = 10,
        branches: str = "serial",
    ):
        require_positive_ints(
            image_size=image_size, channels=channels, width=width, depth=depth, n_classes=n_classes
        )
        if branches not in BRANCHES:
            raise ValueError(f"`branches` must be one of {BRANCHES}, but got {branches!r}.")
        self.image_size, self.channels, self.width = image_size, channels, width
        self.depth, self.n_classes, self.branches = depth, n_classes, branches

    def build_model(self) -> nn.Module:
        return _TwoBranchNet(
            self.channels, self.width, self.depth, self.n_classes, self.branches == "parallel"
        )

    def make_batch(
        self, size: int, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        images = torch.randn(
            size, self.channels, self.image_size, self.image_size, generator=generator
        )
        return images, torch.randint(self.n_classes, (size,), generator=generator)

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        images, labels = batch
        return F.cross_entropy(model(images), labels)

    def recompute_modules(self, model: nn.Module) -> list[nn.Module]:
        net = cast(_TwoBranchNet, model)
        return [net.local, net.context]
