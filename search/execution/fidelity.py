"""Fidelity: a configuration that changes numerics must still compute the same step.

Lower precision, concurrent lanes, recompute, compilation and caches change *how* a step is
computed, not *what* it computes, unless the numerics break (fp16 overflow, bf16 cancellation, a
cache read at the wrong position, a compiler that fuses wrongly). For a training step
``check_fidelity`` runs one accumulation pass of a configuration and one of the fp32 reference on
the same micro-batches and the same initial weights, and compares the loss and every parameter's
gradient norm within the tolerance of the configuration's precision. Under another ``optimizer``
implementation than the reference's (the only place that knob shows) the configuration's pass also
takes one optimizer step and compares it with the step the workload's optimizer as built takes
from the same weights and gradients (``search.execution.optimizers``). Where fp32 runs out of
memory on a micro-batch that the configuration's precision fits, the reference runs the same
samples in smaller pieces (``search.execution.pieces``): its OOM is never the configuration's.
For serving it generates the batch with the workload's reference (``ServingWorkload.reference``,
e.g. without a cache) in fp32, then runs the configuration on the same prompts decoding the
reference's tokens (teacher forcing), and compares the logits of every generated position.
Non-finite values always fail.
"""

from __future__ import annotations

import dataclasses
import gc
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

import torch

from search.execution.faults import is_out_of_memory
from search.execution.knobs import Knobs
from search.execution.optimizers import FirstUpdate, first_update, judge_first_update
from search.execution.pieces import ServingPieces, TrainingPieces, piece_sizes
from search.execution.random_draws import random_layers_off, seeded_rng
from search.execution.recompute import RECOMPUTE_NONE
from search.execution.serving import Generated, ServeStep
from search.execution.tolerances import (
    GRADIENT_FLOOR,
    SERVING_TOLERANCES,
    TOLERANCES,
    Tolerance,
    gradient_floor,
    percent,
    rel_error,
)
from search.execution.train_step import TrainStep
from search.workloads.base import ServingWorkload, Workload

__all__ = [
    "NOT_FINITE_IN_FP32",
    "FidelityReport",
    "GRADIENT_FLOOR",
    "SERVING_TOLERANCES",
    "ServingFidelityReport",
    "TOLERANCES",
    "Tolerance",
    "changes_numerics",
    "check_fidelity",
    "check_serving_fidelity",
    "reference_knobs",
]


NOT_FINITE_IN_FP32 = "the workload is not finite even in fp32"
"""Ends a fidelity failure of the fp32 reference itself: a fault of the workload, which no
configuration can mend (``search.study.outcome.workload_fault``)."""


@dataclass(kw_only=True, frozen=True)
class FidelityReport:
    """How one configuration's pass compares with the fp32 reference.

    Relative errors are ``|value - reference| / |reference|`` (0 when both are 0) and ``inf`` when a
    value is not finite.
    """

    ok: bool
    """True when every value is finite and within ``TOLERANCES[precision]``."""
    reason: str
    """One line saying what failed; empty when ``ok``."""
    loss: float
    """The configuration's mean loss on the batch (workload's loss units)."""
    reference_loss: float
    """The fp32 reference's mean loss on the same batch and initial weights."""
    loss_rel_error: float
    """Relative error of ``loss``."""
    grad_norm_rel_error: float
    """Largest relative error of a gradient's L2 norm, over every parameter tensor."""
    update_norm_rel_error: float = math.nan
    """Largest normwise relative error of the first optimizer update ``Δw = w_after - w_before``
    over every parameter tensor: ``‖Δw - Δw_ref‖ / max(‖Δw_ref‖, floor)`` beyond what rounding
    the stored weights allows, where ``Δw_ref`` is the step the workload's optimizer as built
    takes from the same weights and gradients (``search.execution.optimizers.first_update``); NaN
    where no update was compared (the configuration's ``optimizer`` is the reference's)."""
    random_layers_off: int = 0
    """How many random layers (dropout, drop-path) both passes ran with switched off
    (``search.execution.random_draws``): the check compares the function without its draws."""

    @property
    def errors(self) -> dict[str, float]:
        """The errors a trial stores, by metric name; the update's only where it was compared (a
        NaN in every other trial would read as a failed measurement); the random layers switched
        off only where there were any."""
        errors = {
            "fidelity_loss_rel_error": self.loss_rel_error,
            "fidelity_grad_norm_rel_error": self.grad_norm_rel_error,
        }
        if not math.isnan(self.update_norm_rel_error):
            errors["fidelity_update_norm_rel_error"] = self.update_norm_rel_error
        if self.random_layers_off:
            errors["fidelity_random_layers_off"] = float(self.random_layers_off)
        return errors


def check_fidelity(
    workload: Workload | ServingWorkload, knobs: Knobs, device: torch.device, seed: int = 0
) -> FidelityReport | ServingFidelityReport:
    """Compare one pass of ``knobs`` with the fp32 reference on the same micro-batches and seed.

    Costs two accumulation passes on freshly built models, the configuration's and the
    reference's, and one for a configuration that is the reference itself; a compiled
    configuration's pass is the one that compiles it (``TrainStep.loss_and_grads``). Where
    ``knobs`` runs another ``optimizer`` implementation than the reference's, its pass then takes
    one optimizer step, compared with the workload's optimizer as built on the same gradients on
    the host (``search.execution.optimizers.first_update``); otherwise no step is taken. Run it
    while no other ``TrainStep`` of the workload holds device memory. Raises ``KnobError`` for
    knobs the device cannot run, like ``TrainStep``; the global torch state is left as found.
    """
    if isinstance(workload, ServingWorkload):
        return check_serving_fidelity(workload, knobs, device, seed)
    with random_layers_off() as switched:
        report = _training_check(workload, knobs, device, seed)
    off = max(switched, default=0)
    # in front: a reason's end says whose fault it is (NOT_FINITE_IN_FP32)
    said = f"with {off} random layers off in both passes, {report.reason}" if report.reason else ""
    return dataclasses.replace(report, reason=said if off else report.reason, random_layers_off=off)


def _training_check(
    workload: Workload, knobs: Knobs, device: torch.device, seed: int
) -> FidelityReport:
    update = knobs.optimizer != reference_knobs(knobs).optimizer
    try:
        if not knobs.numerics_apart_from(reference_knobs(knobs)):  # the reference itself
            same = _fp32_pass(workload, knobs, device, seed)
            return _compare(knobs, same.loss, same.grad_norms, same.loss, same.grad_norms)
        # first: a KnobError costs no reference
        own = _own_pass(lambda: _one_pass(workload, knobs, device, seed, update), device)
        reference = _fp32_pass(workload, knobs, device, seed)
        report = _compare(knobs, own.loss, own.grad_norms, reference.loss, reference.grad_norms)
        return report if own.updates is None else _with_update(knobs, report, own.updates)
    except CheckOutOfMemory as error:
        return _unchecked(str(error))


def _own_pass(run: Callable[[], T], device: torch.device) -> T:
    """The configuration's own pass: it fitted while measured, so running out of memory now (the
    check builds the model anew, beside what the process still holds) is the check's, not the
    configuration's."""
    try:
        return run()
    except Exception as error:
        if not is_out_of_memory(error):
            raise
    raise CheckOutOfMemory(
        f"the configuration's own pass of the check ran out of memory on {device}, though its "
        "measurement fitted"
    )


def _unchecked(why: str) -> FidelityReport:
    """The report of a check that could not compute its reference: not the configuration's OOM."""
    return FidelityReport(
        ok=False,
        reason=f"{why}, so this configuration cannot be checked here",
        loss=math.nan,
        reference_loss=math.nan,
        loss_rel_error=math.nan,
        grad_norm_rel_error=math.nan,
    )


def reference_knobs(knobs: Knobs, piece: int | None = None) -> Knobs:
    """The reference of ``knobs``: every knob at its default (fp32, single lane, no recompute, ...)
    but the batch and its micro-batches, run in passes of ``piece`` samples (None: a micro-batch).

    It keeps the configuration's micro-batches because ``TrainStep`` draws them one after another
    from the seeded generator, which equals one whole-batch draw only when the workload's
    ``make_batch`` happens to split that way; smaller pieces are cut from those same draws
    (``search.execution.pieces``).
    """
    return Knobs(batch_size=knobs.batch_size, micro_batch_size=piece or knobs.micro_samples)


def changes_numerics(workload: Workload | ServingWorkload, knobs: Knobs) -> bool:
    """Whether ``knobs`` may compute the step otherwise than the plain fp32 step of the whole batch,
    so that its errors against the reference are worth keeping."""
    return (
        isinstance(workload, ServingWorkload)  # its reference is another implementation
        or bool(knobs.numerics_apart_from(Knobs(batch_size=knobs.batch_size)))
    )


def _fp32_pass(workload: Workload, knobs: Knobs, device: torch.device, seed: int) -> _Pass:
    """The reference: one pass of ``reference_knobs(knobs)`` on the configuration's samples, in
    smaller pieces of each micro-batch where fp32 runs out of memory (``search.execution.pieces``).
    """
    return _fitting(
        lambda piece: _one_pass(
            TrainingPieces(workload, knobs, seed, piece),
            reference_knobs(knobs, piece),
            device,
            seed,
        ),
        knobs,
        device,
    )


T = TypeVar("T")


class CheckOutOfMemory(Exception):
    """A pass of the check ran out of memory where the configuration's measurement did not: the
    fp32 reference even one sample per pass, or the configuration's own pass."""


def _fitting(run: Callable[[int], T], knobs: Knobs, device: torch.device) -> T:
    """``run(piece)`` with the largest piece of the micro-batch that fits in memory: an OOM of the
    reference is never the configuration's (bf16 activations take half of fp32's)."""
    for piece in piece_sizes(knobs.micro_samples):
        try:
            return run(piece)
        except Exception as error:
            if not is_out_of_memory(error):
                raise
        # Outside the handler: the traceback, and the tensors its frames hold, are gone.
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    raise CheckOutOfMemory(
        f"the fp32 reference ran out of memory on {device} even one sample per pass"
    )


class _Pass(NamedTuple):
    """What one pass of the check found."""

    loss: float
    """The batch's mean loss."""
    grad_norms: dict[str, float]
    """Each parameter tensor's gradient L2 norm, by name."""
    updates: dict[str, FirstUpdate] | None = None
    """Each parameter tensor's first update, by name; None where no step was taken."""


def _one_pass(
    workload: Workload, knobs: Knobs, device: torch.device, seed: int, update: bool = False
) -> _Pass:
    with seeded_rng(device, seed), TrainStep(workload, knobs, device, seed) as step:
        loss, grad_norms = _loss_and_grad_norms(step)
        loss, grad_norms = _backing_off_overflowing_scale(step, loss, grad_norms)
        return _Pass(loss, grad_norms, _first_update(step) if update else None)


def _first_update(step: TrainStep) -> dict[str, FirstUpdate]:
    """``first_update`` of ``step``'s optimizer, taken as ``TrainStep.__call__`` takes it (fp16:
    through its GradScaler, which unscales and would skip a step whose gradients overflow), on
    the gradients its pass left: calling the step would cost one more forward and backward."""
    scaler, optimizer = step._grad_scaler, step._optimizer  # TrainStep exposes no public handles

    def take_step() -> None:
        if scaler is None:
            optimizer.step()
        else:
            scaler.step(optimizer)
            scaler.update()

    scale = 1.0 if scaler is None else scaler.get_scale()
    return first_update(step.model, take_step, step.workload.make_optimizer, scale)


def _with_update(
    knobs: Knobs, report: FidelityReport, updates: dict[str, FirstUpdate]
) -> FidelityReport:
    """``report`` with the first update judged too; a loss or gradient that failed is named
    first."""
    error, reason = judge_first_update(updates, _describe(knobs))
    return dataclasses.replace(
        report,
        ok=report.ok and not reason,
        reason=report.reason or reason,
        update_norm_rel_error=error,
    )


def _loss_and_grad_norms(step: TrainStep) -> tuple[float, dict[str, float]]:
    loss, grads = step.loss_and_grads()
    return loss, {name: float(grad.norm()) for name, grad in grads.items()}


_MAX_SCALE_BACKOFFS = 16
"""GradScaler starts at 2**16; below a scale of 1 it is no longer the scale that overflows."""


def _backing_off_overflowing_scale(
    step: TrainStep, loss: float, grad_norms: dict[str, float]
) -> tuple[float, dict[str, float]]:
    """Do what training does when fp16's scaled gradients overflow: lower the scale and try again.

    GradScaler skips such steps and backs off, so an overflow of the scaled gradients alone is no
    infidelity; a non-finite loss comes from the forward pass and is reported as it is.
    """
    scaler = step._grad_scaler  # None unless fp16; TrainStep exposes no public handle on it
    for _ in range(_MAX_SCALE_BACKOFFS):
        if (
            scaler is None
            or not math.isfinite(loss)
            or all(map(math.isfinite, grad_norms.values()))
        ):
            break
        scaler.update(new_scale=scaler.get_scale() * scaler.get_backoff_factor())
        loss, grad_norms = _loss_and_grad_norms(step)
    return loss, grad_norms


def _compare(
    knobs: Knobs,
    loss: float,
    grad_norms: dict[str, float],
    reference_loss: float,
    reference_grad_norms: dict[str, float],
) -> FidelityReport:
    names = sorted(reference_grad_norms.keys() | grad_norms.keys())
    # A gradient missing on one side counts as zero there, so it fails against a non-zero one.
    pairs = {
        name: (grad_norms.get(name, 0.0), reference_grad_norms.get(name, 0.0)) for name in names
    }
    floor = gradient_floor(list(reference_grad_norms.values()))
    errors = {name: rel_error(norm, ref, floor) for name, (norm, ref) in pairs.items()}
    worst = max(errors, key=errors.__getitem__, default=None)
    figures = FidelityReport(
        ok=True,
        reason="",
        loss=loss,
        reference_loss=reference_loss,
        loss_rel_error=rel_error(loss, reference_loss),
        grad_norm_rel_error=errors[worst] if worst is not None else 0.0,
    )
    reason = _reason(knobs, figures, worst, pairs)
    return dataclasses.replace(figures, ok=not reason, reason=reason)


def _reason(
    knobs: Knobs,
    figures: FidelityReport,
    worst: str | None,
    pairs: dict[str, tuple[float, float]],
) -> str:
    """One line saying what failed, non-finite values first; empty when nothing did. ``figures``:
    the losses and errors (its ``ok`` and ``reason`` are not read); ``pairs``: each gradient's
    norm and the reference's, ``worst`` the one furthest apart."""
    tolerance, config = TOLERANCES[knobs.precision], _describe(knobs)
    loss, reference_loss = figures.loss, figures.reference_loss
    loss_error, grad_error = figures.loss_rel_error, figures.grad_norm_rel_error
    if not all(
        math.isfinite(value) for value in (reference_loss, *(ref for _, ref in pairs.values()))
    ):
        return (
            "the fp32 reference's loss or gradients are not finite, so nothing can be checked "
            f"against them; {NOT_FINITE_IN_FP32}"
        )
    if not math.isfinite(loss):
        return (
            f"non-finite loss under {config}: {loss} (the fp32 reference is {reference_loss:.4g})"
        )
    for name, (norm, reference_norm) in pairs.items():
        if not math.isfinite(norm):
            return (
                f"non-finite gradient of {name} under {config}: norm {norm} (the fp32 "
                f"reference's is {reference_norm:.4g})"
            )
    if loss_error > tolerance.loss_rel:
        return (
            f"{config} loss {loss:.4g} differs from the fp32 reference {reference_loss:.4g} "
            f"by {percent(loss_error)} (tolerance {percent(tolerance.loss_rel)})"
        )
    if worst is not None and grad_error > tolerance.grad_norm_rel:
        norm, reference_norm = pairs[worst]
        return (
            f"{config} gradient norm of {worst} {norm:.4g} differs from the fp32 reference "
            f"{reference_norm:.4g} by {percent(grad_error)} "
            f"(tolerance {percent(tolerance.grad_norm_rel)})"
        )
    return ""


def _describe(knobs: Knobs) -> str:
    """The precision, plus whatever else sets the configuration apart from the reference."""
    extras = (
        ([f"{knobs.streams} lanes"] if knobs.streams > 1 else [])
        + ([f"recompute {knobs.recompute}"] if knobs.recompute != RECOMPUTE_NONE else [])
        + ([f"compile={knobs.compile}"] if knobs.compile != "off" else [])
        + ([f"optimizer={knobs.optimizer}"] if knobs.optimizer != "default" else [])
        + ([f"kernels={knobs.kernels}"] if knobs.kernels != "torch" else [])
        + ([f"attention={knobs.attention}"] if knobs.attention != "default" else [])
    )
    return knobs.precision + (f" ({', '.join(extras)})" if extras else "")


# -- serving ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServingFidelityReport:
    """How one serving configuration's logits compare with its workload's fp32 reference."""

    ok: bool
    reason: str
    logits_rel_error: float
    """Largest ``‖logits - reference‖ / ‖reference‖`` over every request and generated position
    (``inf`` when not finite)."""
    token_agreement: float
    """Share of generated positions where the configuration's most likely token is the
    reference's (information: a near tie may flip under any rounding)."""

    @property
    def errors(self) -> dict[str, float]:
        return {
            "fidelity_logits_rel_error": self.logits_rel_error,
            "fidelity_token_agreement": self.token_agreement,
        }


def _reference_generation(
    workload: ServingWorkload, knobs: Knobs, device: torch.device, seed: int, piece: int
) -> Generated:
    """The reference's generation of ``knobs``'s requests, ``piece`` requests per micro-batch."""
    pieces = ServingPieces(workload, knobs, seed, piece)
    plain = reference_knobs(knobs, piece)
    with seeded_rng(device, seed), ServeStep(pieces, plain, device, seed) as reference:
        return reference.generate()


def _forced_generation(
    workload: ServingWorkload, knobs: Knobs, device: torch.device, seed: int, forced: torch.Tensor
) -> Generated:
    """``knobs``'s generation of the same requests, decoding the ``forced`` tokens."""
    with seeded_rng(device, seed), ServeStep(workload, knobs, device, seed) as step:
        return step.generate(forced=forced)


def check_serving_fidelity(
    workload: ServingWorkload, knobs: Knobs, device: torch.device, seed: int = 0
) -> ServingFidelityReport:
    """Generate with the reference in fp32, then run ``knobs`` on the same prompts decoding the
    same tokens; compare logits position by position within ``SERVING_TOLERANCES``."""
    try:
        expected = _fitting(
            lambda piece: _reference_generation(workload, knobs, device, seed, piece),
            knobs,
            device,
        )
        got = _own_pass(
            lambda: _forced_generation(workload, knobs, device, seed, expected.tokens), device
        )
    except CheckOutOfMemory as unfit:
        why = f"{unfit}, so this configuration cannot be checked here"
        return ServingFidelityReport(False, why, math.nan, math.nan)
    assert got.logits is not None and expected.logits is not None
    if not torch.isfinite(expected.logits).all():
        return ServingFidelityReport(
            False,
            "the fp32 reference's logits are not finite, so nothing can be checked against them; "
            + NOT_FINITE_IN_FP32,
            math.inf,
            0.0,
        )
    agreement = float((got.logits.argmax(-1) == expected.tokens).float().mean())
    if not torch.isfinite(got.logits).all():
        return ServingFidelityReport(
            False, f"non-finite logits under {_describe(knobs)}", math.inf, agreement
        )
    norms = expected.logits.norm(dim=-1).clamp_min(torch.finfo(torch.float32).tiny)
    error = float(((got.logits - expected.logits).norm(dim=-1) / norms).max())
    tolerance = SERVING_TOLERANCES[knobs.precision]
    reason = (
        f"{_describe(knobs)} logits differ from the fp32 reference by {percent(error)} "
        f"(tolerance {percent(tolerance)}; the most likely token agrees at "
        f"{agreement:.1%} of positions)"
        if error > tolerance
        else ""
    )
    return ServingFidelityReport(not reason, reason, error, agreement)
