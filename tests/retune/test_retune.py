"""The nightly re-tune: verdicts on figures with known answers, and the real command on a synthetic
workload whose step time is set (``tests/retune_space/slowdown.py``): unchanged, 30% slower, and
with its optimum moved.
"""

from __future__ import annotations

import csv
import json
import math
import subprocess
from pathlib import Path

import numpy as np
import optuna
import pytest
from invoke import search as invoke_search  # tests/ is on sys.path

from search.core.errors import ConfigError
from search.retuning.comparison import (
    compare,
    runs_needed,
    sensitivity,
    sensitivity_interval,
    shift,
)
from search.retuning.figure import Figure
from search.retuning.tuned import Tuned, baseline, save_tuned, tuned_runs
from search.retuning.verdict import AMBIGUOUS, IMPROVED, MOVED, REGRESSION, SAME, conclude
from search.revalidation.pooling import FreshRuns

REPO = Path(__file__).resolve().parents[2]
A = {"micro_batch_size": 4, "precision": "fp32"}
B = {"micro_batch_size": 4, "precision": "bf16"}


def runs(value: float, rel: float = 0.02, n: int = 6) -> list[float]:
    """``n`` fresh-run figures spread evenly over ``value`` · e^[-rel, rel]."""
    return [value * math.exp(x) for x in np.linspace(-rel, rel, n)]


def fig(value: float, rel: float = 0.02, config=A, refs: list[float] | None = None) -> Figure:
    return Figure.measured(config, runs(value, rel), refs or ())


def tuned(best: Figure | None, name: str = "tune 1", time_s: float = 1.0, **kw) -> Tuned:
    return Tuned(
        kind=kw.pop("kind", "tune"),
        name=name,
        time_s=time_s,
        fingerprint=kw.pop("fingerprint", "fp"),
        env=kw.pop("env", {"device_name": "cpu"}),
        device="cpu",
        unit="samples",
        recommended=best,
        front=(best,) if best is not None else (),
        **kw,
    )


@pytest.mark.parametrize(
    "today, label",
    [
        (120, "FASTER"),
        (80, "SLOWER"),
        (100, "SAME"),
        (100, "AMBIGUOUS"),
    ],
)
def test_a_comparison_is_labelled_by_where_its_interval_lies(today, label):
    spread = 0.2 if label == "AMBIGUOUS" else 0.01
    c = compare("x", runs(today, spread), runs(100, 0.01), threshold=0.05)
    assert c.label == label
    assert c.low < c.ratio < c.high
    assert c.ratio == pytest.approx(today / 100)
    assert c.runs == (6, 6)


def test_the_interval_of_a_ratio_holds_both_sides_spread():
    narrow = compare("x", runs(100, 0.01), runs(100, 0.01), 0.05)
    one_wide = compare("x", runs(100, 0.05), runs(100, 0.01), 0.05)
    both_wide = compare("x", runs(100, 0.05), runs(100, 0.05), 0.05)
    assert narrow.high < one_wide.high < both_wide.high


def test_the_interval_covers_the_true_ratio_at_its_level():
    rng = np.random.default_rng(0)
    covered = sum(
        low < 1 < high
        for low, high in (
            shift(np.exp(rng.normal(0, 0.08, 6)), np.exp(rng.normal(0, 0.08, 6)))[1:]
            for _ in range(200)
        )
    )
    assert 0.9 <= covered / 200 <= 1.0  # 95.9% nominal: 6 and 6 runs attain no finer level


def test_too_few_runs_tell_nothing():
    ratio, low, high = shift(runs(80, 0.01, 3), runs(100, 0.01, 3))
    assert low == 0 and high == math.inf, "3 and 3 runs cannot reject anything at 5%"


def test_a_run_at_half_speed_neither_hides_a_regression_nor_makes_one():
    # One process whose threads shared a core: ranks move by one step, means by a lot
    slower_with_outlier = [*runs(90, 0.01, 5), 45.0]
    assert compare("x", slower_with_outlier, runs(100, 0.01), 0.05).label == "SLOWER"
    same_with_outlier = [*runs(100, 0.01, 5), 50.0]
    c = compare("x", same_with_outlier, runs(100, 0.01), 0.05)
    assert c.label != "SLOWER" and c.ratio == pytest.approx(1.0, abs=0.02)


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
    base = tuned(fig(100, refs=runs(50, 0.01)), env={"torch": "2.12", "load_average_1min": "0.1"})
    today = tuned(
        fig(100, refs=runs(40, 0.01)),
        fingerprint="other",
        env={"torch": "2.13", "load_average_1min": "3.0"},
    )
    changed = conclude(base, today, fig(100), 0.05).changed
    assert any(c.startswith("workload: fingerprint") for c in changed)
    assert "environment: torch '2.12' -> '2.13'" in changed
    assert not any("load_average" in c for c in changed), "noise of an unchanged machine"
    assert any(c.startswith("machine: the reference step is slower") for c in changed)


def test_a_slower_machine_is_not_blamed_on_the_model():
    # The reference step lost 20%, and so did the model: at the same machine speed, no change
    machine_slower = conclude(
        tuned(fig(100, refs=runs(50, 0.01))),
        tuned(fig(80, refs=runs(40, 0.01)), "retune 2"),
        fig(80),
        0.05,
    )
    assert machine_slower.verdict == SAME
    assert machine_slower.gate is not None and machine_slower.gate.ratio == pytest.approx(1.0)
    assert machine_slower.gate.what == "best, today vs baseline, at the same machine speed"
    assert "at the same machine speed" in machine_slower.line
    # The model lost 20% on a steady machine: a regression
    model_slower = conclude(
        tuned(fig(100, refs=runs(50, 0.01))),
        tuned(fig(80, refs=runs(50, 0.01)), "retune 2"),
        fig(80),
        0.05,
    )
    assert model_slower.verdict == REGRESSION
    assert model_slower.line.startswith("retune: REGRESSION: best 0.800x [")
    assert "at the same machine speed" in model_slower.line
    # A reference step that sped up alone does not make an unchanged model a regression
    reference_faster = conclude(
        tuned(fig(100, refs=runs(50, 0.01))),
        tuned(fig(100, refs=runs(60, 0.01)), "retune 2"),
        fig(100),
        0.05,
    )
    assert reference_faster.verdict not in (REGRESSION, IMPROVED)
    # A faster moment of the machine alone does not make an unchanged model faster
    lucky = conclude(
        tuned(fig(100, refs=runs(50, 0.05))),
        tuned(fig(106, refs=runs(53, 0.05)), "retune 2"),
        fig(106),
        0.05,
    )
    assert lucky.verdict not in (IMPROVED, REGRESSION)
    # The model lost 20% while the machine got 20% slower too: the model is blamed for its own
    # part only, which is still a regression
    both = conclude(
        tuned(fig(100, refs=runs(50, 0.01))),
        tuned(fig(64, refs=runs(40, 0.01)), "retune 2"),
        fig(64),
        0.05,
    )
    assert both.verdict == REGRESSION, "0.8 at the same machine speed, and 0.64 as measured"


def test_an_ambiguous_verdict_with_runs_enough_says_the_change_is_near_the_threshold():
    # 0.964x with little spread and 8 runs a side: the interval is narrow enough, but reaches
    # below 0.95 (the hint once said "needs about 5 runs a side" of 8)
    hint = runs_needed(runs(96.4, 0.06, 8), runs(100, 0.06, 8), 0.05)
    assert hint.startswith("near the threshold: ") and "(0.964x)" in hint


def test_the_sensitivity_is_how_much_the_workload_follows_the_reference_step():
    refs = runs(50, 0.1)
    follows = Figure.measured(A, [r * 2 for r in refs], refs)
    assert sensitivity(follows) == pytest.approx(1.0)
    half = Figure.measured(A, [100 * (r / 50) ** 0.5 for r in refs], refs)
    assert sensitivity(half) == pytest.approx(0.5)
    # runs that do not move with the reference step (a sleeping workload)
    ignores = Figure.measured(A, [100.0, 101.0, 99.0, 100.0, 101.0, 99.0], refs[::-1])
    assert sensitivity(ignores) < 0.1
    assert sensitivity(Figure.measured(A, runs(100), [50.0] * 6)) == 0.0  # a steady reference


def test_a_steady_workload_is_not_corrected_by_a_noisy_reference_step():
    # The model got 10% slower; the reference step spread by 15% on both nights and does not
    # drive the workload. Dividing by it in full would add its spread and hide the slowdown.
    rng = np.random.default_rng(1)

    def night(level: float) -> Figure:
        refs = list(50 * np.exp(rng.normal(0, 0.15, 8)))
        return Figure.measured(A, list(level * np.exp(rng.normal(0, 0.01, 8))), refs)

    base, today = night(100), night(90)
    conclusion = conclude(tuned(base), tuned(today, "retune 2"), today, 0.05)
    assert conclusion.verdict == REGRESSION
    assert any("sensitivity 0.0" in c for c in conclusion.changed)


def test_the_sensitivity_interval_is_narrow_only_where_the_runs_pin_the_slope_down():
    refs = runs(50, 0.1)
    assert sensitivity_interval(Figure.measured(A, [r * 2 for r in refs], refs)) == pytest.approx(
        (1.0, 1.0, 1.0)
    )
    assert sensitivity_interval(Figure.measured(A, runs(100), [50.0] * 6)) == (0.0, 0.0, 1.0)
    # four runs a night of a workload that does not follow the reference: the slope is unknown
    estimate, low, high = sensitivity_interval(
        Figure.measured(A, [1140.0, 1160.0, 1000.0, 1110.0], [13.6, 12.5, 14.1, 14.4]),
        Figure.measured(A, [1250.0, 1330.0, 1270.0, 1310.0], [16.0, 16.6, 15.8, 16.4]),
    )
    assert estimate == 0.0 and low == 0.0 and high > 0.5  # 0.72


def test_a_machine_that_slowed_is_no_regression_where_the_sensitivity_is_unknown():
    # An unchanged sleeping workload read 0.842x of its baseline on a night the reference step
    # read 0.837x; its runs did not follow the reference within either night (sensitivity 0.00
    # [0, 0.72] here), so uncorrected it was called a regression. At 0.72 it reads 0.96x.
    base = Figure.measured(A, [1250.0, 1330.0, 1270.0, 1310.0], [16.0, 16.6, 15.8, 16.4])
    today = Figure.measured(A, [1140.0, 1160.0, 1000.0, 1110.0], [13.6, 12.5, 14.1, 14.4])
    conclusion = conclude(tuned(base), tuned(today, "retune 2"), today, 0.1)
    assert conclusion.verdict == AMBIGUOUS
    assert conclusion.hint.startswith("the machine's speed moved too"), conclusion.hint
    assert any("sensitivity 0.00 [0.00, 0.72]" in c for c in conclusion.changed)
    # the same slowdown on a night the machine kept its speed is the model's
    steady = Figure.measured(A, [1140.0, 1160.0, 1000.0, 1110.0], [16.0, 16.6, 15.8, 16.4])
    assert conclude(tuned(base), tuned(steady, "retune 2"), steady, 0.1).verdict == REGRESSION


def test_only_software_changes_turn_the_machine_speed_off():
    refs = runs(50, 0.01)
    base_env = {"device_name": "cpu", "workdir_git_commit": "a", "gpu_sm_clock_mhz": "1980"}
    today_env = {"device_name": "cpu", "workdir_git_commit": "b", "gpu_sm_clock_mhz": "1755"}
    # the model's commit changed (what a re-tune is for) and the machine is 20% slower
    conclusion = conclude(
        tuned(fig(100, refs=refs), env=base_env),
        tuned(fig(80, refs=[r * 0.8 for r in refs]), "retune 2", env=today_env),
        fig(80),
        0.05,
    )
    assert conclusion.verdict == SAME, "the machine's slowdown is not blamed on the model"
    assert "environment: workdir_git_commit 'a' -> 'b'" in conclusion.changed
    assert not any("clock" in c for c in conclusion.changed), "a reading, not a change"
    # torch changed: the reference step runs on it too, so the ratio as measured decides
    torch_changed = conclude(
        tuned(fig(100, refs=refs), env={**base_env, "torch": "2.12"}),
        tuned(fig(80, refs=[r * 0.8 for r in refs]), "retune 2", env={**base_env, "torch": "2.13"}),
        fig(80),
        0.05,
    )
    assert torch_changed.verdict == REGRESSION


def test_the_baseline_is_the_last_confirmed_run_or_the_one_named():
    study = optuna.create_study()
    with pytest.raises(ConfigError, match="run the tuning first"):
        baseline(study, "last", "cpu")
    unconfirmed = Figure(
        config=dict(A), throughput=100.0, low=90.0, high=110.0
    )  # a search figure: no runs behind it
    save_tuned(study, tuned(unconfirmed, "tune 0", 0.5))
    with pytest.raises(ConfigError, match="retune.confirm >= 4"):
        baseline(study, "last", "cpu")
    save_tuned(study, tuned(fig(100), "tune 1", 1.0))
    save_tuned(study, tuned(fig(90), "retune 2", 2.0, kind="retune", verdict=SAME))
    save_tuned(study, tuned(None, "retune 3", 3.0, kind="retune"))  # nothing to recommend
    assert [t.name for t in tuned_runs(study)] == ["tune 0", "tune 1", "retune 2", "retune 3"]
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
    # Five windows, the default, not three: with three, one window slowed by the host's hiccup
    # skews them so far that Hall's interval of the new optimum (bf16, 965 samples/s, cv 7.7%)
    # reached down to 229, under the old optimum's pooled 530, so it lost the front on its lower
    # bound and the re-tune read REGRESSION instead of MOVED. Two more 0.05 s windows cost little.
    "measure.min_windows=5",
    "measure.max_time_s=0.6",
    # Every configuration measured to its full budget: racing stops a measurement after three
    # windows when its best case is out of the front's reach, and with a core kept busy by another
    # process the first windows of the new optimum once read a quarter of its speed, so it was
    # screened and the re-tune read REGRESSION instead of MOVED. The verdicts are under test here;
    # racing is tested in tests/analysis/test_racing.py and tests/study/test_study.py.
    "measure.race=false",
    "study.sampler=random",
    "noise.budget=0",  # no control runs: the verdicts rest on the confirmation runs
    "revalidate.processes=2",
    "revalidate.max_candidates=2",
    "retune.remeasure=0",
    # A regression or improvement is a change of more than 10%, not the default 5%: the step's
    # ~0.6 ms of Python around its wait follows the machine's speed, which the reference step
    # corrects only where the runs pin the sensitivity down. The verdicts' logic is the same at
    # any threshold; the changes made below are 18% and more. (The workload waits by spinning on
    # the clock: when it slept, its wake-ups waited for a core, and with the host's load an
    # unchanged model once read 0.844x of its baseline a minute earlier, the reference step 0.926x.)
    "retune.threshold=0.1",
    # A configuration is unstable where its fresh processes disagree beyond 25% more than the
    # machine's, not the default 5%: with a core kept busy by another process, the new optimum's
    # two re-validation processes once read 1.1k and 958 samples/s (CV 9.9%) against the 1.0% of
    # the baseline's four re-measured processes (when it slept instead of spinning), so it was
    # called unstable and the re-tune read REGRESSION instead of MOVED; the disagreement test
    # itself is tested in tests/revalidation/test_revalidate.py.
    "stable.excess_between_cv=0.25",
    "retune.processes=4",
    "retune.confirm=4",
    "retune.reference=false",  # but in the first two runs: it costs time
    "study.n_trials=4",
]
WITH_REFERENCE = "retune.reference=true"


def search(*args: str, runs_dir: Path, code: int = 0) -> subprocess.CompletedProcess:
    return invoke_search(
        *args, runs_dir=runs_dir, code=code, pythonpath=(str(REPO / "tests" / "retune_space"),)
    )


def test_retune_without_a_tuning_exits_2_in_one_line(tmp_path):
    result = search("retune", *SPACE, runs_dir=tmp_path / "runs", code=2)
    assert result.stderr.count("\n") == 1 and "run the tuning first" in result.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.alone
def test_a_retune_says_same_regression_or_moved_and_exits_accordingly(tmp_path):
    runs_dir = tmp_path / "runs"
    tune = search(*SPACE, WITH_REFERENCE, runs_dir=runs_dir)
    assert "[confirm 4/4] recommendation" in tune.stdout and "reference step" in tune.stdout

    same = search("retune", *SPACE, WITH_REFERENCE, "retune.n_trials=1", runs_dir=runs_dir)
    line = same.stdout.strip().splitlines()[-1]
    # An unchanged model raises no alarm (exit 0, checked by search()); IMPROVED is allowed, as
    # SAME and AMBIGUOUS are: on this shared machine the workload's own speed moves by a few
    # percent within a minute (benchmarks/retune_alarms.py: IMPROVED 1 in 20 unchanged re-tunes),
    # and the fresh runs measure that move correctly.
    assert line.startswith(("retune: SAME", "retune: AMBIGUOUS", "retune: IMPROVED")), same.stdout
    assert "best, today vs baseline (the same configuration)" in same.stdout
    assert "machine: the reference step, today vs baseline" in same.stdout
    study_dir = runs_dir / "slowdown-cpu"
    reports = sorted((study_dir / "retune").glob("*.json"))
    assert len(reports) == 1 and json.loads(reports[0].read_text())["verdict"] in (
        SAME,
        AMBIGUOUS,
        IMPROVED,
    )

    slower = search(
        "retune",
        *SPACE,
        "retune.n_trials=1",
        "space.workload.factor=1.5",
        runs_dir=runs_dir,
        code=3,
    )
    verdict = slower.stdout.strip().splitlines()[-1]
    assert verdict.startswith("retune: REGRESSION: best 0."), verdict
    # 1.5x slows the wait, not the step's own ~0.6 ms of Python around it, so the true ratio is
    # about 0.67-0.8 (0.690x [0.687, 0.711] beside a busy core); surely below 1, a regression
    assert 0.55 < float(verdict.split("best ")[1].split("x")[0]) < 0.9, verdict
    assert "changed: workload: fingerprint" in slower.stdout

    # 1.2 times the work, and bf16 now does half of it: the optimum moves to bf16, and today's
    # best (0.6 units) is surely not slower than the baseline's (fp32 at 0.75). At equal work it
    # was: autocast costs bf16 about 5% of this step, and the re-tune once read that, rightly, as
    # REGRESSION (0.946x [0.802, 0.963]), which outranks MOVED.
    moved = search(
        "retune",
        *SPACE,
        "retune.n_trials=3",
        "space.workload.factor=1.2",
        "space.workload.fast=bf16",
        runs_dir=runs_dir,
    )
    assert moved.stdout.strip().splitlines()[-1].startswith("retune: MOVED"), moved.stdout
    assert "today's recommendation vs the old one, both today: FASTER" in moved.stdout
    assert (
        "optimum moved: micro_batch_size=4 precision=fp32 -> micro_batch_size=4 precision=bf16"
        in moved.stdout
    )
    report = sorted((study_dir / "retune").glob("*.md"))[-1].read_text()
    assert "Optimum moved: micro_batch_size=4, precision=fp32 -> micro_batch_size=4, " in report

    with (study_dir / "history.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [r["verdict"] for r in rows][2:] == [REGRESSION, MOVED]
    assert rows[0]["verdict"] == "-" and rows[1]["verdict"] in (SAME, AMBIGUOUS, IMPROVED)
    assert json.loads(rows[-1]["config"])["precision"] == "bf16"
    assert json.loads(rows[0]["config"])["precision"] == "fp32"
    assert (study_dir / "history.png").stat().st_size > 0

    history = search("history", *SPACE, runs_dir=runs_dir)
    assert "regression" in history.stdout and "moved" in history.stdout


def test_the_nightly_examples_parse_and_act_on_the_exit_code():
    import configparser
    import shlex

    import yaml

    folder = REPO / "examples" / "nightly"
    workflow = yaml.safe_load((folder / "retune.yml").read_text())
    steps = workflow["jobs"]["retune"]["steps"]
    assert any("python -m search retune" in step.get("run", "") for step in steps)
    assert workflow[True]["schedule"][0]["cron"].count(" ") == 4  # YAML reads `on:` as True

    (line,) = [
        raw
        for raw in (folder / "crontab").read_text().splitlines()
        if raw and not raw.startswith("#") and "=" not in raw.split()[0]
    ]
    fields = line.split(maxsplit=5)
    assert len(fields) == 6 and "$code -eq 3" in fields[5]
    subprocess.run(["bash", "-n", "-c", fields[5]], check=True)  # the command is valid shell
    assert shlex.split(fields[5])

    for unit in ("search-retune.service", "search-retune.timer"):
        parser = configparser.ConfigParser(strict=True, interpolation=None)
        parser.read_string((folder / unit).read_text())
        assert parser.sections()
    service = configparser.ConfigParser(interpolation=None)
    service.read_string((folder / "search-retune.service").read_text())
    assert "search retune" in service["Service"]["ExecStart"]
    timer = configparser.ConfigParser(interpolation=None)
    timer.read_string((folder / "search-retune.timer").read_text())
    assert timer["Timer"]["OnCalendar"]


def test_an_ambiguous_verdict_says_how_many_runs_would_tell():
    noisy = conclude(tuned(fig(100, 0.2)), tuned(fig(95, 0.2), "retune 2"), fig(95, 0.2), 0.05)
    assert noisy.verdict == AMBIGUOUS
    assert noisy.hint.startswith("too noisy to tell: the runs spread by ")
    needed = int(noisy.hint.split("about ")[1].split(" runs")[0])
    # runs spread evenly over ±20% have a log CV of 0.15: 2·(1.96·0.15/0.0513)² ≈ 66
    assert 50 < needed < 90, noisy.hint
    assert conclude(tuned(fig(100)), tuned(fig(80), "r"), fig(80), 0.05).hint == ""


def test_a_recommendation_that_could_not_be_confirmed_is_no_verdict():
    unconfirmed = Figure(
        config=dict(A), throughput=80.0, low=70.0, high=90.0
    )  # a search figure: no runs behind it
    c = conclude(tuned(fig(100)), tuned(unconfirmed, "retune 2"), None, 0.05)
    assert c.verdict == AMBIGUOUS and c.exit_code == 0
    assert "could not be confirmed" in c.line


def test_a_slower_torch_is_a_regression_though_the_reference_step_slowed_too():
    # The reference step runs on the same torch: when the software changed, a slowdown it shares
    # with the model is the software's, not the machine's
    c = conclude(
        tuned(fig(100, refs=runs(50, 0.01)), env={"torch": "2.12"}),
        tuned(fig(80, refs=runs(40, 0.01)), "retune 2", env={"torch": "2.13"}),
        fig(80),
        0.05,
    )
    assert c.verdict == REGRESSION
    assert any("the software changed (torch)" in line for line in c.changed)


def test_without_the_reference_step_the_report_says_the_machine_was_not_compared():
    c = conclude(tuned(fig(100, refs=runs(50))), tuned(fig(100), "retune 2"), fig(100), 0.05)
    assert any(line.startswith("machine: not compared (today measured no") for line in c.changed)


def test_what_a_run_concluded_survives_the_json_of_a_database_storage():
    import json as json_

    t = tuned(fig(100, refs=runs(50)), verdict=SAME, kind="retune")
    again = Tuned.from_dict(json_.loads(json_.dumps(t.as_dict())))
    assert again == t


def test_a_round_whose_reference_run_failed_is_left_out_for_every_configuration(monkeypatch):
    import search.retuning.confirm
    from search.execution.trial import TrialResult

    calls = []

    class M:  # what confirm reads of a measurement
        def __init__(self, throughput):
            self.throughput = throughput

    def run(request):
        calls.append(request)
        reference = "reference" in request.workload["_target_"]
        if reference and len(calls) == 4:  # the reference run of the second round
            return TrialResult(state="failed", failure="crash: worker exited with code 1")
        return TrialResult(
            state="complete", measurement=M(50.0 if reference else 100.0 + len(calls))
        )

    monkeypatch.setattr(search.retuning.confirm, "run_isolated", run)
    rounds = FreshRuns(5, 0, 0.95)
    done = search.retuning.confirm.confirm([A, B], lambda c: _request(c), "cpu", rounds, _quiet)
    best, other = done.figures
    assert best is not None and other is not None
    assert len(best.runs) == len(best.references) == 4 == len(other.runs)
    assert done.failures == ["round 2: reference step: crash: worker exited with code 1"]
    assert all(not r.fidelity for r in calls), "confirmation runs skip the fidelity check"
    assert all(not r.read_memory and not r.count for r in calls), "a throughput is their figure"
    rounds = FreshRuns(3, 0, 0.95)
    too_few = search.retuning.confirm.confirm([A], lambda c: _request(c), "cpu", rounds, _quiet)
    assert too_few.figures == [None]


def _request(config):
    from search.execution.trial import TrialRequest
    from search.measurement.protocol import MeasureSettings

    return TrialRequest(
        workload={"_target_": "slowdown.Slowdown"},
        config=config,
        device="cpu",
        seed=0,
        measure=MeasureSettings(),
    )


def _quiet(*args):
    pass


def test_a_retune_needs_confirmation_runs(tmp_path):
    result = search("retune", *SPACE, "retune.confirm=0", runs_dir=tmp_path / "runs", code=2)
    assert "retune.confirm=0" in result.stderr and result.stderr.count("\n") == 1


def test_the_old_recommendation_is_held_back_unless_the_new_one_is_surely_faster():
    from search.retuning.verdict import held_back

    near = held_back(fig(102, config=B), fig(100), 0.05)
    assert near is not None and near.ratio == pytest.approx(1.02, abs=0.01)
    assert held_back(fig(130, config=B), fig(100), 0.05) is None  # surely 30% faster: it moves
    assert held_back(fig(104, config=B), fig(100, 0.3), 0.05) is not None  # maybe not faster
    assert held_back(fig(100), fig(100), 0.05) is None  # the same configuration
    assert held_back(fig(102, config=B), None, 0.05) is None  # the old one not measured today
    three = Figure.measured(A, runs(100, n=3))
    assert held_back(fig(102, config=B), three, 0.05) is None  # too few runs to compare


def test_a_kept_recommendation_is_listed_with_the_comparisons():
    from search.retuning.verdict import held_back

    kept = held_back(fig(101, config=B), fig(100), 0.05)
    c = conclude(tuned(fig(100)), tuned(fig(100), "retune 2"), fig(100), 0.05, kept=kept)
    assert c.kept is kept and c.comparisons[-1] is kept and c.verdict != MOVED


def test_history_and_the_report_show_figures_and_configurations_as_people_read_them(tmp_path):
    from search.core.records import si
    from search.retuning.retune_report import write_report
    from search.retuning.tuning_history import config_text, history_rows

    base, today = tuned(fig(27950)), tuned(fig(27950), "retune 2", time_s=2.0)
    row = history_rows([base])[0]
    assert json.loads(row["config"]) == A  # the CSV keeps JSON, for programs
    assert config_text(row["config"]) == "micro_batch_size=4, precision=fp32"
    md, _ = write_report(tmp_path, base, today, conclude(base, today, today.recommended, 0.05), A)
    text = md.read_text()
    assert "e+0" not in text and f"precision=fp32: {si(today.recommended.throughput)} [" in text
