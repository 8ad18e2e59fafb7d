"""What a built step holds in tensors: the part of a CPU process's memory that is the workload's.

A CPU process's resident set also holds what the compiler built and kept (modules it imported,
graphs, generated code), and a cold compile keeps about 36 MB more of it than the same step
compiled from the cache on the llm preset. The memory probe counts the step's tensors instead, and
then what the step's passes add (``search.measurement.environment.MemoryProbe.settle``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from search.analysis.memory_model import GRADIENTS

__all__ = ["held_figures", "module_tensors", "storage_bytes", "tensors_in"]


def tensors_in(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a tensor, or in a tuple, list or dict of them, at any depth."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensors_in(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from tensors_in(item)


def module_tensors(model: nn.Module) -> Iterator[torch.Tensor]:
    """A model's parameters, their gradients and its buffers."""
    for parameter in model.parameters():
        yield parameter
        if parameter.grad is not None:
            yield parameter.grad
    yield from model.buffers()


def storage_bytes(tensors: Iterable[torch.Tensor], device: torch.device) -> int:
    """Bytes of the distinct storages behind ``tensors`` on ``device``'s type: tied weights and
    views count once."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        if tensor.device.type != device.type or tensor.is_meta:
            continue
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def held_figures(step: Any, device: torch.device) -> dict[str, float]:
    """What a measured step holds between steps, by part, MB: ``GRADIENTS`` where its parameters
    have gradients (a training step's); nothing for a serving step."""
    gradients = [p.grad for p in step.model.parameters() if p.grad is not None]
    return {GRADIENTS: storage_bytes(gradients, device) / 1e6} if gradients else {}
