import math
import threading

import pytest
import torch
from torch import nn
from trial_workloads import MemoryWall

from search.execution.fidelity import (
    TOLERANCES,
    FidelityReport,
    _one_pass,
    _reference_generation,
    check_fidelity,
    reference_knobs,
)
from search.execution.knobs import PRECISIONS, KnobError, Knobs
from search.execution.pieces import TrainingPieces, piece_sizes
from search.execution.tolerances import UPDATE_TOLERANCE
from search.execution.train_step import TrainStep
from search.workloads import GPT, GPTServe, Workload

CPU = torch.device("cpu")
TINY = dict(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=2)
SERVE_TINY = dict(vocab_size=97, prompt_len=12, gen_len=5, d_model=32, n_layers=2, n_heads=4)
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class Regression(Workload):
    """A small regression whose batch is a dict of two draws: micro-batches draw it in another
    order."""

    def build_model(self):
        return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1))

    def make_batch(self, size, generator):
        x = torch.randn(size, 8, generator=generator)
        return {"x": x, "y": torch.randn(size, 1, generator=generator)}

    def loss(self, model, batch):
        return nn.functional.mse_loss(model(batch["x"]), batch["y"])


class Amplified(Regression):
    """One layer scales its activations by 1e5: beyond fp16's largest value (65504), fine in
    bf16/fp32."""

    def loss(self, model, batch):
        hidden = model[0](batch["x"]) * 1e5
        return nn.functional.mse_loss(model[2](model[1](hidden)) * 1e-5, batch["y"])


class OffsetFeatures(Workload):
    """Raw features around 1000 (unnormalised units) whose signal is the small part; BatchNorm
    centres them.

    bf16 keeps 8 significant bits, so at 1000 its numbers are 4 apart: the signal rounds away before
    the first Linear, and BatchNorm scales what is left (rounding noise) up to unit size.
    """

    def build_model(self):
        return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))

    def make_batch(self, size, generator):
        signal = torch.randn(size, 8, generator=generator)
        return 1000.0 + signal, signal.sum(1, keepdim=True)

    def loss(self, model, batch):
        features, target = batch
        return nn.functional.mse_loss(model(features), target)


class ConvBiasBeforeBatchNorm(Workload):
    """An ordinary small CNN whose convolutions have a bias right before BatchNorm, which subtracts
    it again: those biases' gradients are zero in exact arithmetic (about 1e-7 in fp32, rounding
    noise of about 1e-5 in bf16)."""

    def build_model(self):
        return nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.Conv2d(16, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(16, 10),
        )

    def make_batch(self, size, generator):
        images = torch.randn(size, 3, 16, 16, generator=generator)
        return images, torch.randint(0, 10, (size,), generator=generator)

    def loss(self, model, batch):
        images, labels = batch
        return nn.functional.cross_entropy(model(images), labels)


class LargeGradients(Workload):
    """Inputs around 1000: the weight gradient (~1000) times GradScaler's first scale 2**16
    overflows fp16.

    Integer inputs and weights of 1/8 are exact in fp16, so nothing but the scaled gradients can go
    wrong.
    """

    def build_model(self):
        model = nn.Linear(8, 1)
        nn.init.constant_(model.weight, 0.125)
        return model

    def make_batch(self, size, generator):
        return 1000.0 + torch.randint(-8, 9, (size, 8), generator=generator).float()

    def loss(self, model, batch):
        return model(batch).mean()  # d loss / d weight is the mean input, ~1000


class NotFinite(Regression):
    def loss(self, model, batch):
        # squares overflow fp32 too
        return nn.functional.mse_loss(model(batch["x"]) * 1e30, batch["y"])


class CountingGPT(GPT):
    """The tiny GPT, counting how many models (so how many passes) a check builds."""

    def __init__(self):
        super().__init__(**TINY)
        self.models_built = 0

    def build_model(self):
        self.models_built += 1
        return super().build_model()


def test_every_precision_has_a_tolerance_tighter_the_more_bits_it_keeps():
    assert set(TOLERANCES) == set(PRECISIONS)
    for name in ("loss_rel", "grad_norm_rel"):
        fp32, tf32, bf16, fp16 = (
            getattr(TOLERANCES[p], name) for p in ("fp32", "tf32", "bf16", "fp16")
        )
        assert 0 < fp32 < tf32 == fp16 < bf16 < 0.05


def test_fp8_tolerances_sit_above_bf16s_and_below_meaningless():
    # bf16 rounds every operation, fp8 only the operands of large matmuls, but with 3 mantissa
    # bits (2 for tensorwise's gradients): looser than bf16, yet far below 50%, which means nothing
    bf16, tensorwise, rowwise = (TOLERANCES[p] for p in ("bf16", "fp8-tensorwise", "fp8-rowwise"))
    for fp8 in (tensorwise, rowwise):
        assert bf16.loss_rel < fp8.loss_rel <= 0.02
        assert bf16.grad_norm_rel < fp8.grad_norm_rel <= 0.125
    assert rowwise.grad_norm_rel < tensorwise.grad_norm_rel


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize(
    "split",
    [dict(), dict(micro_batch_size=2, streams=2, recompute=True)],
    ids=["plain", "micro-lanes-recompute"],
)
def test_the_tiny_gpt_passes_under_every_cpu_precision(precision, split):
    knobs = Knobs(batch_size=8, precision=precision, **split)
    report = check_fidelity(GPT(**TINY), knobs, CPU, seed=1)
    tolerance = TOLERANCES[precision]
    assert report.ok and report.reason == ""
    assert report.loss_rel_error <= tolerance.loss_rel
    assert report.grad_norm_rel_error <= tolerance.grad_norm_rel
    assert math.isclose(report.loss, math.log(64), rel_tol=0.05)  # near ln(vocab) at initialisation
    if precision != "fp32":  # it really ran in the lower precision: the gradients moved
        assert report.grad_norm_rel_error > TOLERANCES["fp32"].grad_norm_rel


def test_a_check_costs_two_passes_and_the_reference_configuration_one():
    workload, knobs = (
        CountingGPT(),
        Knobs(batch_size=8, micro_batch_size=4, precision="bf16", streams=2),
    )
    check_fidelity(workload, knobs, CPU, seed=3)
    assert workload.models_built == 2  # the configuration's pass and the reference's
    plain = Knobs(batch_size=8, micro_batch_size=4)
    assert check_fidelity(workload, plain, CPU, seed=3).ok
    assert workload.models_built == 3  # the plain fp32 configuration is the reference


def test_the_reference_runs_the_configurations_batch_split_and_seed():
    workload = Regression()  # its micro-batches hold other samples than its whole batch

    def reference_loss(
        batch_size: int, micro_batch_size: int | None, seed: int, precision: str = "fp32"
    ) -> float:
        knobs = Knobs(batch_size=batch_size, micro_batch_size=micro_batch_size, precision=precision)
        return check_fidelity(workload, knobs, CPU, seed=seed).reference_loss

    splits = [(8, None, 0), (8, 2, 0), (4, None, 0), (8, None, 1)]
    for split in splits:  # the plain fp32 configuration of that split is the reference itself
        assert reference_loss(*split, precision="bf16") == reference_loss(*split)
    assert len({reference_loss(*split) for split in splits}) == len(splits)


def test_micro_batches_are_compared_on_the_same_samples_whatever_make_batch_draws():
    # Two micro-batches of this workload hold other samples than one whole-batch draw.
    report = check_fidelity(
        Regression(), Knobs(batch_size=8, micro_batch_size=2, precision="bf16"), CPU
    )
    assert report.ok, report.reason


def test_fp16_overflowing_activations_fail_with_a_clear_reason():
    workload = Amplified()
    fp16 = check_fidelity(workload, Knobs(batch_size=8, micro_batch_size=4, precision="fp16"), CPU)
    assert not fp16.ok
    assert fp16.reason.startswith("non-finite loss under fp16: ")
    assert not math.isfinite(fp16.loss) and math.isfinite(fp16.reference_loss)
    assert fp16.loss_rel_error == math.inf
    assert check_fidelity(workload, Knobs(batch_size=8, precision="bf16"), CPU).ok  # fp32's range
    assert check_fidelity(workload, Knobs(batch_size=8, micro_batch_size=4, streams=2), CPU).ok


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bf16_rounding_away_the_signal_fails_on_the_loss(seed):
    workload = OffsetFeatures()
    assert check_fidelity(
        workload, Knobs(batch_size=16, micro_batch_size=4, streams=2), CPU, seed
    ).ok
    report = check_fidelity(
        workload, Knobs(batch_size=16, micro_batch_size=4, precision="bf16"), CPU, seed
    )
    assert not report.ok
    assert (
        report.reason.startswith("bf16 loss ")
        and "differs from the fp32 reference" in report.reason
    )
    assert f"(tolerance {TOLERANCES['bf16'].loss_rel * 100:.3g}%)" in report.reason
    assert report.loss_rel_error > TOLERANCES["bf16"].loss_rel
    assert report.grad_norm_rel_error > TOLERANCES["bf16"].grad_norm_rel


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("split", [{}, {"micro_batch_size": 4, "streams": 2}])
def test_a_gradient_that_is_zero_in_exact_arithmetic_does_not_fail_a_cnn(seed, precision, split):
    # Judged against itself, the conv bias's rounding noise is off by 1e4 percent (the report
    # said: "bf16 gradient norm of 3.bias 6.295e-05 differs from the fp32 reference 1.388e-07 by
    # 4.53e+04%"); against the model's gradients it is well within tolerance.
    knobs = Knobs(batch_size=16, precision=precision, **split)
    report = check_fidelity(ConvBiasBeforeBatchNorm(), knobs, CPU, seed)
    assert report.ok, report.reason
    assert report.grad_norm_rel_error > 0, "the reduced precision changed nothing: not checked"


def test_the_gradient_floor_still_judges_every_tensor_that_is_not_tiny():
    from search.execution.fidelity import _compare

    knobs = Knobs(batch_size=4, precision="bf16")
    reference = {"big": 1.0, "small": 0.2, "zero": 1e-7}
    wrong_small = _compare(knobs, 1.0, {**reference, "small": 0.3}, 1.0, reference)
    assert not wrong_small.ok and "small" in wrong_small.reason, "50% off on a real gradient"
    noise_on_zero = _compare(knobs, 1.0, {**reference, "zero": 3e-5}, 1.0, reference)
    assert noise_on_zero.ok, noise_on_zero.reason
    large_on_zero = _compare(knobs, 1.0, {**reference, "zero": 0.05}, 1.0, reference)
    assert not large_on_zero.ok, "a gradient that should vanish and is a twentieth of the model's"


def test_gradients_that_overflow_only_at_the_first_loss_scale_pass_as_in_training():
    workload, knobs = LargeGradients(), Knobs(batch_size=8, precision="fp16")
    with TrainStep(workload, knobs, CPU) as step:
        _, grads = step.loss_and_grads()
    assert not all(torch.isfinite(grad).all() for grad in grads.values())  # at the scale 2**16
    report = check_fidelity(workload, knobs, CPU)
    assert report.ok, report.reason
    assert 0 < report.grad_norm_rel_error <= TOLERANCES["fp16"].grad_norm_rel


def test_a_workload_not_finite_in_fp32_fails_every_configuration():
    for knobs in (Knobs(batch_size=4), Knobs(batch_size=4, precision="bf16")):
        report = check_fidelity(NotFinite(), knobs, CPU)
        assert not report.ok and "fp32 reference" in report.reason and "not finite" in report.reason


def test_dropout_draws_the_same_masks_in_both_passes():
    workload = GPT(**TINY, dropout=0.1)
    for knobs in (
        Knobs(batch_size=8, micro_batch_size=4, recompute=True),
        Knobs(batch_size=8, micro_batch_size=4, precision="bf16"),
    ):
        report = check_fidelity(workload, knobs, CPU, seed=2)
        assert report.ok, report.reason
    assert report.grad_norm_rel_error < TOLERANCES["bf16"].grad_norm_rel / 4  # not merely inside it


def test_the_global_torch_state_is_left_as_found():
    previous_precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")
    try:
        rng_state, threads = torch.get_rng_state(), threading.active_count()
        check_fidelity(
            GPT(**TINY, dropout=0.1),
            Knobs(batch_size=8, micro_batch_size=2, precision="bf16", streams=2, recompute=True),
            CPU,
            seed=5,
        )
        check_fidelity(Amplified(), Knobs(batch_size=4, precision="fp16"), CPU)
        assert torch.get_float32_matmul_precision() == "medium"
        assert torch.equal(torch.get_rng_state(), rng_state)
        assert not torch.is_autocast_enabled("cpu") and torch.is_grad_enabled()
        assert threading.active_count() == threads
    finally:
        torch.set_float32_matmul_precision(previous_precision)


def test_a_precision_the_device_cannot_run_raises_like_train_step_before_any_pass():
    workload = CountingGPT()
    with pytest.raises(KnobError, match="tf32"):
        check_fidelity(workload, Knobs(batch_size=4, precision="tf32"), CPU)
    assert workload.models_built == 0


def test_the_report_holds_plain_values():
    report = check_fidelity(GPT(**TINY), Knobs(batch_size=4, precision="bf16"), CPU)
    assert isinstance(report, FidelityReport)
    assert all(
        type(getattr(report, name)) is float
        for name in ("loss", "reference_loss", "loss_rel_error", "grad_norm_rel_error")
    )


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("precision", ["tf32", "bf16", "fp16"])
def test_cuda_precisions_pass_on_the_tiny_gpt(precision):
    device = torch.device("cuda")
    if precision in ("tf32", "bf16") and torch.cuda.get_device_capability(device) < (8, 0):
        pytest.skip(f"{precision} needs compute capability 8.0")
    knobs = Knobs(batch_size=8, micro_batch_size=2, precision=precision, streams=2, recompute=True)
    report = check_fidelity(GPT(**TINY), knobs, device, seed=1)
    assert report.ok, report.reason
    if (
        precision != "tf32"
    ):  # cuBLAS may run tiny fp32 matmuls without tensor cores, so no tf32 rounding
        assert report.grad_norm_rel_error > TOLERANCES["fp32"].grad_norm_rel


@pytest.mark.gpu
@cuda
def test_cuda_fp16_overflow_fails():
    report = check_fidelity(
        Amplified(), Knobs(batch_size=8, precision="fp16"), torch.device("cuda")
    )
    assert not report.ok and report.reason.startswith("non-finite loss under fp16")


# -- the reference in pieces (a memory wall that fp32 meets first) ------------------------------


def test_piece_sizes_divide_the_micro_batch_largest_first():
    assert list(piece_sizes(8)) == [8, 4, 2, 1]
    assert list(piece_sizes(12)) == [12, 6, 3, 1]
    assert list(piece_sizes(1)) == [1]


@pytest.mark.parametrize("piece", [2, 1])
def test_the_reference_in_pieces_computes_the_same_step_on_the_same_samples(piece):
    workload, knobs = Regression(), Knobs(batch_size=8, micro_batch_size=4, precision="bf16")
    whole = _one_pass(workload, reference_knobs(knobs), CPU, 0)
    pieces = _one_pass(
        TrainingPieces(workload, knobs, 0, piece), reference_knobs(knobs, piece), CPU, 0
    )
    assert pieces[0] == pytest.approx(whole[0], rel=1e-6)
    assert pieces[1].keys() == whole[1].keys()
    for name, norm in whole[1].items():
        assert pieces[1][name] == pytest.approx(norm, rel=1e-5), name
    other_seed = _one_pass(
        TrainingPieces(workload, knobs, 1, piece), reference_knobs(knobs, piece), CPU, 0
    )
    assert other_seed[0] != pytest.approx(whole[0], rel=1e-3)  # the pieces are that seed's samples


def test_bf16_at_its_wall_is_checked_against_an_fp32_reference_run_in_pieces():
    knobs = Knobs(batch_size=16, micro_batch_size=8, precision="bf16")
    report = check_fidelity(MemoryWall(), knobs, CPU)
    assert report.ok, report.reason
    # the same reference as on a device where fp32 fits the whole micro-batch
    roomy = type("Roomy", (MemoryWall,), {"BUDGET_BYTES": 10**9})()
    assert report.reference_loss == pytest.approx(
        check_fidelity(roomy, knobs, CPU).reference_loss, rel=1e-6
    )


def test_a_reference_that_fits_not_even_one_sample_leaves_the_configuration_unchecked_not_oom():
    tight = type("Tight", (MemoryWall,), {"BUDGET_BYTES": MemoryWall.WIDTH * 2})()
    report = check_fidelity(tight, Knobs(batch_size=4, micro_batch_size=1, precision="bf16"), CPU)
    assert not report.ok
    assert "ran out of memory on cpu even one sample per pass" in report.reason
    assert "cannot be checked" in report.reason


def test_the_serving_reference_in_pieces_generates_the_same_tokens():
    workload = GPTServe(**SERVE_TINY, kv_cache=True)
    knobs = Knobs(batch_size=4, micro_batch_size=4, precision="bf16")
    whole = _reference_generation(workload, knobs, CPU, 1, 4)
    for piece in (2, 1):
        pieces = _reference_generation(workload, knobs, CPU, 1, piece)
        assert torch.equal(pieces.tokens, whole.tokens)
        torch.testing.assert_close(pieces.logits, whole.logits, rtol=1e-5, atol=1e-5)


class OutOfMemoryOnTheChecksOwnBuild(Regression):
    """Fits when first built (the measurement), runs out when the check builds it again beside
    what the process still holds."""

    def __init__(self):
        self.builds = 0

    def build_model(self):
        self.builds += 1
        if self.builds == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return super().build_model()


def test_the_configurations_own_pass_running_out_is_the_checks_not_the_configurations():
    workload = OutOfMemoryOnTheChecksOwnBuild()  # the check's first build is its own pass
    report = check_fidelity(workload, Knobs(batch_size=4, precision="bf16"), CPU)
    assert not report.ok
    assert "the configuration's own pass of the check ran out of memory on cpu" in report.reason
    assert "cannot be checked here" in report.reason


# -- the optimizer knob: the first update (tests/execution/test_optimizers.py has the rest) -------


def test_a_check_under_another_optimizer_still_builds_two_models():
    workload = CountingGPT()
    report = check_fidelity(workload, Knobs(batch_size=8, optimizer="fused"), CPU, seed=3)
    assert report.ok, report.reason
    assert workload.models_built == 2  # the step it compares with runs on host copies
    assert report.update_norm_rel_error <= UPDATE_TOLERANCE


def test_a_fused_optimizer_at_the_wall_is_checked_against_a_reference_in_pieces():
    knobs = Knobs(batch_size=16, micro_batch_size=8, precision="bf16", optimizer="fused")
    report = check_fidelity(MemoryWall(), knobs, CPU)
    assert report.ok, report.reason
    assert 0 <= report.update_norm_rel_error <= UPDATE_TOLERANCE
