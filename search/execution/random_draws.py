"""What the fidelity check's passes draw at random: the same seeded numbers in every pass
(``seeded_rng``), and nothing at all from their random layers (``random_layers_off``): dropout,
drop-path and the dropout of attention kernels are off in the reference's pass and the
configuration's alike.

Why off rather than the same masks: a compiled step draws its masks from the compiler's own random
stream (Inductor's philox seeds), and concurrent lanes draw from the global generator in no fixed
order, so neither can draw the reference's masks. With them drawn, GPT-2 from transformers
(dropout 0.1) differed eager against compiled by 1.9e-3 of its loss, against 6e-8 at dropout 0.0,
and the compiled configuration was refused as broken numerics. Off, the two passes compute the
same function, and a wrong op of the configuration still moves the loss or a gradient.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

import torch
from torch import nn

__all__ = ["as_drawn", "random_layers_off", "seeded_rng", "switch_off_random_layers"]


@contextlib.contextmanager
def seeded_rng(device: torch.device, seed: int) -> Iterator[None]:
    """Whatever a pass draws from the global generators (a workload's own ``torch.rand`` in its
    loss, say) is the same numbers in every pass; the generators are restored. Random layers draw
    nothing in the check's passes (``random_layers_off``): concurrent lanes and a compiled step
    could not draw the reference's masks."""
    cuda_devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda_devices):
        torch.default_generator.manual_seed(seed)  # torch.manual_seed would reseed every GPU too
        if cuda_devices:
            with torch.cuda.device(device):
                torch.cuda.manual_seed(seed)
        yield


def switch_off_random_layers(model: nn.Module) -> int:
    """Zero the drop probability of every random layer of ``model``: torch's dropout modules, and
    any module's float attribute whose name holds ``drop`` (``attention_dropout``, ``dropout_p``,
    timm's ``drop_prob``, an attention's ``dropout`` passed to its kernel). The number of layers
    and attributes switched off."""
    switched = 0
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
            module.p = 0.0
            switched += 1
        for name, value in list(vars(module).items()):
            if "drop" in name and isinstance(value, float) and 0 < value <= 1:
                setattr(module, name, 0.0)
                switched += 1
    return switched


_SWITCHED: ContextVar[list[int] | None] = ContextVar("random_layers_switched", default=None)
"""Where ``random_layers_off`` is in force: the count switched off in each model built."""


@contextlib.contextmanager
def random_layers_off() -> Iterator[list[int]]:
    """Within it, every model a step builds (``search.execution.knobs.build_model``) comes with
    its random layers off; yields the count switched off in each, appended as they are built.
    The workload itself is left as it is (it may be a frozen dataclass)."""
    counts: list[int] = []
    token = _SWITCHED.set(counts)
    try:
        yield counts
    finally:
        _SWITCHED.reset(token)


def as_drawn(model: nn.Module) -> nn.Module:
    """``model``, its random layers switched off where ``random_layers_off`` is in force."""
    counts = _SWITCHED.get()
    if counts is not None:
        counts.append(switch_off_random_layers(model))
    return model
