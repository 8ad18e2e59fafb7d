"""A user's own workload: a small MLP regressor, tuned without editing the `search` package."""

import torch
from torch import nn

from search import Workload


class MLPRegression(Workload):
    unit = "samples"

    def __init__(self, in_features: int, hidden: int, depth: int):
        self.in_features, self.hidden, self.depth = in_features, hidden, depth

    def build_model(self) -> nn.Module:
        layers, width = [], self.in_features
        for _ in range(self.depth):
            layers.append(nn.Sequential(nn.Linear(width, self.hidden), nn.GELU()))
            width = self.hidden
        return nn.Sequential(*layers, nn.Linear(width, 1))

    def make_batch(self, size: int, generator: torch.Generator):
        x = torch.randn(size, self.in_features, generator=generator)
        y = x.sum(dim=1, keepdim=True).sin()
        return x, y

    def loss(self, model: nn.Module, batch) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(model(x), y)

    def recompute_modules(self, model: nn.Module) -> list[nn.Module]:
        return list(model)[:-1]  # the hidden layers
