"""What the launch recipes in ``examples/cluster/`` share: one worker pinned to one GPU, and the
summary run after every worker.

A worker is the ordinary command with re-validation and confirmation runs left to the summary
(``revalidate.processes=0 retune.confirm=0``); the summary proposes nothing new
(``study.n_trials=0``): it re-validates and summarises every worker's trials. The engine (SLURM
through submitit, Ray, a shell loop) only decides where each worker runs and which GPUs it sees.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence

__all__ = ["SUMMARY", "WORKER", "pin", "run"]

WORKER = ("revalidate.processes=0", "retune.confirm=0")
SUMMARY = ("study.n_trials=0",)


def pin(rank: int, env: Mapping[str, str]) -> dict[str, str]:
    """The environment of the worker of local rank ``rank``: where the engine shows it more than
    one GPU (submitit's local executor, a SLURM task without --gpus-per-task), it sees only the
    ``rank``-th, as ``cuda:0``; one GPU or none is left as it is."""
    out = dict(env)
    visible = [g.strip() for g in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
    if len(visible) > 1:
        if rank >= len(visible):
            raise ValueError(
                f"worker {rank} has no GPU of its own: {len(visible)} visible "
                f"({','.join(visible)}); start at most one worker per GPU"
            )
        out["CUDA_VISIBLE_DEVICES"] = visible[rank]
    return out


def run(overrides: Sequence[str], *, summary: bool = False, rank: int = 0, name: str = "") -> int:
    """Run the command as a worker (or as the summary) in a child process with this process's
    output, pinned as :func:`pin` says; returns its exit code. ``name`` names it in the first
    line it prints (default: worker RANK, or summary)."""
    env = pin(rank, os.environ)
    role = name or ("summary" if summary else f"worker {rank}")
    gpu = env.get("CUDA_VISIBLE_DEVICES", "")
    print(f"{role} on {socket.gethostname()}, CUDA_VISIBLE_DEVICES={gpu or '(unset)'}", flush=True)
    argv = [sys.executable, "-m", "search", *overrides, *(SUMMARY if summary else WORKER)]
    return subprocess.run(argv, env=env, preexec_fn=_stop_with_parent).returncode


def _stop_with_parent() -> None:
    """The command is stopped (SIGTERM: it stops cleanly) when the engine's process that started
    it dies, even by SIGKILL (a Ray worker killed, a SLURM task ended), so that it does not keep
    the GPU while the engine starts another worker on it. Linux only; elsewhere nothing."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
