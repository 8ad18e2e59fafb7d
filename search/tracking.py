"""MLflow layout: experiment per space, one parent run per invocation, one child run per trial.

Everything is logged in batches through ``MlflowClient`` (one request per run instead of one per
value). MLflow is imported only here.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Mapping

from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient

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
        found = self.client.get_experiment_by_name(experiment)
        if found is not None:
            self.experiment_id = found.experiment_id
        else:
            location = artifact_root.resolve().as_uri() if _is_local(uri) else None
            self.experiment_id = self.client.create_experiment(experiment, artifact_location=location)
        self.parent_id: str | None = None

    def start_parent(self, run_name: str, params: Mapping[str, Any], tags: Mapping[str, str]) -> str:
        run = self.client.create_run(self.experiment_id, run_name=run_name, tags=dict(tags))
        self.parent_id = run.info.run_id
        self._log(self.parent_id, params=params)
        return self.parent_id

    def log_child(self, run_name: str, params: Mapping[str, Any], metrics: Mapping[str, float],
                  tags: Mapping[str, str]) -> str:
        """One finished trial as a child of the parent run; returns its run id."""
        assert self.parent_id is not None, "start_parent() first"
        run = self.client.create_run(
            self.experiment_id, run_name=run_name, tags={"mlflow.parentRunId": self.parent_id, **tags}
        )
        self._log(run.info.run_id, params=params, metrics=metrics)
        failed = tags.get("state") == "failed"
        self.client.set_terminated(run.info.run_id, status="FAILED" if failed else "FINISHED")
        return run.info.run_id

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
