"""What one invocation carries: its settings, space and device, its terminal, and where its time
went.

Every step of a tuning or a re-tune (``search.commands.tune``) reads one ``Context``; ``Spent``
adds up the wall time those steps take, for the time budget (docs/method/time.md).
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from search.analysis.diagnosis import Diagnosis, diagnose, doubling
from search.config.settings import Settings
from search.core.records import COMPLETE, TrialRecord
from search.execution.phases import PHASE_LABELS, timed_so_far_s
from search.execution.trial import TrialRequest
from search.measurement.peak import Peak
from search.space.search_space import SearchSpace
from search.study.driver import StudyDriver, repeat_run
from search.study.phase_time import SECOND_TIMED

__all__ = ["Context", "Spent"]


@dataclass(kw_only=True)
class Spent:
    """Where an invocation's wall time went, s: what the time budget (docs/method/time.md) is
    judged on."""

    started_s: float = field(default_factory=time.monotonic)
    new_s: float = 0.0
    """Measuring the configurations of this invocation's trials."""
    new_trials: int = 0
    control_s: float = 0.0
    baseline_s: float = 0.0
    """Re-measuring the baseline's recommendation and front (a re-tune)."""
    revalidation_s: float = 0.0
    confirmation_s: float = 0.0
    compile_s: float = 0.0
    """Of ``new_s``, compiling: each compiled trial's first process and its second."""
    cold_compiles: int = 0
    """Compiled trials whose graphs were not in the compiler's cache: one per new shape and mode."""
    warm_compiles: int = 0
    timed_before_s: float = field(default_factory=timed_so_far_s)
    """The process's timed windows before this invocation (``timed_so_far_s``), s."""
    phases_s: dict[str, float] = field(default_factory=dict)
    """Of ``new_s``, each phase's (``search.execution.phases.PHASE_LABELS``): timed windows,
    warm-up, compile, build, the fidelity check, process start, second processes, ..."""

    def took(self, driver: StudyDriver) -> None:
        """Take the study driver's figures (after its last control run)."""
        self.new_s, self.control_s = driver.new_s, driver.control_s
        self.phases_s = dict(driver.phases.seconds)
        self.new_trials = len(driver.outcome.records)
        for record in driver.outcome.records:
            first, second = (
                record.metrics.get(k) for k in ("compile_time_s", "compile_time_warm_s")
            )
            self.compile_s += sum(t for t in (first, second) if t is not None)
            cold = first is not None and not record.metrics.get("compile_cache_warm", 0)
            self.cold_compiles += cold
            self.warm_compiles += (first is not None and not cold) + (second is not None)

    def line(self) -> str:
        total = time.monotonic() - self.started_s
        parts = [
            f"control runs {self.control_s:.0f} s",
            *([f"the baseline re-measured {self.baseline_s:.0f} s"] if self.baseline_s else []),
            f"re-validation {self.revalidation_s:.0f} s",
            f"confirmation {self.confirmation_s:.0f} s",
        ]
        named = (self.control_s, self.baseline_s, self.revalidation_s, self.confirmation_s)
        other = total - self.new_s - sum(named)
        compiling = (
            f", compiling {self.compile_s:.0f} s of it ({self.cold_compiles} cold, "
            f"{self.warm_compiles} from the cache)"
            if self.cold_compiles + self.warm_compiles
            else ""
        )
        return (
            f"time: {self.new_s / total:.0%} of {total:.0f} s measured {self.new_trials} new "
            f"configuration(s) ({self.new_s:.0f} s{compiling}){self._split(total)}; "
            f"{', '.join(parts)}, the rest {other:.0f} s (start-up, stores, files)"
        )

    def _split(self, total_s: float) -> str:
        """The new configurations' time by phase, and the share of the run in timed windows
        (with their warm-up): what a run spends measuring rather than waiting."""
        if not self.phases_s:
            return ""
        phases = self.phases_s
        second_timed = phases.get(SECOND_TIMED, 0.0)
        shown = [
            f"{label} {phases[name]:.0f} s"
            + (
                f" ({second_timed:.0f} s of it timed windows and warm-up)"
                if name == "second"
                else ""
            )
            for name, label in PHASE_LABELS.items()
            if phases.get(name, 0.0) >= 0.5
        ]
        timed = phases.get("windows", 0.0) + phases.get("warmup", 0.0) + second_timed
        return (
            f": {', '.join(shown)}; timed windows and their warm-up {self.timed_s() / total_s:.0%}"
            f" of the run ({timed / total_s:.0%} in the new configurations' own, the rest in "
            "control runs, re-validation and confirmation)"
        )

    def timed_s(self) -> float:
        """Every timed window and warm-up of this invocation's fresh processes, s: the new
        configurations', the control runs', re-validation's and confirmation's."""
        return timed_so_far_s() - self.timed_before_s

    def metrics(self) -> dict[str, float]:
        return {
            "time_total_s": time.monotonic() - self.started_s,
            "time_new_configurations_s": self.new_s,
            "time_control_s": self.control_s,
            "time_revalidation_s": self.revalidation_s,
            "time_confirmation_s": self.confirmation_s,
            "time_timed_windows_s": self.timed_s(),
            **(
                {"time_compiling_s": self.compile_s}
                if self.cold_compiles + self.warm_compiles
                else {}
            ),
            **({"time_baseline_s": self.baseline_s} if self.baseline_s else {}),
            **{f"time_trials_{name}_s": seconds for name, seconds in self.phases_s.items()},
        }


@dataclass(frozen=True, kw_only=True)
class Context:
    """What every step of one invocation reads: settings, the space, where it runs, the terminal."""

    settings: Settings
    space: SearchSpace
    device: torch.device
    env: Mapping[str, str]
    """The environment record (``search.measurement.environment.environment``) and this tool's
    version."""
    fingerprint: str
    out: Console
    control: Mapping[str, Any] | None
    """The control configuration (``search.config.prepare.control_config``); None: no control
    runs."""
    peaks: list[Peak] = field(default_factory=list)
    """The device's peak FLOP/s and bandwidth, for the regime diagnosis
    (``search.analysis.diagnosis``): as the invocation started, then each time a trial beat it
    and it was measured again or raised (``search.commands.callbacks``); the last is the one
    every diagnosis takes."""
    spent: Spent = field(default_factory=Spent)
    """Where this invocation's time went."""

    @property
    def peak(self) -> Peak | None:
        """The peak every diagnosis takes now: the last of ``peaks``."""
        return self.peaks[-1] if self.peaks else None

    def diagnosis(
        self, record: TrialRecord, history: Sequence[TrialRecord] = ()
    ) -> Diagnosis | None:
        """``record``'s regime on this device, with its batch-doubling pair from ``history``."""
        if self.peak is None or record.state != COMPLETE:
            return None
        precision = str(record.config.get("precision", "fp32"))
        return diagnose(record.metrics, precision, self.peak, doubling(record, history))

    def repeat(self, config: Mapping[str, Any]) -> TrialRequest:
        """The worker's request to measure ``config`` again (``search.study.driver.repeat_run``)."""
        return repeat_run(self.request(config), self.settings)

    def request(self, config: Mapping[str, Any]) -> TrialRequest:
        """The isolated worker's request to measure ``config``."""
        s = self.settings
        return TrialRequest(
            workload=self.space.workload,
            config=config,
            device=str(self.device),
            seed=s.seed,
            measure=s.measure,
            timeout_s=s.runner.timeout_s,
            memory_limit_mb=s.runner.memory_limit_mb,
            compile_cache_dir=str(self.compile_cache_dir()),
        )

    def study_dir(self) -> Path:
        """Where the study's files go: ``runs_dir/<study.name>``."""
        return Path(self.settings.runs_dir) / self.settings.study.name

    def compile_cache_dir(self) -> Path:
        """The compiler's cache of this device, under ``runs_dir``: every study on it shares it, and
        another device (another GPU model, a CPU) keeps its own."""
        device = f"{self.env.get('device_name', '')}-{self.device}"
        return Path(self.settings.runs_dir) / "compile-cache" / re.sub(r"[^\w.-]+", "_", device)
