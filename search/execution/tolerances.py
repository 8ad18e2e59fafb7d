"""How far a configuration's step may stray from the fp32 reference's, precision by precision,
and the relative errors the fidelity check (``search.execution.fidelity``) measures it by."""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = [
    "GRADIENT_FLOOR",
    "SERVING_TOLERANCES",
    "TOLERANCES",
    "Tolerance",
    "UPDATE_TOLERANCE",
    "gradient_floor",
    "percent",
    "rel_error",
]


@dataclass(frozen=True)
class Tolerance:
    """The largest relative differences from the fp32 reference that one precision may show."""

    loss_rel: float
    """``|loss - reference| / |reference|`` of the batch's mean loss."""
    grad_norm_rel: float
    """``|‖g‖ - ‖g_ref‖| / max(‖g_ref‖, floor)`` of each parameter tensor's gradient (L2 norm),
    for every tensor; the floor is a tenth of the model's root-mean-square tensor gradient norm
    (``gradient_floor``)."""


_U_TF32_FP16 = 2.0**-11
"""Unit roundoff of tf32 and fp16 (10 stored mantissa bits)."""
_U_BF16 = 2.0**-8
"""Unit roundoff of bf16 (7 stored mantissa bits)."""
_U_E4M3 = 2.0**-4
"""Unit roundoff of float8 e4m3 (3 stored mantissa bits)."""
_U_E5M2 = 2.0**-3
"""Unit roundoff of float8 e5m2 (2 stored mantissa bits)."""

# Relative errors measured on the built-in GPT on a CPU: seeds 0-4 on the tiny model (batch 8) and
# on the CPU preset (batch 16), seeds 0-2 on 6- and 12-layer variants (batch 4); plain, and with
# micro-batches of a quarter of the batch, 2 lanes and recompute:
#   fp32 (lanes, recompute): loss <= 1.2e-7, per-tensor gradient norm <= 2.4e-7 (a few fp32 ulps);
#   bf16: loss <= 2.5e-5 (< 0.01 u), gradient norm <= 3.9e-3 (1.0 u);
#   fp16: loss <= 2.2e-6 (< 0.01 u), gradient norm <= 5.6e-4 (1.15 u).
# Reduced precisions get 2 u for the loss (at initialisation the logits are small and the loss
# barely moves; a workload that starts from trained weights is more sensitive, as much as about u)
# and 8 u for gradient norms (about 7x the largest spread measured). tf32 rounds the same 10-bit
# mantissa as fp16, but only at matmul inputs and with fp32 outputs, so fp16's tolerance bounds it
# (no GPU was at hand to measure it). fp32 configurations differ from the reference only in the
# order of their sums and in recomputation (bit-identical), so they get fixed bounds far above their
# spread that still sit >= 39x below every reduced precision's.
TOLERANCES: dict[str, Tolerance] = {
    "fp32": Tolerance(loss_rel=1e-5, grad_norm_rel=1e-4),
    "tf32": Tolerance(loss_rel=2 * _U_TF32_FP16, grad_norm_rel=8 * _U_TF32_FP16),  # 0.098%, 0.39%
    "bf16": Tolerance(loss_rel=2 * _U_BF16, grad_norm_rel=8 * _U_BF16),  # 0.78%, 3.1%
    "fp16": Tolerance(loss_rel=2 * _U_TF32_FP16, grad_norm_rel=8 * _U_TF32_FP16),  # 0.098%, 0.39%
    # fp8: derived, then measured well inside (below)
    "fp8-tensorwise": Tolerance(loss_rel=_U_E4M3 / 4, grad_norm_rel=_U_E5M2),  # 1.6%, 12.5%
    "fp8-rowwise": Tolerance(loss_rel=_U_E4M3 / 4, grad_norm_rel=_U_E4M3),  # 1.6%, 6.25%
}

# fp8: derived as follows, then measured on an H100 (benchmarks/fidelity_errors.py: a Llama 2048
# wide with 2 layers, vocab 32000, sequence 256, batch 4 in micro-batches of 2, seeds 0-1; record
# benchmarks/results/2026-11-26-1648-*-fidelity_errors.json): tensorwise loss <= 5.6e-4, gradient
# norm <= 7.6e-3; rowwise loss <= 2.9e-4, gradient norm <= 1.6e-3, so the bounds sit 16-54x above
# what was seen. They stay as derived: two seeds on one shape are too few to tighten them by.
# bf16 on that Llama: loss <= 4.2e-5, gradient norm <= 1.2e-3; with Liger's kernels loss <= 2.9e-5,
# gradient norm <= 1.2e-3, inside bf16's tolerance as Liger's fused kernels must be.
# The derivation: torchao rounds only the operands of the converted linear layers' matmuls:
# inputs and weights to e4m3 (u = 2^-4) in both recipes, the gradient of the outputs (backward)
# to e5m2 (u = 2^-3) under tensorwise and to e4m3 under rowwise; products
# accumulate in fp32 and leave in bf16, and everything else runs in bf16, so bf16's tolerances are
# a floor. bf16's 8 u would be 50-100% here, which means nothing, so fp8 gets what the structure
# of its errors allows: each element of a matmul's output is off by about u (a sum of mixed
# signs), independently of its neighbours, and the residual stream carries the gradient past
# every block, so the error does not grow with depth; a tensor's gradient norm then moves by about
# u^2/2 + u/sqrt(N), well below u for the large layers torchao converts (only those wide enough
# to gain). Gradient norms get one u of the coarsest format in the backward pass (tensorwise
# 12.5%, rowwise 6.25%: 4x and 2x bf16's 3.1%), headroom for small tensors where errors do not
# average (bf16 measured up to 1 u on them). The loss, a mean over every token, gets u_e4m3 / 4
# (1.6%, twice bf16's 0.78%): torchao reports fp8 training loss curves within about 1% of bf16's.

UPDATE_TOLERANCE = 1e-4
"""The largest ``update_norm_rel_error`` of any precision: both updates are computed from the same
gradients in the parameters' dtype (fp32), by the same arithmetic, so fp32's gradient-norm bound
holds whatever the precision. Measured on the built-in GPT on a CPU (the tiny shape and one of 4
layers 64 wide, seeds 0-4, fp32, bf16 and fp16, plain and with 2 lanes): fused at most 7.4e-8, the
loop and foreach 0; on an H100 (benchmarks/fidelity_errors.py, bf16, the fused implementation on
a Llama 2048 wide, seeds 0-1) 0."""


SERVING_TOLERANCES: dict[str, float] = {
    "fp32": 1e-4,
    "tf32": 8 * _U_TF32_FP16,
    "bf16": 8 * _U_BF16,
    "fp16": 8 * _U_TF32_FP16,
}
"""The largest relative L2 error of a generated position's logits that a precision may show.
Measured on the built-in GPT serving on a CPU (batch 8; a tiny shape with 8 generated tokens,
seeds 0-4, and the CPU preset's shape with 32, seeds 0-2; cached and uncached, micro-batches of
1-8 over 1-2 lanes): fp32 at most 6.7e-7, bf16 at most 6.8e-3 (1.7 u), fp16 at most 8.4e-4
(1.7 u; seeds 0-2, the CPU preset). fp32 differs only in the order of sums and gets a fixed bound
far above its spread; reduced precisions get 8 u, as gradient norms do."""


GRADIENT_FLOOR = 0.1
"""A tensor's gradient norm is compared against at least this fraction of the model's
root-mean-square tensor gradient norm (see ``gradient_floor``)."""


def gradient_floor(reference_norms: list[float]) -> float:
    """The smallest scale a tensor's gradient error is judged against: ``GRADIENT_FLOOR`` times the
    root mean square of the reference's per-tensor gradient norms.

    A gradient that is zero in exact arithmetic (a conv or linear bias right before BatchNorm,
    which subtracts it again) comes out as rounding noise: about 1e-7 in fp32 and 1e-5 in bf16,
    and its error relative to itself is thousands of percent while nothing is wrong. Rounding error
    scales with the terms of a sum, not with what is left of it after they cancel, so such a
    tensor is judged against the size of the model's gradients instead; a tensor whose gradient is
    not tiny is still judged against its own norm. Overflow (non-finite values) and a drifting loss
    are checked as before."""
    finite = [n for n in reference_norms if math.isfinite(n)]
    if not finite:
        return 0.0
    return GRADIENT_FLOOR * math.sqrt(sum(n * n for n in finite) / len(finite))


def rel_error(value: float, reference: float, floor: float = 0.0) -> float:
    """``|value - reference| / max(|reference|, floor)``; 0 when both are 0, ``inf`` when either
    is not finite."""
    if not (math.isfinite(value) and math.isfinite(reference)):
        return math.inf
    scale = max(abs(reference), floor)
    if scale == 0.0:
        return 0.0 if value == 0.0 else math.inf
    return abs(value - reference) / scale


def percent(fraction: float) -> str:
    """``fraction`` as a percentage of 3 significant digits, for one-line reasons."""
    return f"{fraction * 100:.3g}%"
