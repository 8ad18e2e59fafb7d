"""The two-branch CNN: its branches knob changes how the step runs, never what it computes."""

from __future__ import annotations

import threading

import pytest
import torch
from conformance import WorkloadConformance

from search.execution.fidelity import check_fidelity
from search.execution.knobs import Knobs
from search.execution.train_step import TrainStep
from search.workloads import TwoBranchCNN

CPU = torch.device("cpu")
TINY = dict(image_size=8, channels=3, width=8, depth=1)


class TestTwoBranchCNN(WorkloadConformance):
    def make_workload(self):
        return TwoBranchCNN(**TINY)


class TestTwoBranchCNNParallel(WorkloadConformance):
    def make_workload(self):
        return TwoBranchCNN(**TINY, branches="parallel")


def branch_threads(branches: str) -> dict[str, int]:
    """The thread each branch's forward ran on, in one training step."""
    seen: dict[str, int] = {}
    workload = TwoBranchCNN(**TINY, branches=branches)
    with TrainStep(workload, Knobs(batch_size=4), CPU) as step:
        for name in ("local", "context"):
            getattr(step.model, name).register_forward_hook(
                lambda *_, name=name: seen.__setitem__(name, threading.get_ident())
            )
        step()
    return seen


def test_parallel_branches_run_on_threads_of_their_own_and_serial_ones_on_one():
    serial = branch_threads("serial")
    assert serial["local"] == serial["context"]  # the step's lane thread
    parallel = branch_threads("parallel")
    assert parallel["local"] != parallel["context"]


def loss_and_grads(branches: str, **knobs) -> tuple[float, dict[str, torch.Tensor]]:
    workload = TwoBranchCNN(**TINY, branches=branches)
    with TrainStep(workload, Knobs(batch_size=4, **knobs), CPU, seed=3) as step:
        return step.loss_and_grads()


@pytest.mark.parametrize(
    "knobs", [{}, {"recompute": True}, {"micro_batch_size": 2, "streams": 2}], ids=str
)
def test_parallel_branches_compute_the_serial_step(knobs):
    serial_loss, serial_grads = loss_and_grads("serial", **knobs)
    parallel_loss, parallel_grads = loss_and_grads("parallel", **knobs)
    assert parallel_loss == pytest.approx(serial_loss, rel=1e-6)
    for name, grad in serial_grads.items():
        assert torch.allclose(parallel_grads[name], grad, rtol=1e-4, atol=1e-6), name


@pytest.mark.parametrize(
    "knobs",
    [
        Knobs(batch_size=4, precision="bf16"),
        Knobs(batch_size=4, micro_batch_size=2, streams=2, recompute=True),
        Knobs(batch_size=4, micro_batch_size=2, precision="bf16", streams=2),
    ],
    ids=["bf16", "fp32-lanes-recompute", "bf16-lanes"],
)
@pytest.mark.parametrize("branches", ["serial", "parallel"])
def test_every_setting_passes_fidelity(knobs, branches):
    report = check_fidelity(TwoBranchCNN(**TINY, branches=branches), knobs, CPU, seed=0)
    assert report.ok, report.reason


def test_bad_settings_are_refused_with_what_to_fix():
    with pytest.raises(ValueError, match="branches"):
        TwoBranchCNN(**TINY, branches="both")
    with pytest.raises(ValueError, match="width"):
        TwoBranchCNN(**{**TINY, "width": 0})
