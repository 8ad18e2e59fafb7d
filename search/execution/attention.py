"""The ``attention`` knob: which of torch's kernels runs ``scaled_dot_product_attention``.

torch picks a kernel for each call of ``F.scaled_dot_product_attention`` by its own priority
(flash, then memory-efficient, then the math decomposition; cuDNN only when asked for), whatever
the shapes cost.
The pick is not always the fastest. On the 2-core AVX-512 CPU, at the ``llm`` CPU preset's shape
(micro-batch 16, 4 heads of 32, sequence 128, bf16), the CPU's flash kernel's backward took
14.4 ms a call against its forward's 2.2 ms, 32% of the compiled step's host time. Compiled, the
math decomposition (two matrix products and a softmax, which the compiler fuses with their
neighbours) ran the expert's first guess at 1.18x its flash step; eager it tied (6 fresh
processes each, docs/guide/levers.md). On a GPU at long sequences the math decomposition is the
slow one, and which fused kernel wins (flash, memory-efficient, cuDNN) depends on the GPU and the
shape. So the knob is measured, not assumed; only a model that calls
``scaled_dot_product_attention`` is moved by it.

The kernel is set around the whole step, every lane's forward and backward
(``attention_kernel``, in the calling thread): a recomputed block's forward runs again inside
backward, where it must pick the kernel its first pass picked. The setting is the process's, so
it is set once around the lanes: set in each lane, the first to finish would restore it under the
others. A compiled step traces under it, so its graph holds the kernel chosen; the compiler's
on-disk caches do not key on that setting, though (set only around the call, the cache handed
back the flash graph to a math step). So a compiled step's kernel goes into the caches' keys: a
graph pass that changes nothing and names the kernel (``attention_kernel(kernel, compiled=True)``)
is one the compiler keys both caches on, FX graphs' and AOTAutograd's. It was set inside the
compiled function before, which put the choice in the graph's key, but AOTAutograd refuses to cache
a graph that calls the setting (``_backend_from_string``): every warm compile of a math step then
traced forward and backward again, about 2 s of its 5-6 s on the 2-core CPU. Then each kernel kept a
cache folder of its own, and a step's first compile under ``math`` compiled in C++ again every
kernel the ``default`` step had compiled: the kernels whose code is the same (the layers around
attention, the loss) are one file in one cache now.

The kernels compute the same attention and round differently: the fidelity check compares a
configuration that sets one with the plain fp32 step.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch

__all__ = [
    "ATTENTION_KERNELS",
    "HALF_INPUTS_ON_CUDA",
    "attention_kernel",
    "attention_unsupported",
]

ATTENTION_KERNELS = ("default", "math", "flash", "efficient", "cudnn")
"""``default``: torch's own pick for each call; the others force that kernel."""

_CUDA_ONLY = {
    "efficient": "the memory-efficient kernel is CUDA's only",
    "cudnn": "cuDNN's attention needs a CUDA device",
}
"""The kernels a CPU has none of, and why."""
HALF_INPUTS_ON_CUDA = ("flash", "cudnn")
"""CUDA's kernels that take fp16 and bf16 inputs only (torch's ``sdp_utils.cpp``); the
memory-efficient kernel and the math decomposition take fp32 as well
(``search.execution.knobs.attention_precision_unsupported``)."""


def attention_unsupported(value: object, device: torch.device) -> str | None:
    """Why ``device`` cannot run ``attention=value`` (None: it can). A kernel that a call's
    shapes rule out (a head size it has no kernel for, say) fails that trial with torch's
    reason; one that the precision rules out is
    ``search.execution.knobs.attention_precision_unsupported``."""
    if device.type != "cuda" and value in _CUDA_ONLY:
        return _CUDA_ONLY[str(value)]
    return None


def _backend(kernel: str) -> Any:
    from torch.nn.attention import SDPBackend

    return {
        "math": SDPBackend.MATH,
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
    }[kernel]


@contextlib.contextmanager
def attention_kernel(kernel: str, compiled: bool = False) -> Iterator[None]:
    """``scaled_dot_product_attention`` runs ``kernel`` inside (nothing changes for ``default``),
    and, where the step is ``compiled``, what the compiler compiles inside is cached under the
    kernel's name (module docstring). The setting is the process's, not the thread's: enter it in
    the thread that starts the lanes, around all of them."""
    if kernel == "default":
        yield
        return
    from torch.nn.attention import sdpa_kernel

    keyed = _in_cache_key(kernel) if compiled else contextlib.nullcontext()
    with sdpa_kernel([_backend(kernel)]), keyed:
        yield


@contextlib.contextmanager
def _in_cache_key(kernel: str) -> Iterator[None]:
    """The compiler's caches key what it compiles inside on ``kernel``. Set and restored by hand:
    the step enters it around every call, timed ones too, and ``config.patch`` took 50 us a call
    against 12."""
    from torch._inductor import config

    before = config.post_grad_custom_post_pass
    config.post_grad_custom_post_pass = _kernel_in_cache_key(kernel)
    try:
        yield
    finally:
        config.post_grad_custom_post_pass = before


@functools.cache  # made once a process: the step enters it around every call, timed ones too
def _kernel_in_cache_key(kernel: str) -> Any:
    """A graph pass that leaves the graph as it is and names ``kernel`` in its ``uuid``, which the
    compiler's caches put in their keys (``torch._inductor.codecache.FxGraphHashDetails``, which
    AOTAutograd's key extends)."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class KernelInCacheKey(CustomGraphPass):
        def __call__(self, graph: Any) -> None:
            pass  # the graph stays as traced: only the key changes

        def uuid(self) -> str:
            return f"search.attention={kernel}"

    return KernelInCacheKey()
