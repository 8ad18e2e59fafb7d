"""The ``kernels`` knob: the model's own operators, or fused kernels patched into it.

``liger`` swaps in Liger-Kernel's Triton kernels: RMSNorm, rotary embedding, SwiGLU and a fused
linear cross-entropy that never materialises the logits (reported at +20% throughput and -60%
memory on Llama3-8B; slower at small batch, where the host bounds the step). How to patch a model
is the workload's to say (``Workload.use_kernels``): Liger's patches are per model family. Triton
needs a CUDA device, so a CPU refuses ``liger`` with one line. The patched step must compute the
same step: the fidelity check compares it with the plain fp32 one.
"""

from __future__ import annotations

import importlib.util

import torch
from torch import nn

from search.workloads.base import Workload

__all__ = ["KERNELS", "apply_kernels", "kernels_unsupported"]

KERNELS = ("torch", "liger")
"""``torch``: the model as built."""

_PACKAGES = {"liger": ("liger_kernel", "pip install 'search[gpu]'")}
"""The package each set of fused kernels comes from, and how to install it."""


def kernels_unsupported(value: object, device: torch.device) -> str | None:
    """Why ``device`` cannot run ``kernels=value`` (None: it can)."""
    if value not in _PACKAGES:
        return None  # torch, or a name value_rule refuses with the list of choices
    if device.type != "cuda":
        return f"{value}'s kernels are Triton kernels, which need a CUDA device"
    module, install = _PACKAGES[str(value)]
    if importlib.util.find_spec(module) is None:
        return f"{value} needs {module}, which is not installed; install it with: {install}"
    return None


def apply_kernels(workload: Workload, model: nn.Module, kernels: str) -> None:
    """Patch ``kernels`` into ``model`` through the workload (nothing for ``torch``)."""
    if kernels != "torch":
        workload.use_kernels(model, kernels)
