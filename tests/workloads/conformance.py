"""Tests every workload must pass. Subclass ``WorkloadConformance`` as ``Test...`` and define
``make_workload``.

The base class is not named ``Test*``, so pytest collects it only through its subclasses.
"""

from __future__ import annotations

import math

import torch

from search.execution.fidelity import check_fidelity
from search.execution.knobs import Knobs
from search.execution.serving import ServeStep
from search.execution.train_step import TrainStep
from search.workloads import ServingWorkload, Workload

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
        assert all(torch.equal(a, b) for a, b in zip(tensors, _tensors(again), strict=True))
        assert not all(torch.equal(a, b) for a, b in zip(tensors, _tensors(other), strict=True))

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

    def test_recompute_parts_name_one_submodule_of_each_block(self):
        workload, model, _ = self._model_and_batch()
        blocks = workload.recompute_modules(model)
        for name, parts in workload.recompute_parts(model).items():
            assert len(parts) == len(blocks), name
            for part, block in zip(parts, blocks, strict=True):
                assert any(part is m for m in block.modules() if m is not block), name

    def test_every_recompute_setting_computes_the_same_step(self):
        """Recompute repeats the same operators on the same inputs: in fp32 the loss and every
        gradient norm agree with the step that keeps everything (the fidelity check's fp32
        bounds)."""
        workload, model, _ = self._model_and_batch()
        settings = ["all", "every-2", "selective", *workload.recompute_parts(model)]
        if not workload.recompute_modules(model):
            settings = []
        for setting in settings:
            report = check_fidelity(
                workload, Knobs(batch_size=self.batch_size, recompute=setting), CPU
            )
            assert report.ok, f"recompute={setting}: {report.reason}"

    def test_a_default_train_step_changes_the_parameters(self):
        with TrainStep(self.make_workload(), Knobs(batch_size=self.batch_size), CPU) as step:
            before = [p.detach().clone() for p in step.model.parameters()]
            step()
            after = list(step.model.parameters())
        assert all(torch.isfinite(p).all() for p in after)
        assert any(not torch.equal(b, a) for b, a in zip(before, after, strict=True))


def _tensors(batch) -> list[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return [batch]
    values = batch.values() if isinstance(batch, dict) else batch
    return [t for value in values for t in _tensors(value)]


class ServingConformance:
    """Tests every serving workload must pass: subclass as ``Test...`` with ``make_workload``."""

    batch_size = 2

    def make_workload(self) -> ServingWorkload:
        raise NotImplementedError("a conformance subclass must return a small serving workload")

    def test_builds_a_module(self):
        assert isinstance(self.make_workload().build_model(), torch.nn.Module)

    def test_make_prompts_is_deterministic_for_a_seeded_generator(self):
        workload = self.make_workload()
        first = workload.make_prompts(self.batch_size, torch.Generator().manual_seed(7))
        again = workload.make_prompts(self.batch_size, torch.Generator().manual_seed(7))
        assert first.device.type == "cpu" and first.shape[0] == self.batch_size
        assert torch.equal(first, again)

    def test_forward_gives_one_row_of_logits_per_request_and_continues_from_its_state(self):
        workload = self.make_workload()
        torch.manual_seed(0)
        model = workload.build_model().eval()
        prompts = workload.make_prompts(self.batch_size, torch.Generator().manual_seed(0))
        with torch.inference_mode():
            logits, state = workload.forward(model, prompts, None)
            assert logits.dim() == 2 and logits.shape[0] == self.batch_size
            token = logits.argmax(-1)
            more, _ = workload.forward(model, token[:, None], state)
        assert more.shape == logits.shape and torch.isfinite(more).all()

    def test_generates_at_least_one_token_per_request(self):
        workload = self.make_workload()
        assert workload.generation_length() >= 1
        assert workload.items_per_sample() == workload.generation_length()

    def test_a_served_batch_matches_the_reference_in_fp32(self):
        workload = self.make_workload()
        with (
            ServeStep(workload, Knobs(batch_size=self.batch_size), CPU) as step,
            ServeStep(workload.reference(), Knobs(batch_size=self.batch_size), CPU) as ref,
        ):
            got, expected = step.generate(), ref.generate()
        assert got.tokens.shape == (self.batch_size, workload.generation_length())
        assert torch.allclose(got.logits, expected.logits, rtol=1e-4, atol=1e-5)
