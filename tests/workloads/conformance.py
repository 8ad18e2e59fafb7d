"""Tests every workload must pass. Subclass ``WorkloadConformance`` as ``Test...`` and define ``make_workload``.

The base class is not named ``Test*``, so pytest collects it only through its subclasses.
"""

from __future__ import annotations

import math

import torch

from search.knobs import Knobs, TrainStep
from search.workloads import Workload

CPU = torch.device("cpu")


class WorkloadConformance:
    batch_size = 2
    """Small enough for a 2-core CPU; override for a workload that needs more samples."""

    def make_workload(self) -> Workload:
        raise NotImplementedError("a conformance subclass must return a small workload to test")

    def _model_and_batch(self):
        workload = self.make_workload()
        torch.manual_seed(0)
        model = workload.build_model()
        return (
            workload,
            model,
            workload.make_batch(self.batch_size, torch.Generator().manual_seed(0)),
        )

    def test_builds_a_module(self):
        assert isinstance(self.make_workload().build_model(), torch.nn.Module)

    def test_make_batch_is_deterministic_for_a_seeded_generator(self):
        workload = self.make_workload()
        first = workload.make_batch(self.batch_size, torch.Generator().manual_seed(7))
        again = workload.make_batch(self.batch_size, torch.Generator().manual_seed(7))
        other = workload.make_batch(self.batch_size, torch.Generator().manual_seed(8))
        tensors = _tensors(first)
        assert tensors and all(t.device.type == "cpu" for t in tensors)
        assert all(torch.equal(a, b) for a, b in zip(tensors, _tensors(again)))
        assert not all(torch.equal(a, b) for a, b in zip(tensors, _tensors(other)))

    def test_make_batch_holds_size_samples(self):
        workload = self.make_workload()
        for size in (1, 3):
            batch = workload.make_batch(size, torch.Generator().manual_seed(0))
            assert all(t.shape[0] == size for t in _tensors(batch))

    def test_loss_is_a_finite_scalar(self):
        workload, model, batch = self._model_and_batch()
        loss = workload.loss(model, batch)
        assert loss.dim() == 0 and loss.is_floating_point() and math.isfinite(loss.item())

    def test_backward_reaches_every_trainable_parameter(self):
        workload, model, batch = self._model_and_batch()
        workload.loss(model, batch).backward()
        missing = [
            name for name, p in model.named_parameters() if p.requires_grad and p.grad is None
        ]
        assert not missing, f"no gradient reached {missing}"

    def test_items_per_sample_is_at_least_one(self):
        items = self.make_workload().items_per_sample()
        assert isinstance(items, int) and items >= 1

    def test_unit_is_a_non_empty_string(self):
        unit = self.make_workload().unit
        assert isinstance(unit, str) and unit.strip()

    def test_recompute_modules_are_submodules_of_the_model(self):
        workload, model, _ = self._model_and_batch()
        submodules = [m for m in model.modules() if m is not model]
        for module in workload.recompute_modules(model):
            assert any(module is m for m in submodules)

    def test_a_default_train_step_changes_the_parameters(self):
        with TrainStep(self.make_workload(), Knobs(batch_size=self.batch_size), CPU) as step:
            before = [p.detach().clone() for p in step.model.parameters()]
            step()
            after = list(step.model.parameters())
        assert all(torch.isfinite(p).all() for p in after)
        assert any(not torch.equal(b, a) for b, a in zip(before, after))


def _tensors(batch) -> list[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return [batch]
    values = batch.values() if isinstance(batch, dict) else batch
    return [t for value in values for t in _tensors(value)]
