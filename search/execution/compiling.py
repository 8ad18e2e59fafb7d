"""The ``compile`` knob: ``torch.compile`` of a step's function, judged on what it costs.

A step compiles the one function of its workload that it calls for every micro-batch
(``Workload.loss`` of a training step, ``ServingWorkload.forward`` of a served batch), so the knob
applies to any workload, whatever its model looks like. The step then runs one untimed pass before
anything is measured (``warm_up``): the compiler's work happens there, out of the timed windows,
and what it took is kept (``CompileStats``): its wall time, the graphs it made, the graph breaks
and recompiles, and whether the compiled code came from the cache of earlier processes.

What the platform cannot compile (no C++ compiler, an operator the compiler refuses) and a step
that breaks into more than ``MAX_GRAPH_BREAKS`` graphs are ``KnobError``: the trial is infeasible
with that reason, and the study goes on. The compiled step must still compute the same as the
eager fp32 one: the fidelity check compares it, as it does a lower precision.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch

from search.core.errors import KnobError

__all__ = [
    "COMPILE_MODES",
    "CompileStats",
    "MAX_GRAPH_BREAKS",
    "compile_unsupported",
    "compiled",
    "marked_dynamic",
    "read_stats",
    "use_compile_cache",
    "warm_up",
]

COMPILE_MODES = ("off", "default", "reduce-overhead", "max-autotune")
"""``off`` runs eagerly; the others are ``torch.compile``'s modes."""

_CUDA_ONLY = {"reduce-overhead": "replays CUDA graphs, which need a CUDA device"}
"""The modes a CPU cannot run, and why."""

MAX_GRAPH_BREAKS = 8
"""More graph breaks than this in one step is a storm: the step runs mostly eagerly between small
graphs, so what is measured is the break overhead rather than the compiler; refused."""

F = TypeVar("F", bound=Callable)


def _counters():
    """The compiler's counters, imported when first read: importing ``torch._dynamo`` takes about
    1.3 s, which every command and trial process would otherwise pay, compiled or not."""
    from torch._dynamo.utils import counters

    return counters


class _RecompileCounter(logging.Handler):
    """Counts the compiler's recompile records: dynamo logs one, with its reason (the guard that
    failed), each time it compiles a frame again."""

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1


_RECOMPILES = _RecompileCounter()


def _count_recompiles() -> None:
    """Turn dynamo's ``recompiles`` log on (its reasons go to the worker's stderr too) and count
    its records from now on."""
    torch._logging.set_logs(recompiles=True)
    logger = logging.getLogger("torch._dynamo.guards.__recompiles")
    if _RECOMPILES not in logger.handlers:
        logger.addHandler(_RECOMPILES)
    _RECOMPILES.count = 0


def compile_unsupported(mode: object, device: torch.device) -> str | None:
    """Why ``device`` cannot run ``compile=mode`` (None: it can)."""
    if device.type != "cuda" and mode in _CUDA_ONLY:
        return f"{mode} {_CUDA_ONLY[str(mode)]}"
    return None


def compiled(fn: F, mode: str) -> F:
    """``fn`` compiled with ``torch.compile``'s ``mode``; ``fn`` itself when ``mode`` is off."""
    if mode == "off":
        return fn
    return torch.compile(fn, mode=mode)  # type: ignore[return-value]


DYNAMIC_MICRO_BATCH = frozenset({"cpu"})
"""The devices whose compiled steps take the micro-batch's size as a symbol, not a constant.

A compiled step specialized to its micro-batch compiles anew for every micro-batch a study tries,
and a fresh process finds nothing of it in the cache: on a 2-core CPU that is 18-20 s of the C++
compiler per new micro-batch of the ``llm`` preset. With the size a symbol, one compile serves every
micro-batch above 1 (the compiler still specializes a size of 1), and a new micro-batch reads the
code from the cache in 3-5 s. On a CPU the generated C++ loops take the size as an argument; the
``llm`` preset's compiled bf16 step measured no slower that way (three processes of each,
alternated). On CUDA, Triton's block sizes are tuned to the size the compiler saw first; until
that is measured there, a CUDA step stays specialized, as a plain ``torch.compile`` of it is."""


def marked_dynamic(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` with its first dimension (the micro-batch's samples) marked as a size the
    compiler keeps symbolic where it can (``maybe_mark_dynamic``: where the step's code pins it, the
    compiler specializes it rather than failing)."""
    from torch._dynamo import maybe_mark_dynamic  # imported with the compiler, not before

    if tensor.dim() > 0:
        maybe_mark_dynamic(tensor, 0)
    return tensor


def use_compile_cache(directory: Path) -> None:
    """Keep the compiler's caches (inductor's, and Triton's on a GPU) in ``directory``, so a fresh
    process of the same device reuses what an earlier one compiled. Call it before compiling."""
    directory.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(directory)
    os.environ["TRITON_CACHE_DIR"] = str(directory / "triton")


@dataclass(frozen=True, kw_only=True)
class CompileStats:
    """What compiling one step took, from the compiler's own counters (``torch._dynamo``)."""

    first_pass_s: float
    """Wall time of the untimed first pass: compiling plus running it once, s."""
    graphs: int
    """Graphs compiled."""
    graph_breaks: int
    """Places where the compiler gave up on one graph and started another."""
    recompiles: int
    """Frames compiled again after their first compile (a guard failed: a new shape, a new value),
    as dynamo's ``recompiles`` log records them; over the first pass and everything after it,
    timed windows included."""
    cache_hits: int
    """Compiled graphs read from the cache of an earlier process."""
    cache_misses: int
    """Compiled graphs the compiler had to make itself."""

    def metrics(self, step_s: float) -> dict[str, float]:
        """The figures a trial stores: the compile time is the first pass less one measured step
        (``step_s``, s)."""
        return {
            "compile_time_s": max(self.first_pass_s - step_s, 0.0),
            "compile_graphs": float(self.graphs),
            "compile_graph_breaks": float(self.graph_breaks),
            "compile_recompiles": float(self.recompiles),
            # 1: every graph came from the cache (a warm compile); 0: some were compiled anew
            "compile_cache_warm": float(self.cache_misses == 0 and self.cache_hits > 0),
        }


def read_stats(first_pass_s: float) -> CompileStats:
    """The compiler's counters as they stand, since the last ``warm_up`` cleared them."""
    counters = _counters()
    breaks = sum(counters["graph_break"].values())
    return CompileStats(
        first_pass_s=first_pass_s,
        graphs=int(counters["stats"]["unique_graphs"]),
        graph_breaks=int(breaks),
        recompiles=_RECOMPILES.count,
        cache_hits=int(counters["inductor"]["fxgraph_cache_hit"]),
        cache_misses=int(counters["inductor"]["fxgraph_cache_miss"]),
    )


def warm_up(run_once: Callable[[], object], mode: str, device: torch.device) -> CompileStats:
    """Run ``run_once`` (one pass of a step compiled with ``mode``) untimed, and say what compiling
    took. Raises ``KnobError`` where the compiler fails or the graphs break into a storm."""
    _counters().clear()  # this process's counts start here: one step compiles per process
    _count_recompiles()
    try:
        if device.type == "cpu":
            _cpp_compiler()  # before the clock: it is no part of compiling this step
        started = time.perf_counter()
        run_once()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as e:
        if not _is_compiler_error(e):
            raise  # the step's own fault (out of memory, a shape error): typed as usual
        raise KnobError(f"compile={mode} cannot compile this step: {_first_line(e)}") from e
    stats = read_stats(time.perf_counter() - started)
    if stats.graph_breaks > MAX_GRAPH_BREAKS:
        breaks = _counters()["graph_break"]
        reasons = sorted(breaks, key=breaks.__getitem__)
        raise KnobError(
            f"compile={mode}: {stats.graph_breaks} graph breaks in one step (more than "
            f"{MAX_GRAPH_BREAKS}), so it runs mostly eagerly; the most frequent: "
            f"{str(reasons[-1]).splitlines()[0][:200]}"
        )
    return stats


def _cpp_compiler() -> None:
    """Find the C++ compiler a CPU's compiled code needs, as inductor will, before anything is
    traced: without one, inductor fails only at its code generation, after the tracing and lowering
    it would have done for nothing (seconds to tens of seconds of a trial on a 2-core CPU)."""
    from torch._inductor.cpp_builder import get_cpp_compiler

    get_cpp_compiler()


def _first_line(error: BaseException) -> str:
    """What went wrong, in one line: the compiler's message without its ``backend='inductor'
    raised:`` header (the inner error follows it)."""
    lines = [
        line.strip()
        for line in str(error).splitlines()
        if line.strip() and not line.startswith("backend=")
    ]
    return (lines[0] if lines else type(error).__name__)[:300]


def _is_compiler_error(error: BaseException) -> bool:
    """Whether ``error`` was raised by the compiler (TorchDynamo, AOTAutograd, Inductor) rather than
    by the step it compiles."""
    module = type(error).__module__
    return module.startswith(("torch._dynamo", "torch._inductor", "torch._functorch"))
