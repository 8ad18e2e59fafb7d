"""The nightly re-tune: verdicts on figures with known answers, and the real command on a synthetic
workload whose step time is set (``tests/retune_space/slowdown.py``): unchanged, 30% slower, and
with its optimum moved.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import optuna
import pytest

from search.config import ConfigError
from search.retune import (
    AMBIGUOUS,
    IMPROVED,
    MOVED,
    REGRESSION,
    SAME,
    Figure,
    Tuned,
    baseline,
    compare,
    conclude,
    save_tuned,
    tuned_runs,
)

REPO = Path(__file__).resolve().parents[1]
A = {"micro_batch_size": 4, "precision": "fp32"}
B = {"micro_batch_size": 4, "precision": "bf16"}


def fig(value: float, rel: float = 0.02, config=A) -> Figure:
    """A figure whose 95% interval is ± ``rel``."""
    return Figure(dict(config), value, value * (1 - rel), value * (1 + rel))


def tuned(best: Figure | None, name: str = "tune 1", time_s: float = 1.0, **kw) -> Tuned:
    return Tuned(
        kw.pop("kind", "tune"),
        name,
        time_s,
        kw.pop("fingerprint", "fp"),
        kw.pop("env", {"device_name": "cpu"}),
        "cpu",
        "samples",
        best,
        (best,) if best is not None else (),
        **kw,
    )


@pytest.mark.parametrize(
    "today, label",
    [
        (fig(120), "FASTER"),
        (fig(80), "SLOWER"),
        (fig(100, 0.01), "SAME"),
        (fig(100, 0.2), "AMBIGUOUS"),
    ],
)
def test_a_comparison_is_labelled_by_where_its_interval_lies(today, label):
    c = compare("x", today, fig(100, 0.01), threshold=0.05)
    assert c.label == label
    assert c.low < c.ratio < c.high
    assert c.ratio == pytest.approx(today.throughput / 100)


def test_the_interval_of_a_ratio_holds_both_sides_uncertainty():
    narrow = compare("x", fig(100, 0.01), fig(100, 0.01), 0.05)
    one_wide = compare("x", fig(100, 0.05), fig(100, 0.01), 0.05)
    both_wide = compare("x", fig(100, 0.05), fig(100, 0.05), 0.05)
    assert narrow.high < one_wide.high < both_wide.high


@pytest.mark.parametrize(
    "base_best, today_best, old_today, verdict",
    [
        (fig(100), fig(80), fig(80), REGRESSION),  # 20% slower, surely
        (fig(100, 0.005), fig(97, 0.005), fig(97, 0.005), SAME),  # slower, within the threshold
        (fig(100), fig(90, 0.2), fig(90, 0.2), AMBIGUOUS),  # maybe 10% slower: not sure
        (fig(100), fig(130), fig(130), IMPROVED),
        (fig(100), fig(100, config=B), fig(60), MOVED),  # A fell, B took its place
        (fig(100), None, fig(100), REGRESSION),  # nothing stable to recommend today
    ],
)
def test_each_verdict(base_best, today_best, old_today, verdict):
    conclusion = conclude(tuned(base_best), tuned(today_best, "retune 2"), old_today, 0.05)
    assert conclusion.verdict == verdict
    assert conclusion.exit_code == (3 if verdict == REGRESSION else 0)
    assert conclusion.line.startswith(f"retune: {verdict.upper()}: ")
    assert "\n" not in conclusion.line


def test_what_changed_names_the_model_the_environment_and_the_machine():
    base = tuned(fig(100), env={"torch": "2.12", "load_average_1min": "0.1"}, reference=fig(50))
    today = tuned(
        fig(100),
        fingerprint="other",
        env={"torch": "2.13", "load_average_1min": "3.0"},
        reference=fig(40),
    )
    changed = conclude(base, today, fig(100), 0.05).changed
    assert any(c.startswith("workload: fingerprint") for c in changed)
    assert "environment: torch '2.12' -> '2.13'" in changed
    assert not any("load_average" in c for c in changed), "noise of an unchanged machine"
    assert any(c.startswith("machine: the reference step is slower") for c in changed)


def test_the_baseline_is_the_last_run_with_a_recommendation_or_the_one_named():
    study = optuna.create_study()
    with pytest.raises(ConfigError, match="run the tuning first"):
        baseline(study, "last", "cpu")
    save_tuned(study, tuned(fig(100), "tune 1", 1.0))
    save_tuned(study, tuned(fig(90), "retune 2", 2.0, kind="retune", verdict=SAME))
    save_tuned(study, tuned(None, "retune 3", 3.0, kind="retune"))  # nothing to recommend
    assert [t.name for t in tuned_runs(study)] == ["tune 1", "retune 2", "retune 3"]
    assert baseline(study, "last", "cpu").name == "retune 2"
    assert baseline(study, "tune 1", "cpu").recommended == fig(100)
    with pytest.raises(ConfigError, match="names no run"):
        baseline(study, "tune 9", "cpu")
    with pytest.raises(ConfigError, match="no tuning on cuda"):
        baseline(study, "last", "cuda")


# -- the real command ------------------------------------------------------------------------

SPACE = [
    "--config-dir",
    str(REPO / "tests" / "retune_space"),
    "+space=slowdown",
    "device=cpu",
    "measure.warmup_s=0.1",
    "measure.window_s=0.05",
    "measure.min_windows=3",
    "measure.max_time_s=1",
    "study.sampler=random",
    "revalidate.processes=2",
    "retune.remeasure=1",
    "retune.reference_runs=0",  # the verdicts on within-run noise: the sleep workload is steady
    "retune.processes=2",
    "study.n_trials=4",
]


def search(*args: str, runs_dir: Path, code: int = 0) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO / "tests" / "retune_space"), str(REPO)]),
    }
    result = subprocess.run(
        [sys.executable, "-m", "search", *args, f"runs_dir={runs_dir}"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == code, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result


def test_retune_without_a_tuning_exits_2_in_one_line(tmp_path):
    result = search("retune", *SPACE, runs_dir=tmp_path / "runs", code=2)
    assert result.stderr.count("\n") == 1 and "run the tuning first" in result.stderr
    assert not (tmp_path / "runs").exists()


def test_a_retune_says_same_regression_or_moved_and_exits_accordingly(tmp_path):
    runs_dir = tmp_path / "runs"
    search(*SPACE, runs_dir=runs_dir)

    same = search("retune", *SPACE, "retune.n_trials=1", runs_dir=runs_dir)
    line = same.stdout.strip().splitlines()[-1]
    assert line.startswith("retune: SAME") or line.startswith("retune: AMBIGUOUS"), same.stdout
    assert "old recommendation, today vs baseline" in same.stdout
    study_dir = runs_dir / "slowdown-cpu"
    reports = sorted((study_dir / "retune").glob("*.json"))
    assert len(reports) == 1 and json.loads(reports[0].read_text())["verdict"] in (SAME, AMBIGUOUS)

    slower = search(
        "retune",
        *SPACE,
        "retune.n_trials=1",
        "space.workload.factor=1.3",
        runs_dir=runs_dir,
        code=3,
    )
    verdict = slower.stdout.strip().splitlines()[-1]
    assert verdict.startswith("retune: REGRESSION: best 0."), verdict
    # 1/1.3 of the sleep, plus the step's own fixed cost: well below 1, not exactly 0.77
    assert 0.7 < float(verdict.split("best ")[1].split("x")[0]) < 0.9, verdict
    assert "changed: workload: fingerprint" in slower.stdout

    # Back to the first speed, but bf16 is now the fast precision: the optimum moves to it.
    moved = search(
        "retune",
        *SPACE,
        "retune.n_trials=3",
        "space.workload.factor=1.3",
        "space.workload.fast=bf16",
        runs_dir=runs_dir,
    )
    assert moved.stdout.strip().splitlines()[-1].startswith("retune: MOVED"), moved.stdout
    assert "today's recommendation vs the old one, both today: FASTER" in moved.stdout

    with (study_dir / "history.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [r["verdict"] for r in rows][1:] == [rows[1]["verdict"], REGRESSION, MOVED]
    assert json.loads(rows[-1]["config"])["precision"] == "bf16"
    assert json.loads(rows[0]["config"])["precision"] == "fp32"
    assert (study_dir / "history.png").stat().st_size > 0

    history = search("history", *SPACE, runs_dir=runs_dir)
    assert "regression" in history.stdout and "moved" in history.stdout


def test_the_best_at_the_same_machine_speed_divides_out_the_reference_step():
    machine_slower = conclude(
        tuned(fig(100), reference=fig(50, 0.01)),
        tuned(fig(80), "retune 2", reference=fig(40, 0.01)),  # the reference step lost 20% too
        fig(80),
        0.05,
    )
    adjusted = machine_slower.comparisons[-1]
    assert adjusted.what == "best, today vs baseline, at the same machine speed"
    assert adjusted.ratio == pytest.approx(1.0) and adjusted.low < 1 < adjusted.high
    assert any(
        c.startswith("machine: the reference step is slower") for c in machine_slower.changed
    )


def test_the_machines_run_to_run_variance_comes_from_the_reference_step_of_every_run():
    from search.retune import Sessions

    steady = Sessions.of([fig(100, 0.01), fig(100.5, 0.01), fig(99.5, 0.01)])
    assert steady is not None and steady.variance == 0.0 and steady.df == 2
    moving = Sessions.of([fig(100, 0.01), fig(115, 0.01), fig(88, 0.01), fig(104, 0.01)])
    assert moving is not None and moving.df == 3
    assert 0.09 < moving.variance**0.5 < 0.15  # log-scale spread of 100, 115, 88, 104
    assert Sessions.of([fig(100)]) is None, "one run tells nothing of the next"


def test_a_slowdown_within_what_the_machine_moves_between_runs_is_not_a_regression():
    from search.retune import Sessions

    moving = Sessions.of([fig(100, 0.01), fig(115, 0.01), fig(88, 0.01), fig(104, 0.01)])
    base, today = tuned(fig(100)), tuned(fig(88), "retune 2")
    assert conclude(base, today, fig(88), 0.05).verdict == REGRESSION, "within-run noise alone"
    assert conclude(base, today, fig(88), 0.05, sessions=moving).verdict == AMBIGUOUS
    steady = Sessions.of([fig(100, 0.01), fig(100.5, 0.01), fig(99.5, 0.01), fig(100, 0.01)])
    assert conclude(base, tuned(fig(80), "r"), fig(80), 0.05, sessions=steady).verdict == REGRESSION
