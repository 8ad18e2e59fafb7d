"""benchmarks/versus_baseline.py: its baselines, its interleaving, its ratios and its report, with
the isolated worker replaced by fake timings (nothing is measured)."""

from __future__ import annotations

import importlib.util
import json
from collections import Counter
from pathlib import Path

import pytest
import yaml
from factories import llm_settings, measurement

from search.core.records import COMPLETE, INFEASIBLE
from search.execution.trial import TrialResult

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "versus_baseline.py"


@pytest.fixture(scope="module")
def versus():
    spec = importlib.util.spec_from_file_location("versus_baseline", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _space():
    from search.config.compose import resolve_device
    from search.config.prepare import load_space

    chosen = llm_settings()
    return load_space(chosen.space, resolve_device(chosen.device))[0]


def test_every_arm_runs_as_often_in_one_seeded_order(versus):
    arms = ["tuned", "baseline", "compiled"]
    schedule = versus.interleaved(arms, 4, seed=0)
    assert Counter(schedule) == {arm: 4 for arm in arms}
    assert schedule == versus.interleaved(arms, 4, seed=0), "the seed fixes the order"
    assert schedule != [a for a in arms for _ in range(4)], "interleaved, not one arm after another"
    assert {tuple(versus.interleaved(arms, 4, seed=s)) for s in range(5)} != {tuple(schedule)}


def test_the_ratio_is_of_the_log_process_means_with_welch_interval(versus):
    r = versus.ratio([200.0, 204.0, 196.0], [100.0, 101.0, 99.0], 0.95)
    assert r["ratio"] == pytest.approx(2.0, rel=1e-3)
    assert 1.9 < r["ci_low"] < 2.0 < r["ci_high"] < 2.1
    tie = versus.ratio([100.0, 110.0, 90.0], [101.0, 109.0, 91.0], 0.95)
    assert tie["ci_low"] < 1.0 < tie["ci_high"]


def test_the_baselines_are_the_first_guess_eager_and_compiled(versus):
    candidates = versus.baseline_candidates(_space())
    first = candidates[0]
    expert = {"batch_size": 32, "micro_batch_size": 32, "precision": "bf16", "streams": 1}
    assert first.items() >= {**expert, "recompute": False, "compile": "off"}.items()
    assert [c["micro_batch_size"] for c in candidates if c["precision"] == "bf16"] == [
        32,
        16,
        8,
        4,
        2,
        1,
    ]
    assert candidates[6]["precision"] == "fp32", "then the next precision, should bf16 fail"
    assert versus.compiled_baseline(first) == {**first, "compile": "default"}


def _result(throughput: float, compile_s: float | None = None) -> TrialResult:
    return TrialResult(
        state=COMPLETE,
        measurement=measurement(throughput),
        peak_memory_mb=100.0,
        unit="tokens",
        compile={} if compile_s is None else {"compile_time_s": compile_s},
    )


def _run(versus, monkeypatch, tmp_path, speeds, extra=()):
    """``main`` with each configuration measured at ``speeds(config, run)`` (a float, or a
    TrialResult to return as it is); returns the report and the requests, in order."""
    tuned = {
        "batch_size": 16,
        "micro_batch_size": 8,
        "precision": "fp32",
        "streams": 1,
        "recompute": False,
        "compile": "off",
    }
    best = tmp_path / "best.yaml"
    best.write_text(yaml.safe_dump({"recommended": {"trial": 3, "config": tuned}}))
    requests = []

    def fake(request):
        requests.append(request)
        if request.measure is versus.PROBE:
            return _result(1.0)
        out = speeds(dict(request.config), len(requests))
        if isinstance(out, TrialResult):
            return out
        return _result(out, 12.0 if request.config.get("compile") != "off" else None)

    monkeypatch.setattr(versus, "run_isolated", fake)
    monkeypatch.setattr(versus, "flops_per_item", lambda workload, config: None)
    report = tmp_path / "report.json"
    argv = ["--tuned", str(best), "--processes", "3", "--json", str(report), *extra]
    rc = versus.main([*argv, "+space=llm", "device=cpu", f"runs_dir={tmp_path}"])
    return rc, (json.loads(report.read_text()) if report.exists() else None), requests


def _speed(config, n):
    wobble = 1.0 + 0.01 * (n % 3 - 1)
    if config["precision"] == "fp32":
        return 3000.0 * wobble
    return (2000.0 if config["compile"] == "default" else 1000.0) * wobble


def test_the_report_compares_the_tuned_configuration_with_both_baselines(
    versus, monkeypatch, tmp_path, capsys
):
    rc, report, requests = _run(versus, monkeypatch, tmp_path, _speed)
    assert rc == 0
    timed = [r for r in requests if r.measure is not versus.PROBE]
    assert len(timed) == 9 and Counter(r.config["compile"] for r in timed)["default"] == 3
    checked = [r.config["compile"] for r in timed if r.fidelity]
    assert checked == ["default"], "only the compiled baseline's first run checks its numerics"
    assert report["configs"]["compiled"] == {**report["configs"]["baseline"], "compile": "default"}
    assert report["ratio"]["tuned_over_baseline"] == pytest.approx(3.0, rel=0.02)
    assert report["ratio_compiled"]["tuned_over_compiled"] == pytest.approx(1.5, rel=0.02)
    assert report["ratio_compiled"]["ci_low"] < 1.5 < report["ratio_compiled"]["ci_high"]
    assert report["compiled"]["compile_time_s"] == pytest.approx(12.0)
    assert "compile_time_s" not in report["baseline"]
    out = capsys.readouterr().out
    assert "tuned / baseline throughput: 3.0" in out
    assert "tuned / compiled throughput: 1.5" in out and "compile time excluded" in out
    assert "before the timed windows: not in the throughput" in out


def test_no_compiled_leaves_the_compiled_baseline_out(versus, monkeypatch, tmp_path):
    rc, report, requests = _run(versus, monkeypatch, tmp_path, _speed, ["--no-compiled"])
    assert rc == 0 and "compiled" not in report and "ratio_compiled" not in report
    assert all(r.config["compile"] == "off" for r in requests)
    assert report["ratio"]["tuned_over_baseline"] == pytest.approx(3.0, rel=0.02)


def test_against_another_recommendation_measures_it_in_the_same_interleaving(
    versus, monkeypatch, tmp_path, capsys
):
    earlier = tmp_path / "earlier.yaml"
    config = {"batch_size": 16, "micro_batch_size": 4, "precision": "fp32", "streams": 1}
    earlier.write_text(yaml.safe_dump({"recommended": {"trial": 9, "config": config}}))

    def speeds(config, n):  # the earlier recommendation at 2/3 of the tuned one's speed
        return (
            2000.0 * (1.0 + 0.01 * (n % 3 - 1))
            if config["micro_batch_size"] == 4
            else _speed(config, n)
        )

    rc, report, requests = _run(versus, monkeypatch, tmp_path, speeds, ["--against", str(earlier)])
    assert rc == 0 and report["configs"]["against"] == config
    assert Counter(name for name in report["schedule"])["against"] == 3
    assert report["ratio_against"]["tuned_over_against"] == pytest.approx(1.5, rel=0.02)
    assert "tuned / against throughput: 1.5" in capsys.readouterr().out


def test_a_compiled_baseline_that_fails_is_left_out_with_its_reason(versus, monkeypatch, tmp_path):
    def speeds(config, n):
        if config["compile"] == "default":
            return TrialResult(state=INFEASIBLE, failure="compile=default cannot compile this")
        return _speed(config, n)

    rc, report, requests = _run(versus, monkeypatch, tmp_path, speeds)
    assert rc == 0 and "ratio_compiled" not in report and "compiled" not in report
    assert report["compiled_failure"] == "compile=default cannot compile this"
    assert sum(r.config["compile"] == "default" for r in requests) == 1, "tried once"
    assert report["ratio"]["tuned_over_baseline"] == pytest.approx(3.0, rel=0.02)


def _gen_gpu(monkeypatch):
    """docs/gen_gpu.py, imported with a stand-in for mkdocs-gen-files (it writes the page when
    imported)."""
    import contextlib
    import io
    import sys
    import types

    stub = types.ModuleType("mkdocs_gen_files")
    stub.open = lambda *args, **kwargs: contextlib.nullcontext(io.StringIO())
    monkeypatch.setitem(sys.modules, "mkdocs_gen_files", stub)
    path = Path(__file__).parents[1] / "docs" / "gen_gpu.py"
    spec = importlib.util.spec_from_file_location("gen_gpu", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _arm(throughput, **more):
    return {
        "throughput": throughput,
        "throughput_ci_low": throughput * 0.99,
        "throughput_ci_high": throughput * 1.01,
        "processes": 3,
        "between_process_cv": 0.01,
        "peak_memory_mb": 1000.0,
        **more,
    }


def test_the_gpu_page_renders_both_ratios_and_old_records_with_one(monkeypatch):
    gen = _gen_gpu(monkeypatch)
    config = {"batch_size": 32}
    report = {
        "unit": "tokens/s",
        "configs": {"tuned": config, "baseline": config, "compiled": config},
        "tuned": _arm(3000.0),
        "baseline": _arm(1000.0),
        "compiled": _arm(2000.0, compile_time_s=41.0),
        "ratio": {"tuned_over_baseline": 3.0, "ci_low": 2.9, "ci_high": 3.1},
        "ratio_compiled": {"tuned_over_compiled": 1.5, "ci_low": 1.4, "ci_high": 1.6},
    }
    record = {
        "step": "llm_versus",
        "command": "python benchmarks/versus_baseline.py --json runs/x.json runs_dir=runs",
        "wall_s": 200.0,
        "rc": 0,
        "figures": {"report": report},
    }
    text = "\n".join(gen._versus(record))
    assert "**Tuned / baseline: 3.000 [2.900, 3.100]**" in text
    assert "**Tuned / compiled baseline: 1.500 [1.400, 1.600]**" in text
    assert "compiled in 41 s a process" in text and "Compiled baseline" in text
    old = {k: v for k, v in report.items() if k not in ("compiled", "ratio_compiled")}
    old["configs"] = {"tuned": config, "baseline": config}
    text = "\n".join(gen._versus({**record, "figures": {"report": old}}))
    assert "Tuned / baseline: 3.000" in text and "compiled" not in text.lower()
    assert "llama_levers" in gen.STEP_ORDER and gen.RENDER["llama_levers"] is gen._study
    assert gen.RENDER["llama_levers_versus"] is gen._versus
    assert gen.RENDER["llm_attention"] is gen._study
    assert gen.RENDER["llm_attention_versus"] is gen._versus


def test_the_campaign_compares_with_both_baselines_and_studies_the_gpu_levers(
    monkeypatch, tmp_path
):
    import sys

    path = Path(__file__).parents[1] / "benchmarks" / "gpu_campaign.py"
    spec = importlib.util.spec_from_file_location("gpu_campaign", path)
    campaign = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_campaign", campaign)  # its dataclass looks it up
    spec.loader.exec_module(campaign)
    steps = {s.name: s for s in campaign.STEPS}
    names = [s.name for s in campaign.STEPS]
    assert names[-5:-2] == ["llama_levers", "llama_levers_versus", "llama_fp8"], "after the rest"
    versus = steps["llama_versus"].argv(tmp_path)
    assert "--no-compiled" not in versus and "--processes" in versus
    # the whole default llama run, in a study of its own, then beside both first guesses
    default = steps["llama_default"].argv(tmp_path)
    assert "study.name=llama_default-cuda" in default
    assert not any(a.startswith(("study.timeout_s", "revalidate.", "retune.")) for a in default)
    beside = steps["llama_default_versus"]
    assert beside.needs == "llama_default" and "--no-compiled" not in beside.argv(tmp_path)
    assert str(tmp_path / "llama_default-cuda" / "best.yaml") in beside.argv(tmp_path)
    levers = steps["llama_levers"]
    argv = levers.argv(tmp_path)
    # held at the wall, so that a window's budget goes to the levers, and ending in one window
    wall = ("+space.params.batch_size=32", "+space.params.micro_batch_size=8")
    for override in (
        "space.params.kernels.choices=[torch,liger]",
        "space.params.optimizer.choices=[foreach,fused]",
        f"study.name={levers.study}",
        *wall,
        "revalidate.max_candidates=1",
        "retune.confirm=0",
    ):
        assert override in argv
    # fp8 has a study of its own at the same wall, compiled: eager, its casts lost (0.49x)
    fp8 = steps["llama_fp8"].argv(tmp_path)
    assert "space.params.precision.choices=[bf16,fp8-tensorwise,fp8-rowwise]" in fp8
    assert "space.params.compile.choices=[default]" in fp8 and wall[1] in fp8
    # its comparison reads its recommendation, at the same micro-batch, into its own report
    compared = steps["llama_levers_versus"]
    assert compared.needs == "llama_levers"
    compared_argv = compared.argv(tmp_path)
    assert str(tmp_path / levers.study / "best.yaml") in compared_argv
    assert wall[1] in compared_argv and str(tmp_path / "llama_levers_versus.json") in compared_argv
    # the attention kernels last, at the llm recommendation, each compared with the first guess
    assert names[-2:] == ["llm_attention", "llm_attention_versus"]
    kernels = steps["llm_attention"].argv(tmp_path)
    at = ("+space.params.batch_size=64", "+space.params.micro_batch_size=64")
    assert "space.params.attention.choices=[default,flash,efficient,cudnn,math]" in kernels
    assert all(a in kernels for a in at) and "space.params.compile.choices=[default]" in kernels
    kernels_compared = steps["llm_attention_versus"].argv(tmp_path)
    assert str(tmp_path / "llm_attention-cuda" / "best.yaml") in kernels_compared
    assert all(a in kernels_compared for a in (*at, "space.memory_grows_with=[]"))
    lines = "[1/9] #0 batch_size=32 kernels=liger -> 50k tokens/s\ntime: 90% of 300 s\n"
    figures = campaign.read_figures(levers, tmp_path, lines)
    assert figures["trial_lines"] == ["[1/9] #0 batch_size=32 kernels=liger -> 50k tokens/s"]


def _campaign(monkeypatch):
    import sys

    path = Path(__file__).parents[1] / "benchmarks" / "gpu_campaign.py"
    spec = importlib.util.spec_from_file_location("gpu_campaign", path)
    campaign = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_campaign", campaign)  # its dataclass looks it up
    spec.loader.exec_module(campaign)
    return campaign


def test_a_capped_campaign_caps_each_study_once_and_leaves_other_steps_alone(monkeypatch, tmp_path):
    campaign = _campaign(monkeypatch)
    steps = {s.name: s for s in campaign.STEPS}
    llm = campaign.capped(steps["llm"], 150).argv(tmp_path)
    assert "study.timeout_s=150" in llm and all(a in llm for a in campaign.SHORT_ENDING)
    llama = campaign.capped(steps["llama"], 90).argv(tmp_path)
    assert [a for a in llama if a.startswith("study.timeout_s=")] == ["study.timeout_s=90"]
    assert sum(a == campaign.SHORT_ENDING[0] for a in llama) == 1, "no override given twice"
    for name in ("pytest_gpu", "fidelity_errors", "llm_versus"):
        assert campaign.capped(steps[name], 150) is steps[name]
    assert campaign.capped(steps["llm"], None) is steps["llm"]


def test_the_gpu_page_shows_each_levers_largest_error_beside_its_tolerance(monkeypatch):
    gen = _gen_gpu(monkeypatch)
    summary = {
        "precision": "fp8-rowwise",
        "largest": {"fidelity_loss_rel_error": 2.9e-4, "fidelity_grad_norm_rel_error": 1.6e-3},
        "tolerance": "Tolerance(loss_rel=0.015625, grad_norm_rel=0.0625)",
    }
    record = {
        "step": "fidelity_errors",
        "command": "python fidelity_errors.py --seeds 2 --json runs/fidelity_errors.json",
        "wall_s": 59.0,
        "rc": 1,
        "figures": {},  # the report was not written: its lines in the output stand in for it
        "output_tail": 'noise\n{"summary": ' + json.dumps(summary) + "}\nTraceback ...\n",
    }
    text = "\n".join(gen._fidelity_errors(record))
    assert "| precision fp8-rowwise | 2.90e-04 | 1.60e-03 | 0.0156, 0.0625 |" in text
    empty = "\n".join(gen._fidelity_errors({**record, "output_tail": "Traceback"}))
    assert "No figures (exit 1)" in empty


def test_the_gpu_page_splits_a_day_into_its_windows_in_the_order_they_ran(monkeypatch):
    gen = _gen_gpu(monkeypatch)
    ended = ["2026-11-26 16:58:55 UTC", "2026-11-26 10:44:23 UTC", "2026-11-26 16:48:37 UTC"]
    windows = gen._windows([{"ended": e} for e in ended])
    assert [[r["ended"][11:16] for r in w] for w in windows] == [["10:44"], ["16:48", "16:58"]]
