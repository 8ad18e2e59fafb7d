import math

import pytest
import torch
from torch import nn
from trial_workloads import Small  # tests/execution/ is on sys.path

import search.execution.train_step as train_step_module
from search.execution.fidelity import check_fidelity
from search.execution.knobs import KnobError, Knobs
from search.execution.optimizers import optimizer_unsupported, with_implementation
from search.execution.tolerances import UPDATE_TOLERANCE
from search.execution.train_step import TrainStep
from search.workloads import GPT

CPU = torch.device("cpu")
TINY = dict(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=2)
IMPLEMENTATIONS = ["for-loop", "foreach", "fused"]
FLAGS = {
    "for-loop": {"foreach": False, "fused": False},
    "foreach": {"foreach": True, "fused": False},
    "fused": {"foreach": False, "fused": True},
}
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class PlainSGD(torch.optim.Optimizer):
    """A workload's own optimizer, without torch.optim's implementation flags."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])


class OwnOptimizer(Small):
    def make_optimizer(self, params):
        return PlainSGD(params)


def two_groups(model: nn.Module) -> torch.optim.AdamW:
    """Weights and biases in groups of their own lr and weight decay, as LLM recipes build them."""
    weights = [p for p in model.parameters() if p.ndim > 1]
    biases = [p for p in model.parameters() if p.ndim == 1]
    return torch.optim.AdamW(
        [
            {"params": weights, "lr": 3e-3, "weight_decay": 0.1},
            {"params": biases, "lr": 1e-3, "weight_decay": 0.0, "betas": (0.8, 0.95)},
        ],
        lr=1e-4,
    )


def test_default_is_the_workloads_optimizer_itself():
    optimizer = two_groups(Small().build_model())
    assert with_implementation(optimizer, "default") is optimizer


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_an_implementation_keeps_every_groups_hyperparameters_and_sets_its_flags(implementation):
    built = two_groups(Small().build_model())
    rebuilt = with_implementation(built, implementation)
    assert type(rebuilt) is torch.optim.AdamW and rebuilt is not built
    assert len(rebuilt.param_groups) == 2
    for old, new in zip(built.param_groups, rebuilt.param_groups, strict=True):
        assert all(a is b for a, b in zip(old["params"], new["params"], strict=True))
        for key, value in old.items():
            if key not in ("params", "foreach", "fused"):
                assert new[key] == value, key
        assert {flag: new[flag] for flag in ("foreach", "fused")} == FLAGS[implementation]
    assert [g["lr"] for g in rebuilt.param_groups] == [3e-3, 1e-3]
    assert [g["weight_decay"] for g in rebuilt.param_groups] == [0.1, 0.0]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_every_implementation_trains_like_the_default_on_a_cpu(implementation):
    def weights_after_three_steps(optimizer: str) -> dict[str, torch.Tensor]:
        with TrainStep(GPT(**TINY), Knobs(batch_size=4, optimizer=optimizer), CPU) as step:
            for _ in range(3):
                step()
            return {n: p.detach().clone() for n, p in step.model.named_parameters()}

    def weights_after_zero_steps() -> dict[str, torch.Tensor]:
        with TrainStep(GPT(**TINY), Knobs(batch_size=4), CPU) as step:
            return {n: p.detach().clone() for n, p in step.model.named_parameters()}

    initial = weights_after_zero_steps()
    expected = weights_after_three_steps("default")
    actual = weights_after_three_steps(implementation)
    for name, weight in expected.items():
        assert not torch.equal(weight, initial[name]), name  # the steps really moved it
        torch.testing.assert_close(actual[name], weight, msg=name)  # fp32: rtol 1.3e-6


def test_an_optimizer_without_the_flags_is_refused_in_one_line():
    with pytest.raises(KnobError) as refused:
        TrainStep(OwnOptimizer(), Knobs(batch_size=4, optimizer="fused"), CPU)
    message = str(refused.value)
    assert "\n" not in message
    assert "optimizer=fused" in message and "PlainSGD" in message
    assert "leave optimizer out" in message
    with TrainStep(OwnOptimizer(), Knobs(batch_size=4), CPU) as step:  # default: as built
        step()


def test_fused_is_refused_on_a_device_torch_has_no_fused_kernels_for():
    reason = optimizer_unsupported("fused", torch.device("meta"))
    assert reason and "fused" in reason and "cpu" in reason
    assert optimizer_unsupported("fused", CPU) is None
    assert optimizer_unsupported("foreach", torch.device("meta")) is None


# -- the fidelity check's first update -----------------------------------------------------------


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_a_fused_optimizer_passes_the_fidelity_check_with_its_update_compared(precision):
    knobs = Knobs(batch_size=8, micro_batch_size=4, precision=precision, optimizer="fused")
    report = check_fidelity(GPT(**TINY), knobs, CPU, seed=1)
    assert report.ok, report.reason
    assert 0 <= report.update_norm_rel_error <= UPDATE_TOLERANCE
    assert report.errors["fidelity_update_norm_rel_error"] == report.update_norm_rel_error


def test_the_default_optimizer_takes_no_step_and_stores_no_update_error():
    report = check_fidelity(GPT(**TINY), Knobs(batch_size=8, precision="bf16"), CPU, seed=1)
    assert report.ok and math.isnan(report.update_norm_rel_error)
    assert "fidelity_update_norm_rel_error" not in report.errors


def with_lr_scaled(monkeypatch, factor: float) -> None:
    """Make every implementation but the default rebuild the optimizer with ``factor`` times the
    lr: what a wrong implementation looks like from outside."""
    real = train_step_module.with_implementation

    def wrong(optimizer, implementation):
        rebuilt = real(optimizer, implementation)
        if implementation != "default":
            for group in rebuilt.param_groups:
                group["lr"] *= factor
        return rebuilt

    monkeypatch.setattr(train_step_module, "with_implementation", wrong)


def test_an_implementation_stepping_ten_times_too_far_fails_on_its_first_update(monkeypatch):
    with_lr_scaled(monkeypatch, 10.0)
    knobs = Knobs(batch_size=8, optimizer="fused")
    report = check_fidelity(GPT(**TINY), knobs, CPU, seed=1)
    assert not report.ok
    assert report.reason.startswith("fp32 (optimizer=fused) first update of ")
    assert "differs from the workload's optimizer as built" in report.reason
    assert "\n" not in report.reason
    assert report.update_norm_rel_error == pytest.approx(9.0, rel=0.01)  # ‖10Δ - Δ‖ = 9‖Δ‖
    assert report.loss_rel_error == 0.0 and report.grad_norm_rel_error == 0.0  # the pass is right


def test_a_non_finite_update_fails(monkeypatch):
    with_lr_scaled(monkeypatch, math.nan)
    report = check_fidelity(Small(), Knobs(batch_size=8, optimizer="foreach"), CPU)
    assert not report.ok
    assert report.reason.startswith("non-finite first update of ")
    assert "optimizer=foreach" in report.reason
    assert report.update_norm_rel_error == math.inf


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("implementation", ["foreach", "fused"])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_cuda_implementations_pass_the_fidelity_check(implementation, precision):
    device = torch.device("cuda")
    if precision == "bf16" and torch.cuda.get_device_capability(device) < (8, 0):
        pytest.skip("bf16 needs compute capability 8.0")
    knobs = Knobs(batch_size=8, micro_batch_size=4, precision=precision, optimizer=implementation)
    report = check_fidelity(GPT(**TINY), knobs, device, seed=1)
    assert report.ok, report.reason
    assert report.update_norm_rel_error <= UPDATE_TOLERANCE
