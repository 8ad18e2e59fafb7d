"""The conclusion of a re-tune: the recommendation moves only when the optimum surely moved, and
``best.yaml`` holds the confirmed figure of the configuration that stays recommended."""

from __future__ import annotations

import math
from dataclasses import replace
from io import StringIO

import numpy as np
import optuna
import pytest
import yaml
from factories import cpu_context, noise_floor

import search.commands.conclusion
from search.commands.conclusion import conclude_tuning
from search.commands.finish import Finished
from search.core.records import TrialRecord
from search.reporting.report import write_best
from search.retuning.confirm import Confirmed
from search.retuning.figure import Figure
from search.retuning.tuned import RETUNE, TUNE, Tuned, tuned_runs
from search.retuning.verdict import MOVED, SAME
from search.space.parse import parse_space

SPACE = parse_space(
    "s",
    {
        "workload": {"_target_": "x"},
        "params": {"precision": {"type": "categorical", "choices": ["fp32", "bf16"]}},
        "objectives": {"throughput": "maximize"},
    },
)
OLD, NEW = {"precision": "fp32"}, {"precision": "bf16"}


class Tracker:
    """What the conclusion logs on the parent run."""

    parent_id = "parent"

    def __init__(self) -> None:
        self.tags: dict[str, str] = {}
        self.metrics: dict[str, float] = {}
        self.artifacts: list[str] = []

    def log_metrics(self, run_id: str, metrics: dict[str, float]) -> None:
        self.metrics.update(metrics)

    def set_tags(self, run_id: str, tags: dict[str, str]) -> None:
        self.tags.update(tags)

    def log_artifact(self, path) -> None:
        self.artifacts.append(str(path))

    def describe(self, run_id: str, text: str) -> None:
        pass


def runs(value: float) -> list[float]:
    """Six fresh runs within ±2% of ``value``."""
    return [value * math.exp(x) for x in np.linspace(-0.02, 0.02, 6)]


def trial(number: int, config: dict, throughput: float) -> TrialRecord:
    return TrialRecord(
        number=number,
        config=config,
        state="complete",
        metrics={
            "throughput": throughput,
            "throughput_ci_low": 0.98 * throughput,
            "throughput_ci_high": 1.02 * throughput,
        },
        stable=True,
        unit="tokens",
        run_id=f"run{number}",
    )


@pytest.mark.parametrize(
    "new_over_old, old_stable, kept",
    [(1.02, True, True), (1.30, True, False), (1.02, False, False)],
)
def test_a_retune_moves_the_recommendation_only_when_the_new_one_is_surely_faster(
    tmp_path, monkeypatch, new_over_old, old_stable, kept
):
    """The search's best (bf16, trial #3) against the old recommendation (fp32, trial #1), both
    confirmed in the same rounds: 2% faster (within the 5% threshold) keeps fp32; 30% moves; and
    an old one that is no longer stable today is not kept, however near."""
    text = StringIO()
    ctx = cpu_context(tmp_path, SPACE, text)
    old_trial, new_trial = trial(1, OLD, 100.0), trial(3, NEW, 100.0 * new_over_old)
    old_trial = replace(old_trial, stable=old_stable)
    # a figure only the search's best has (a compiled trial's two processes)
    new_trial = replace(new_trial, metrics={**new_trial.metrics, "compile_processes": 2.0})
    base = Tuned(
        kind=TUNE,
        name="tune 1",
        time_s=1.0,
        fingerprint="f",
        env={"device_name": "a cpu"},
        device="a cpu",
        unit="tokens",
        recommended=Figure.measured(OLD, runs(100.0)),
    )
    confirmed = Confirmed(
        [Figure.measured(NEW, runs(100.0 * new_over_old)), Figure.measured(OLD, runs(100.0))], []
    )
    monkeypatch.setattr(search.commands.conclusion, "confirm", lambda *a, **k: confirmed)
    ctx.study_dir().mkdir(parents=True)
    write_best(ctx.study_dir() / "best.yaml", new_trial, {"space": "s"})
    (ctx.study_dir() / "summary.md").write_text("# s\n\nrecommended: #3\n")
    finished = Finished(
        front=[new_trial, old_trial],
        best=new_trial,
        records=[old_trial, new_trial],
        floor=noise_floor(0.02),
        unit="tokens",
    )
    study = optuna.create_study(directions=["maximize"])
    tracker = Tracker()

    assert conclude_tuning(ctx, study, tracker, base, finished) == 0

    today = tuned_runs(study)[-1]
    best = yaml.safe_load((ctx.study_dir() / "best.yaml").read_text())
    assert today.kind == RETUNE and today.recommended is not None
    assert best["confirmed"]["fresh_runs"] == 6
    assert tracker.tags["recorded_as"] == today.name
    if not kept:
        assert today.recommended.config == NEW and today.verdict == (
            MOVED if new_over_old > 1.05 else SAME
        )
        assert best["recommended"]["config"] == NEW and "kept_over" not in best
        assert best["confirmed"]["throughput"] == pytest.approx(100 * new_over_old, rel=0.01)
        assert "kept the old" not in text.getvalue()
        assert "## Kept" not in (ctx.study_dir() / "summary.md").read_text()
    else:
        assert today.verdict == SAME and today.recommended.config == OLD
        assert today.recommended.trial == 1 and tracker.tags["best_trial"] == "1"
        assert best["recommended"] == {"trial": 1, "mlflow_run_id": "run1", "config": OLD}
        assert best["kept_over"]["config"] == NEW and best["kept_over"]["trial"] == 3
        assert best["metrics"]["throughput"] == 100.0  # the kept trial's, not the search's best
        assert tracker.tags["kept_over_trial"] == "3"
        # the parent run's best_* figures are the kept trial's alone
        assert tracker.metrics["best_throughput"] == 100.0
        assert math.isnan(tracker.metrics["best_compile_processes"])
        assert best["confirmed"]["throughput"] == pytest.approx(100.0, rel=0.01)
        assert (
            "kept the old recommendation #1 (precision=fp32): the search's best #3 read 1.0"
            in text.getvalue()
        )
        summary = (ctx.study_dir() / "summary.md").read_text()
        assert "## Kept\n\nThe old recommendation #1 (precision=fp32) stays recommended" in summary
        report = next((ctx.study_dir() / "retune").glob("*.md")).read_text()
        assert "The old recommendation was kept" in report


def test_the_front_says_whose_figures_it_shows():
    """Pooled where re-validation or a re-tune's re-measured baseline measured them (whatever
    ``revalidate.processes`` says), the search's own where nothing did, or some of each."""
    from search.commands.finish import _whose_figures
    from search.revalidation.pooling import Pooled

    front = [trial(1, OLD, 100.0), trial(3, NEW, 120.0)]

    def pooled(n: int) -> Pooled:
        return Pooled(metrics={}, stable=True, reason="", runs=(None,) * n)  # type: ignore[arg-type]

    assert _whose_figures(front, {}) == " (search-time figures)"
    assert _whose_figures(front, {1: pooled(4), 3: pooled(4)}) == (
        " (figures pooled from 4 fresh processes each)"
    )
    assert _whose_figures(front, {3: pooled(2)}) == (
        " (1 of 2 with figures pooled from 2 fresh processes each, the rest search-time figures)"
    )
    assert "from 2-4 fresh" in _whose_figures(front, {1: pooled(4), 3: pooled(2)})
