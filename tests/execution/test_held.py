"""What a built step holds in tensors, for the memory probe."""

from __future__ import annotations

import torch
from torch import nn

from search.execution.held import module_tensors, storage_bytes, tensors_in
from search.execution.knobs import Knobs
from search.execution.train_step import TrainStep
from tests.execution.trial_workloads import Small

CPU = torch.device("cpu")


def test_tied_weights_and_views_count_once_and_other_devices_not_at_all():
    weight = torch.zeros(1000)  # 4,000 bytes
    tensors = [weight, weight[:10], weight.view(10, 100), torch.zeros(10, device="meta")]
    assert storage_bytes(tensors, CPU) == 4000
    assert storage_bytes(tensors, torch.device("cuda")) == 0


def test_tensors_are_found_at_any_depth_of_a_batch():
    batch = {"x": (torch.zeros(2), [torch.zeros(3)]), "n": 4}
    assert [t.numel() for t in tensors_in(batch)] == [2, 3]


def test_a_module_s_gradients_count_once_they_exist():
    model = nn.Linear(10, 10)
    before = storage_bytes(module_tensors(model), CPU)
    model(torch.ones(1, 10)).sum().backward()
    assert storage_bytes(module_tensors(model), CPU) == 2 * before


def test_a_step_holds_its_optimizer_s_state_after_a_step():
    knobs = Knobs(batch_size=4, micro_batch_size=2)
    with TrainStep(Small(), knobs, CPU) as step:
        before = storage_bytes(step.held_tensors(), CPU)
        step()
        after = storage_bytes(step.held_tensors(), CPU)
    # gradients and AdamW's two moments per parameter, at least
    assert after >= before + 3 * storage_bytes(step.model.parameters(), CPU)
