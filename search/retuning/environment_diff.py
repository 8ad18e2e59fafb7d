"""The environment diff: what changed between the baseline and today (the workload, the
environment's fields, the software, the machine's speed)."""

from __future__ import annotations

from collections.abc import Sequence

from search.retuning.comparison import MIN_RUNS, Comparison
from search.retuning.tuned import Tuned

__all__ = ["SOFTWARE_ENV", "VOLATILE_ENV", "machine_lines", "software_changes", "what_changed"]

VOLATILE_ENV = {"load_average_1min", "started", "gpu_sm_clock_mhz", "gpu_mem_clock_mhz"}
"""Environment fields that differ from run to run on an unchanged machine (readings)."""
SOFTWARE_ENV = (
    "torch",
    "python",
    "cuda",
    "cudnn",
    "gpu_driver",
    "platform",
    "search_version",
    "search_git_commit",
)
"""The software the reference step runs on as well as the model: when one of these changed, a
slower reference step is no evidence of a slower machine. The working directory's commit is the
model's side (what a re-tune is for), the host and the CPU or GPU the machine's."""


def _differing(base: Tuned, today: Tuned) -> list[str]:
    return [
        key
        for key in sorted(set(base.env) | set(today.env))
        if key not in VOLATILE_ENV and base.env.get(key) != today.env.get(key)
    ]


def software_changes(base: Tuned, today: Tuned) -> list[str]:
    """The software fields (``SOFTWARE_ENV``) that differ from the baseline."""
    return [key for key in _differing(base, today) if key in SOFTWARE_ENV]


def what_changed(base: Tuned, today: Tuned) -> list[str]:
    """What differs from the baseline: the workload and each environment field (the machine's
    speed is added by ``conclude``)."""
    changed = []
    if base.fingerprint != today.fingerprint:
        changed.append(
            f"workload: fingerprint {base.fingerprint[:12]} -> {today.fingerprint[:12]} (the "
            "model's source or settings, the device or torch)"
        )
    for key in _differing(base, today):
        changed.append(f"environment: {key} {base.env.get(key)!r} -> {today.env.get(key)!r}")
    return changed


def machine_lines(
    machine: Comparison | None,
    software: Sequence[str],
    base: Tuned,
    today: Tuned,
    betas: tuple[float, float, float] = (0.0, 0.0, 1.0),
) -> list[str]:
    """What the reference step says of the machine, and whether the verdict uses it."""
    if machine is None:
        missing = [
            who
            for who, t in (("the baseline", base), ("today", today))
            if t.recommended is None or len(t.recommended.references) < MIN_RUNS
        ]
        return [
            f"machine: not compared ({' and '.join(missing)} measured no reference step): a "
            "slower machine reads as a slower model"
        ]
    figures = f"({machine.ratio:.3f}x [{machine.low:.3f}, {machine.high:.3f}])"
    line = (
        f"machine: the reference step is {machine.label.lower()} {figures}; the workload follows "
        f"it with sensitivity {betas[0]:.2f} [{betas[1]:.2f}, {betas[2]:.2f}] (0: not at all, 1: "
        "in full; 95% CI)"
    )
    if software:
        return [
            f"{line}; the software changed ({', '.join(software)}) and the reference step runs on "
            "it too, so the verdict rests on the ratio as measured"
        ]
    if machine.label in ("SLOWER", "FASTER"):
        return [f"{line}: the machine's own speed changed; the verdict holds it"]
    return [line]
