"""GPTs that each break one clause of the workload contract (docs/guide/own-workload.md): every
trial of their study would fail the same way, so the space is refused before anything runs
(``search.config.contract``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from search.workloads import GPT


class BatchOfNumbers(GPT):
    def make_batch(self, size: int, generator: torch.Generator):
        return [1, 2]


class BatchOneShort(GPT):
    def make_batch(self, size: int, generator: torch.Generator) -> torch.Tensor:
        return super().make_batch(size, generator)[:-1]


class BatchThatRaises(GPT):
    def make_batch(self, size: int, generator: torch.Generator) -> torch.Tensor:
        raise RuntimeError("the dataset is not there")


class LossPerToken(GPT):
    def loss(self, model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        logits = model(batch[:, :-1])
        flat = logits.flatten(0, 1)
        return F.cross_entropy(flat, batch[:, 1:].flatten(), reduction="none")


class DetachedLoss(GPT):
    def loss(self, model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        return super().loss(model, batch).detach()


class LossThatReadsAValue(GPT):
    """Keeps the contract, but its loss reads a value, which the meta device cannot give: the
    check defers to the step rather than refuse it."""

    def loss(self, model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        loss = super().loss(model, batch)
        return loss if loss.item() >= 0 else -loss


class ModelThatIsAFunction(GPT):
    def build_model(self):  # type: ignore[override]
        return lambda tokens: tokens


class ActivationByName(GPT):
    """A knob of its own that only ``build_model`` reads: the constructor stores any name, and a
    misspelt one fails only when the model is built."""

    def __init__(self, activation: str = "GELU", **settings) -> None:
        super().__init__(**settings)
        self.activation = activation

    def build_model(self) -> nn.Module:
        model = super().build_model()
        getattr(nn, self.activation)()  # AttributeError for a name torch.nn lacks
        return model


class NoModelOnTheMetaDevice(ActivationByName):
    """Builds on no device the check can use: nothing can be told from it, so the step is left to
    tell, whatever the knob."""

    def build_model(self) -> nn.Module:
        if torch.empty(0).device.type == "meta":
            raise NotImplementedError("this model reads its weights from a file")
        return super().build_model()


class ExitsInItsConstructor(GPT):
    def __init__(self, **settings) -> None:
        raise SystemExit(5)


class WidthAsText(GPT):
    """A setting of the wrong type that only ``build_model`` reads: it raises the same on the meta
    device as on any other."""

    def build_model(self) -> nn.Module:
        return nn.Linear("eight", 8)  # type: ignore[arg-type]


class NumpyInItsBuild(ActivationByName):
    """Reads its first weight as a numpy array while it builds: fine on any real device."""

    def build_model(self) -> nn.Module:
        model = super().build_model()
        next(model.parameters()).detach().numpy()  # TypeError on the meta device alone
        return model
