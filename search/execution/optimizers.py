"""The ``optimizer`` knob: how the workload's optimizer runs its update, not which optimizer.

torch.optim's optimizers (AdamW, Adam, SGD, ...) have up to three implementations of one update:
a loop over the parameter tensors, ``foreach`` (the same arithmetic batched over tensors: fewer
kernel launches) and ``fused`` (one kernel per group of tensors). torch picks ``foreach`` on CUDA
and the loop on a CPU by default. On a GPU the update is launch-bound for a model of many small
tensors, so the choice is worth measuring (torchtitan reports +1.6-3.6% for fused AdamW on
Llama3-8B). The arithmetic is the same; the rounding may differ in the last bits, which the
fidelity check bounds (``first_update``, ``judge_first_update``).

The workload builds its optimizer (``Workload.make_optimizer``); the knob rebuilds it with the same
parameter groups and hyperparameters and the implementation flags set, so any of torch.optim's
optimizers that has the flags gets the knob, and one that lacks a flag is refused with one line.

The fidelity check compares a configuration's first update with the step the workload's
optimizer as built takes from the same weights and gradients (``first_update``), not with the
fp32 reference's own step: Adam's first update is about ``lr * sign(g)`` whatever the gradient's
size, so a gradient that is rounding noise (a key bias, zero in exact arithmetic) moves as far as
any other under bf16 and less far in fp32, where the noise is near Adam's eps. On the tiny GPT
that put bf16 15% and fp16 7% off the reference's update under every implementation, the default
included: the gradients' difference, which the check has already judged, not the optimizer's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn

from search.core.errors import KnobError
from search.execution.tolerances import UPDATE_TOLERANCE, gradient_floor, percent, rel_error

__all__ = [
    "OPTIMIZER_IMPLEMENTATIONS",
    "FirstUpdate",
    "first_update",
    "judge_first_update",
    "optimizer_unsupported",
    "with_implementation",
]

OPTIMIZER_IMPLEMENTATIONS = ("default", "for-loop", "foreach", "fused")
"""``default`` is what the workload builds (torch's own choice for the device)."""

_FLAGS: dict[str, dict[str, bool]] = {
    "for-loop": {"foreach": False, "fused": False},
    "foreach": {"foreach": True, "fused": False},
    "fused": {"foreach": False, "fused": True},
}


def optimizer_unsupported(value: object, device: torch.device) -> str | None:
    """Why ``device`` cannot run ``optimizer=value`` (None: it can): torch names the device types
    its fused optimizer kernels exist for."""
    if value != "fused":
        return None
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    supported = _get_fused_kernels_supported_devices()
    if device.type not in supported:
        return f"torch has fused optimizer kernels only for {', '.join(supported)}"
    return None


def with_implementation(optimizer: torch.optim.Optimizer, implementation: str) -> Any:
    """``optimizer`` itself for ``default``; else a new optimizer of its class over the same
    parameter groups and hyperparameters, with ``implementation``'s flags (before any step, so
    there is no state to carry). ``KnobError`` where its class lacks the implementation."""
    if implementation == "default":
        return optimizer
    flags = _FLAGS[implementation]
    cls: type[Any] = type(optimizer)  # its own constructor takes the flags, not Optimizer's
    if not all(flag in optimizer.defaults for flag in flags):
        raise KnobError(
            f"optimizer={implementation} needs an optimizer with foreach and fused options (as "
            f"torch.optim's AdamW); the workload builds {cls.__name__}; leave optimizer out"
        )
    # Each group keeps its own hyperparameters (lr, weight decay, ...); the constructor's own
    # arguments only validate the flags (fused needs floating-point parameters on a device
    # with kernels) and tell a GradScaler that the fused step unscales itself.
    groups = [{**group, **flags} for group in optimizer.param_groups]
    try:
        return cls(groups, **flags)
    except (RuntimeError, TypeError, ValueError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise KnobError(
            f"optimizer={implementation} cannot build {cls.__name__} here: {first}"
        ) from None


class FirstUpdate(NamedTuple):
    """One parameter tensor's first optimizer update, against the workload's optimizer as built."""

    norm: float
    """``‖Δw‖``, the configuration's update (``Δw = w_after - w_before``)."""
    reference_norm: float
    """``‖Δw_ref‖``, the update of the workload's optimizer as built, from the same weights and
    gradients."""
    gap: float
    """``‖Δw - Δw_ref‖`` less what rounding the stored weights allows (at least 0; NaN or inf
    where an update is not finite)."""


def first_update(
    model: nn.Module,
    take_step: Callable[[], None],
    make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    grad_scale: float,
) -> dict[str, FirstUpdate]:
    """Each parameter tensor's update over ``take_step()`` (the configuration's optimizer step on
    the gradients ``model`` holds, scaled by ``grad_scale``), against one step of
    ``make_optimizer``'s optimizer from the same weights and unscaled gradients on the host, where
    torch's default is its plainest implementation, a loop over the tensors.

    The host holds the weights before, the gradients and that optimizer (5 copies of the weights
    with Adam's state), so the model's device memory is not doubled.
    """
    params = dict(model.named_parameters())
    before = {name: p.detach().to("cpu", copy=True) for name, p in params.items()}
    grads = {
        name: p.grad.to("cpu", copy=True).div_(grad_scale)
        for name, p in params.items()
        if p.grad is not None
    }
    take_step()
    expected = _as_built_step(make_optimizer, before, grads)
    return {name: _update(p, before[name], expected[name]) for name, p in params.items()}


def _as_built_step(
    make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    before: dict[str, torch.Tensor],
    grads: dict[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """The weights after one step of ``make_optimizer``'s optimizer from ``before`` with
    ``grads``, on host copies in the parameters' own order and dtype."""
    params = {name: nn.Parameter(weight.clone()) for name, weight in before.items()}
    for name, param in params.items():
        param.grad = grads.get(name)  # None: the optimizer leaves it, as the step's does
    make_optimizer(list(params.values())).step()
    return {name: param.detach() for name, param in params.items()}


def _update(param: torch.Tensor, before: torch.Tensor, expected: torch.Tensor) -> FirstUpdate:
    delta = param.detach().to("cpu", torch.float32) - before.float()
    expected_delta = expected.float() - before.float()
    # Two implementations of the same arithmetic may round a stored weight to neighbours, one unit
    # in the last place apart (eps * |w|; twice that where one rounds an intermediate the other
    # keeps in a register): no implementation avoids it, and at Adam's first step it is 1e-3 of
    # the update of a norm's gain of 1 in fp32.
    rounding = 2 * torch.finfo(before.dtype).eps * float(before.float().norm())
    apart = float((delta - expected_delta).norm())
    gap = 0.0 if apart <= rounding else apart - rounding  # NaN stays NaN
    return FirstUpdate(float(delta.norm()), float(expected_delta.norm()), gap)


def judge_first_update(updates: dict[str, FirstUpdate], config: str) -> tuple[float, str]:
    """The largest relative error of a tensor's update (``gap / max(‖Δw_ref‖, floor)``, the floor
    a tenth of the model's RMS update, as for gradients: SGD's update of a tensor whose gradient is
    rounding noise is as small as that noise), and one line naming the worst tensor under
    ``config`` if it exceeds ``UPDATE_TOLERANCE`` or is not finite (empty if not)."""
    floor = gradient_floor([update.reference_norm for update in updates.values()])
    errors = {
        name: rel_error(update.gap, 0.0, max(update.reference_norm, floor))
        for name, update in updates.items()
    }
    worst = max(errors, key=errors.__getitem__, default=None)
    if worst is None:
        return 0.0, ""
    update, error, expected = updates[worst], errors[worst], f"{updates[worst].reference_norm:.4g}"
    if not (math.isfinite(update.norm) and math.isfinite(update.gap)):
        return error, (
            f"non-finite first update of {worst} under {config}: norm {update.norm} (the "
            f"workload's optimizer as built takes {expected} from the same gradients)"
        )
    if error > UPDATE_TOLERANCE:
        return error, (
            f"{config} first update of {worst} differs from the workload's optimizer as built on "
            f"the same gradients by {percent(error)} of its norm (tolerance "
            f"{percent(UPDATE_TOLERANCE)}; norms {update.norm:.4g} and {expected})"
        )
    return error, ""
