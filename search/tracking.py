"""MLflow layout: experiment per space, one parent run per invocation, one child run per trial.

Everything is logged in batches through ``MlflowClient`` (one request per run instead of one per
value). MLflow is imported only here.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Mapping

from mlflow.entities import Metric, Param, RunTag
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from search.records import TrialRecord

_BATCH = 100  # MLflow accepts at most 100 params or tags per log_batch call


def _is_local(uri: str) -> bool:
    return not uri.startswith(("http://", "https://", "databricks"))


class Tracker:
    """Writes a study's runs to the MLflow store at ``uri``.

    With a local store (sqlite, postgresql, ...) artifacts go under ``artifact_root``; a tracking
    server decides its own artifact location.
    """

    def __init__(self, uri: str, experiment: str, artifact_root: Path):
        self.uri = uri
        self.client = MlflowClient(tracking_uri=uri)
        self.experiment_id = self._experiment(experiment, artifact_root)
        self.parent_id: str | None = None

    def _experiment(self, name: str, artifact_root: Path) -> str:
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        location = artifact_root.resolve().as_uri() if _is_local(self.uri) else None
        try:
            return self.client.create_experiment(name, artifact_location=location)
        except MlflowException:  # another process created it first
            found = self.client.get_experiment_by_name(name)
            if found is None:
                raise
            return found.experiment_id

    def start_parent(self, run_name: str, params: Mapping[str, Any], tags: Mapping[str, str]) -> str:
        run = self.client.create_run(self.experiment_id, run_name=run_name, tags=dict(tags))
        self.parent_id = run.info.run_id
        self._log(self.parent_id, params=params)
        return self.parent_id

    def log_trial(self, record: TrialRecord, duration_s: float, tags: Mapping[str, str]) -> str:
        """One finished trial as a child of the parent run, with the contract's tags; returns its id.

        ``tags`` adds context (study, device, stop reason, ...) to ``state``, ``stable``, ``pareto``,
        ``throughput_unit`` and ``failure``.
        """
        assert self.parent_id is not None, "start_parent() first"
        end_ms = int(time.time() * 1000)
        contract = {"state": record.state, "stable": str(record.stable).lower(), "pareto": "false",
                    "trial": str(record.number), "throughput_unit": f"{record.unit}/s"}
        if record.failure:
            contract["failure"] = record.failure
        run = self.client.create_run(
            self.experiment_id, run_name=f"trial-{record.number}", start_time=end_ms - int(duration_s * 1000),
            tags={"mlflow.parentRunId": self.parent_id, **tags, **contract},
        )
        status = "FAILED"
        try:
            self._log(run.info.run_id, params=record.config, metrics=record.metrics)
            status = "FAILED" if record.state == "failed" else "FINISHED"
        finally:
            self.client.set_terminated(run.info.run_id, status=status, end_time=end_ms)
        return run.info.run_id

    def mark_pareto(self, study: str, front_run_ids: set[str]) -> None:
        """Set ``pareto`` to true on exactly the runs of ``front_run_ids`` among the study's children."""
        tagged = self.client.search_runs([self.experiment_id], max_results=10_000,
                                         filter_string=f"tags.study = '{study}' and tags.pareto = 'true'")
        for run in tagged:
            if run.info.run_id not in front_run_ids:
                self.set_tags(run.info.run_id, {"pareto": "false"})
        for run_id in front_run_ids:
            try:
                self.set_tags(run_id, {"pareto": "true"})
            except MlflowException:
                pass  # the run was deleted in MLflow (or lives in another store): nothing to tag

    def set_tags(self, run_id: str, tags: Mapping[str, str]) -> None:
        self._log(run_id, tags=tags)

    def log_metrics(self, run_id: str, metrics: Mapping[str, float]) -> None:
        self._log(run_id, metrics=metrics)

    def log_artifact(self, path: Path) -> None:
        assert self.parent_id is not None
        self.client.log_artifact(self.parent_id, str(path))

    def end_parent(self, status: str = "FINISHED") -> None:
        if self.parent_id is not None:
            self.client.set_terminated(self.parent_id, status=status)

    def ui_command(self) -> str:
        if self.uri.startswith("sqlite:///") and not self.uri.startswith("sqlite:////"):
            # A relative path works only from this directory: print the absolute one.
            return f"mlflow ui --backend-store-uri sqlite:///{Path(self.uri[len('sqlite:///'):]).resolve()}"
        if _is_local(self.uri):
            return f"mlflow ui --backend-store-uri {self.uri}"
        return f"open {self.uri}"

    def _log(self, run_id: str, params: Mapping[str, Any] = {}, metrics: Mapping[str, float] = {},
             tags: Mapping[str, str] = {}) -> None:
        now_ms = int(time.time() * 1000)
        param_list = [Param(k, str(v)) for k, v in params.items()]
        tag_list = [RunTag(k, str(v)) for k, v in tags.items()]
        metric_list = [Metric(k, float(v), now_ms, 0) for k, v in metrics.items()]
        for start in range(0, max(len(param_list), len(tag_list), 1), _BATCH):
            self.client.log_batch(
                run_id,
                metrics=metric_list if start == 0 else [],
                params=param_list[start:start + _BATCH],
                tags=tag_list[start:start + _BATCH],
            )
