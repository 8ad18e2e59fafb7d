"""The Python API: ``search.tune`` runs the command line's tuning in this process and returns what
it found; bad input raises the command line's line as a ``SearchError``."""

from __future__ import annotations

import json

import pandas
import pytest
import yaml
from invoke import search as invoke_search  # tests/ is on sys.path
from invoke import seed_runs_dir
from tiny_overrides import LENIENT, TINY
from torch import nn

import search
from search.workloads.gpt import GPT


class WiderGPT(GPT):
    """A workload of the caller's own module: the trials, fresh processes, import it by name."""

    def build_model(self) -> nn.Module:
        return super().build_model()


def test_tune_returns_the_recommendation_the_front_the_study_and_the_run(tmp_path):
    runs_dir = tmp_path / "runs"
    seed_runs_dir(runs_dir)
    result = search.tune(
        "llm",
        [*TINY, *LENIENT, "study.n_trials=3", f"runs_dir={runs_dir}"],
    )
    assert result.exit_code == 0
    best = yaml.safe_load((runs_dir / "llm-cpu" / "best.yaml").read_text())
    assert result.recommended == best["recommended"]["config"] and result.best == best
    assert isinstance(result.front, pandas.DataFrame) and len(result.front) >= 1
    assert {"throughput", "throughput_ci_low", "throughput_ci_high"} <= set(result.front.columns)
    assert (result.front["throughput_ci_low"] <= result.front["throughput"]).all()
    assert best["recommended"]["trial"] in set(result.front["trial"])
    assert len([t for t in result.study.trials if "metrics" in t.user_attrs]) == 3
    assert result.mlflow_run_id is not None
    # the same recommendation in the trainers' words (tests/reporting/test_trainer_words.py)
    hf = json.loads((result.study_dir / "best.hf_trainer.json").read_text())
    assert hf["config"] == result.recommended
    assert hf["arguments"]["per_device_train_batch_size"] == result.recommended["micro_batch_size"]
    import mlflow

    run = mlflow.MlflowClient(f"sqlite:///{runs_dir}/mlflow.db").get_run(result.mlflow_run_id)
    assert run.data.tags["command"].startswith("python -m search +space=llm ")


def test_a_workload_class_of_the_callers_module_runs_in_the_trials(tmp_path):
    runs_dir = tmp_path / "runs"
    seed_runs_dir(runs_dir)
    tiny = {"vocab_size": 256, "seq_len": 32, "d_model": 32, "n_layers": 1, "n_heads": 2}
    result = search.tune(
        "llm",
        [
            *(o for o in TINY if not o.startswith("space.workload.")),
            *LENIENT,
            "study.n_trials=1",
            f"runs_dir={runs_dir}",
        ],
        workload=WiderGPT,
        workload_settings=tiny,
        config_dir=None,
    )
    assert result.exit_code == 0, result
    (trial,) = [t for t in result.study.trials if "metrics" in t.user_attrs]
    assert trial.user_attrs["metrics"]["throughput"] > 0
    assert yaml.safe_load((result.study_dir / "best.yaml").read_text()) is not None


def test_bad_input_raises_the_command_lines_line(tmp_path):
    runs_dir = tmp_path / "runs"
    cli = invoke_search("+space=llm", "study.n_trail=3", runs_dir=runs_dir, code=2)
    with pytest.raises(search.SearchError) as raised:
        search.tune("llm", ["study.n_trail=3", f"runs_dir={runs_dir}"])
    assert cli.stderr.strip() == f"search: error: {raised.value}"
    with pytest.raises(search.SearchError, match="no space named 'nope'|nope"):
        search.tune("nope", [f"runs_dir={runs_dir}"])
    assert not runs_dir.exists()


def test_a_workload_no_fresh_process_can_import_is_refused_in_one_line(tmp_path):
    class Local(GPT):
        pass

    with pytest.raises(search.SearchError, match="inside a function: trials run in fresh"):
        search.tune("llm", [f"runs_dir={tmp_path}"], workload=Local)
    with pytest.raises(search.SearchError, match="workload_settings needs workload"):
        search.tune("llm", [f"runs_dir={tmp_path}"], workload_settings={"d_model": 8})
