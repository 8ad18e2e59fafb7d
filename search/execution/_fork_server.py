"""Imported only by the fork server that starts trial workers (``isolation.worker_context``).

It ties the server's life to the study process that started it, then imports what every trial
needs, so a worker forked from the server starts with torch already imported. The server would
otherwise outlive a study killed with ``kill -9``: each worker it forks keeps the study's end of
the server's liveness pipe open, and a hung worker would keep both alive. With the server killed
with the study, every worker (killed with its parent, the server) goes too.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable

from search.execution.isolation import die_with_parent

die_with_parent()


def _import_the_compiler() -> None:
    """Import ``torch._dynamo`` and inductor here, once. torch's optimizers import dynamo when the
    first one is built (``torch._compile``), which every trial does, so each worker would pay
    1-1.5 s for it on a 2-core CPU; inductor is imported by ``torch.compile`` itself, 1.4-1.7 s
    more in every compiled trial's process (its first and second, re-validation's, the
    confirmation's). Meanwhile CUDA availability is asked through NVML (none is asked today),
    which cannot initialise CUDA in the server: a forked worker could then not use CUDA.
    Inductor's modules ask no device when imported, and its pool of compile workers starts only
    at a compile, in the worker."""
    name = "PYTORCH_NVML_BASED_CUDA_CHECK"
    before = os.environ.get(name)
    os.environ[name] = "1"
    try:
        import torch._dynamo  # noqa: F401
        import torch._inductor.compile_fx  # noqa: F401
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before


def _probe_the_cpu_s_vector_instructions() -> None:
    """Ask inductor once which vector instructions its C++ code may use here. It answers by
    building a small library for each candidate (AVX-512, AVX2, ...) and loading it in a child
    Python of its own, and caches the answer in the process only: every worker would ask again,
    1.3 s of child processes in each compiled trial's process on a 2-core CPU, a third of a warm
    compile (read with cProfile: six probes through ``cpu_vec_isa._probe_load``). Asked here, the
    forked workers inherit the answer. A failure here is left for the worker to meet and report.

    The server writes to the study's own stderr, where a refused command prints its one line: the
    probe imports ``torch.utils.cpp_extension``, which warns on import where a CUDA build of torch
    finds the CUDA toolkit but no GPU. That warning is kept out of it (a worker still meets it,
    into its own stderr)."""
    extension_log = logging.getLogger("torch.utils.cpp_extension")
    level = extension_log.level
    extension_log.setLevel(logging.ERROR)
    try:
        from torch._inductor.cpu_vec_isa import pick_vec_isa

        pick_vec_isa()
    except Exception:  # noqa: BLE001 - the worker asks again, where its trial can say what failed
        pass
    finally:
        extension_log.setLevel(level)


_COMPILE_TIME_MODULES = (
    "torch.distributed.tensor.experimental",
    "sympy.tensor.tensor",
    "torch.export._trace",
    "torch._inductor.codegen.memory_planning",
    "torch._inductor.codegen.pallas",
    "torch._inductor.compiler_bisector",
    "torch._inductor.codegen.cuda_combined_scheduling",
    "torch._inductor.codegen.wrapper_fxir",
    "torch._inductor.codegen.cpp_wrapper_gpu",
    "torch._inductor.codegen.halide",
)
"""What a compile imports beyond ``torch._inductor.compile_fx``, heaviest first: 0.19 s of imports
in each compiled trial's process, its graphs from the cache or not, on a 2-core CPU (read with
``python -X importtime`` around a warm compile of the ``llm`` preset's step)."""


def _prime_the_compiler_s_process_caches() -> None:
    """Do once what every compile does once in its process: hash torch's own sources into the key
    of the compiler's cache (``torch._inductor.codecache.torch_key``, 0.24-0.36 s on a 2-core CPU,
    cached in the process) and import what a compile imports (``_COMPILE_TIME_MODULES``). A warm
    compile took 2.4-2.7 s a process there, so this is about a sixth of it, in every compiled
    trial's processes. Neither touches a device nor starts a thread. A module that a torch version
    moved or lacks is left out: the worker imports what its compile needs."""
    try:
        from torch._inductor.codecache import torch_key

        torch_key()
    except Exception:  # noqa: BLE001 - the worker's compile computes it, and reports what failed
        pass
    _import_where_possible(_COMPILE_TIME_MODULES)


def _import_where_possible(names: Iterable[str]) -> None:
    """Import each of ``names`` where it can: one that fails (not in this version of its library,
    or raising as it is imported, ``SystemExit`` too) is left for the worker to meet and report,
    where its trial can say what failed; a server that fails to start would fail every trial."""
    import importlib

    for name in names:
        try:
            importlib.import_module(name)
        except BaseException:  # noqa: BLE001 - the worker meets it, not the server
            pass


def _import_the_workload_s_modules() -> None:
    """Import the modules the study's workload names (``Workload.preload``, through
    ``worker_server.WORKER_IMPORTS``)."""
    from search.execution.worker_server import WORKER_IMPORTS

    _import_where_possible(n for n in os.environ.get(WORKER_IMPORTS, "").split(",") if n)


_import_the_compiler()
_probe_the_cpu_s_vector_instructions()
_prime_the_compiler_s_process_caches()
_import_the_workload_s_modules()
