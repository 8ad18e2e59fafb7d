"""Imported only by the fork server that starts trial workers (``isolation.worker_context``).

It ties the server's life to the study process that started it, then imports what every trial
needs, so a worker forked from the server starts with torch already imported. The server would
otherwise outlive a study killed with ``kill -9``: each worker it forks keeps the study's end of
the server's liveness pipe open, and a hung worker would keep both alive. With the server killed
with the study, every worker (killed with its parent, the server) goes too.
"""

from __future__ import annotations

import os

from search.execution.isolation import die_with_parent

die_with_parent()


def _import_the_compiler() -> None:
    """Import ``torch._dynamo`` here, once: torch's optimizers import it when the first one is
    built (``torch._compile``), which every trial does, so each worker would pay 1-1.5 s for it on
    a 2-core CPU. Meanwhile CUDA availability is asked through NVML (none is asked today), which
    cannot initialise CUDA in the server: a forked worker could then not use CUDA."""
    name = "PYTORCH_NVML_BASED_CUDA_CHECK"
    before = os.environ.get(name)
    os.environ[name] = "1"
    try:
        import torch._dynamo  # noqa: F401
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before


_import_the_compiler()
