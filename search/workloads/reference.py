"""The reference step: a fixed small training step that does not depend on any space's model.

Measured right before each confirmation run of a recommendation (``search.retuning.confirm``), it
reads the machine's speed at that moment, so that a slower machine is not blamed on the model. It
is the built-in GPT at a tiny fixed shape, plus a fixed product of two square matrices per
micro-batch: the GPT step alone is serial enough that a machine losing one of its cores to another
tenant barely shows in it, while a model that uses every core slows down; the product uses them all.
"""

from __future__ import annotations

import torch
from torch import nn

from search.workloads.gpt import GPT

__all__ = ["MATMUL", "ReferenceStep"]

MATMUL = {"cpu": (256, 12), "cuda": (4096, 2)}
"""Side of the fixed square matrices and products per micro-batch, by device type. On the 2-core
CPU the products take a little less time than the GPT step itself (the reference step read 10-14k
tokens/s with them, 15-28k without, runs minutes apart); the CUDA size aims at the same share and
has not been measured on a GPU yet."""


class ReferenceStep(GPT):
    def __init__(self, matmul_size: int = 256, matmul_repeats: int = 12, **gpt: int):
        super().__init__(**gpt)
        self.matmul_size, self.matmul_repeats = matmul_size, matmul_repeats
        self._matrix: torch.Tensor | None = None

    def loss(self, model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        device = next(model.parameters()).device
        if self._matrix is None or self._matrix.device != device:
            generator = torch.Generator().manual_seed(0)
            self._matrix = (
                torch.rand(self.matmul_size, self.matmul_size, generator=generator)
                / self.matmul_size
            ).to(device)
        with torch.no_grad(), torch.autocast(device.type, enabled=False):
            x = self._matrix
            for _ in range(self.matmul_repeats):
                x = x @ self._matrix
        return super().loss(model, batch) + 0.0 * x[0, 0]
