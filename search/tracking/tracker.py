"""MLflow layout: experiment per space, one parent run per invocation, one child run per trial.

Everything is logged in batches through ``MlflowClient`` (one request per run instead of one per
value). MLflow is imported only here.

A tracking server that cannot be reached must not cost the measurements: ``Tracker.open`` returns an
*offline* tracker when the server is unreachable at the start, and a tracker whose server goes away
later switches to offline instead of raising. Offline, every method does nothing; the study keeps
every figure, and ``python -m search sync`` copies the missing trials once the server is back.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

from mlflow.entities import Metric, Param, RunTag
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from search.config.compose import redact
from search.core.records import FAILED, TrialRecord, config_name
from search.tracking.connection import (
    check_http_uri,
    innermost_cause,
    is_http,
    is_local,
    limit_network,
    unreachable,
)

__all__ = [
    "EXPERIMENT_KIND",
    "EXPERIMENT_NOTE",
    "NOTE",
    "Tracker",
    "quoted",
]


NOTE = "mlflow.note.content"
"""The tag MLflow shows as a run's or an experiment's description (markdown)."""
EXPERIMENT_KIND = "mlflow.experimentKind"
EXPERIMENT_NOTE = """Tuning runs of `python -m search`.

- **Parent runs**, one per invocation (`llm-cpu tune 2026-11-24 10:00:00`): the description
  holds the summary (the Pareto front, the recommendation, the machine's noise floor, the regimes
  and the oracle table); artifacts hold `pareto.png`, `oracle.png`, `noise.png`, `best.yaml`.
- **Child runs**, one per measured configuration, named by its knobs (`bs32·mb8·bf16·s2 #12`):
  params are the knob values; metrics `throughput` (with `throughput_ci_low`/`_high`),
  `latency_p95_ms`, `peak_memory_mb`, `mfu` ...; tags `stable`, `pareto`, `regime`, `state`.

To compare: search `tags.pareto = 'true'`, sort by throughput, then the chart view (or select
runs and Compare); Columns adds `metrics.throughput`, `metrics.throughput_ci_low`, `tags.regime`
to the table. The command prints a link that opens this view."""


def quoted(value: str) -> str:
    """``value`` as a string literal of MLflow's filter syntax, which has no escapes: in single
    quotes, or in double quotes when it holds a single quote (``study.name`` may not hold both)."""
    if "'" not in value:
        return f"'{value}'"
    if '"' not in value:
        return f'"{value}"'
    raise ValueError(f"{value!r} holds both quote characters: MLflow cannot search for it")


class Tracker:
    """Writes a study's runs to the MLflow store at ``uri``.

    With a local store (sqlite, postgresql, ...) artifacts go under ``artifact_root``; a tracking
    server decides its own artifact location. ``Tracker(...)`` raises when the store cannot be
    opened; ``Tracker.open(...)`` returns an offline tracker instead when a server is unreachable.
    """

    offline_reason: str | None = None
    """Why nothing is logged (one line naming the URI); None while logging works."""
    unlogged_trials: int = 0
    """Trials passed to ``log_trial`` whose child run was not logged because the tracker was
    offline."""

    def __init__(self, uri: str, experiment: str, artifact_root: Path):
        self.uri = uri
        self.parent_id: str | None = None
        self.offline_reason = None
        self.unlogged_trials = 0
        self.log_error: str | None = None
        self.study_id: str | None = None
        if is_http(uri):
            check_http_uri(uri)
            limit_network()
        self.client: MlflowClient | None = MlflowClient(tracking_uri=uri)
        self.experiment_id: str | None = self._experiment(experiment, artifact_root)

    @classmethod
    def open(cls, uri: str, experiment: str, artifact_root: Path) -> Tracker:
        """A working tracker, or an offline one when the tracking server at ``uri`` cannot be
        reached.

        Bad input (unsupported scheme, malformed URI, a store that cannot be created, a server that
        refuses the request) still raises: only an outage is worth carrying on without MLflow.
        """
        try:
            return cls(uri, experiment, artifact_root)
        except Exception as e:
            if not (is_http(uri) and unreachable(e)):
                raise
            return cls.offline(
                uri, f"MLflow server {redact(uri)} unreachable: {innermost_cause(e)}"
            )

    @classmethod
    def offline(cls, uri: str, reason: str) -> Tracker:
        """A tracker that logs nothing: every method is a no-op; ``reason`` says why."""
        tracker = cls.__new__(cls)
        tracker.uri, tracker.client, tracker.experiment_id, tracker.parent_id = (
            uri,
            None,
            None,
            None,
        )
        tracker.offline_reason, tracker.unlogged_trials = reason, 0
        tracker.log_error, tracker.study_id = None, None
        return tracker

    def bind(self, study_id: str) -> None:
        """Tag every run this tracker starts ``study_id=<study_id>``, and take for the study's own
        only runs with that tag (or none: runs logged before studies had ids)."""
        self.study_id = study_id

    def own(self, runs: list) -> list:
        """``runs`` (found by study name) less those of another study of the same name."""
        return [r for r in runs if r.data.tags.get("study_id") in (None, self.study_id)]

    def _tagged(self, tags: Mapping[str, str]) -> dict[str, str]:
        return {**tags, **({"study_id": self.study_id} if self.study_id else {})}

    @property
    def _client(self) -> MlflowClient:
        """The MLflow client; reached only while online (every caller checks first, see
        ``_guard``)."""
        assert self.client is not None, "the tracker is offline: it has no MLflow client"
        return self.client

    @property
    def _experiment_id(self) -> str:
        assert self.experiment_id is not None, "the tracker is offline: it has no experiment"
        return self.experiment_id

    def _experiment(self, name: str, artifact_root: Path) -> str:
        found = self._client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        location = artifact_root.resolve().as_uri() if is_local(self.uri) else None
        try:
            # Its kind opens the UI's run pages rather than its GenAI ones; the description says
            # how the runs are laid out and compared (a user's own edit of it is never replaced).
            tags = {EXPERIMENT_KIND: "custom_model_development", NOTE: EXPERIMENT_NOTE}
            return self._client.create_experiment(name, artifact_location=location, tags=tags)
        except MlflowException as e:  # another process created it first
            if unreachable(e):
                raise
            found = self._client.get_experiment_by_name(name)
            if found is None:
                raise
            return found.experiment_id

    # -- going offline -------------------------------------------------------------------------

    def _lost(self, error: BaseException) -> bool:
        """True (and the tracker offline from now on) when ``error`` means the server went away."""
        if not (isinstance(error, Exception) and unreachable(error)):
            return False
        if self.offline_reason is None:
            self.offline_reason = redact(
                f"MLflow server {self.uri} became unreachable: {innermost_cause(error)}"
            )
        return True

    def _guard(self, call: Callable[[], Any]) -> Any:
        """``call()``, or None without calling it when offline or when the server goes away during
        it."""
        if self.offline_reason is not None:
            return None
        try:
            return call()
        except Exception as e:
            if self._lost(e):
                return None
            raise

    def _best_effort(self, call: Callable[[], Any], what: str) -> Any:
        """``_guard(call)``, and None on any other error too (a 403 from an expired token, a TLS
        error, a busy sqlite store): the study holds the results, so a failed copy to MLflow never
        stops a run. The first such error is kept in ``log_error``."""
        try:
            return self._guard(call)
        except Exception as e:
            if self.log_error is None:
                self.log_error = redact(f"{what} failed in MLflow: {innermost_cause(e)}")
            return None

    # -- runs ----------------------------------------------------------------------------------

    def start_parent(
        self, run_name: str, params: Mapping[str, Any], tags: Mapping[str, str]
    ) -> str | None:
        """The parent run of this invocation; None when offline."""

        def start() -> str:
            run = self._client.create_run(
                self._experiment_id, run_name=run_name, tags=self._tagged(tags)
            )
            self.parent_id = run.info.run_id
            self._log(self.parent_id, params=params)
            return self.parent_id

        run_id = self._guard(start)
        return run_id if self.offline_reason is None else None

    def log_trial(
        self,
        record: TrialRecord,
        duration_s: float,
        tags: Mapping[str, str],
        end_ms: int | None = None,
    ) -> str | None:
        """One finished trial as a child of the parent run, with the contract's tags; returns its
        id.

        ``tags`` adds context (study, device, stop reason, ...) to ``state``, ``stable``,
        ``pareto``, ``trial``, ``throughput_unit`` and ``failure``. The run ends at ``end_ms`` (ms
        since the epoch; default now) and starts ``duration_s`` before.

        Best effort: the trial is in the Optuna study already, and ``sync`` copies what is missing.
        Offline, when the server goes away while logging, or on any other error (a 403 from an
        expired token, a TLS error, a busy sqlite store), nothing is logged: returns None, counts
        the trial in ``unlogged_trials`` and keeps the first error in ``log_error``.
        """
        if self.offline_reason is not None:
            self.unlogged_trials += 1
            return None
        assert self.parent_id is not None, "start_parent() first"
        try:
            return self._log_trial(
                record, duration_s, tags, int(time.time() * 1000) if end_ms is None else end_ms
            )
        except Exception as e:
            if not self._lost(e) and self.log_error is None:
                self.log_error = redact(
                    f"trial {record.number} was not logged to MLflow: {innermost_cause(e)}"
                )
            self.unlogged_trials += 1
            return None

    def _log_trial(
        self, record: TrialRecord, duration_s: float, tags: Mapping[str, str], end_ms: int
    ) -> str:
        contract = {
            "state": record.state,
            "stable": str(record.stable).lower(),
            "pareto": "false",
            "trial": str(record.number),
            "throughput_unit": f"{record.unit}/s",
        }
        if record.failure:
            contract["failure"] = record.failure
        run = self._client.create_run(
            self._experiment_id,
            run_name=f"{config_name(record.config)} #{record.number}",
            start_time=end_ms - int(duration_s * 1000),
            tags={"mlflow.parentRunId": self.parent_id, **self._tagged(tags), **contract},
        )
        run_id = run.info.run_id
        try:
            self._log(run_id, params=record.config, metrics=record.metrics)
        except BaseException as e:
            if not (isinstance(e, Exception) and self._lost(e)):  # not on a dead server
                try:  # KILLED: a cut-off run, which sync deletes and logs again in full
                    self._client.set_terminated(run_id, status="KILLED", end_time=end_ms)
                except Exception:
                    pass  # left RUNNING: cut off all the same
            raise
        self._client.set_terminated(
            run_id, status="FAILED" if record.state == FAILED else "FINISHED", end_time=end_ms
        )
        return run_id

    def trial_runs(self, study: str) -> tuple[dict[int, str], list[tuple[int, str]]]:
        """The study's child runs in this experiment: ``{trial number: run id}`` of the complete
        ones (ended FINISHED or FAILED by ``log_trial``), and ``(trial number, run id)`` of runs
        whose logging was cut off (still RUNNING, or ended KILLED by the recovery of a stopped
        process).

        ``sync`` decides from these which trials are missing; both are empty when offline.
        """
        complete: dict[int, str] = {}
        cut_off: list[tuple[int, str]] = []
        for run in self.own(self.find_runs(f"tags.study = {quoted(study)}")):
            number = run.data.tags.get("trial", "")
            if not number.isdigit():
                continue  # the parent run of an invocation
            if run.info.status in ("FINISHED", "FAILED"):
                complete.setdefault(int(number), run.info.run_id)
            else:
                cut_off.append((int(number), run.info.run_id))
        return complete, cut_off

    def find_runs(self, filter_string: str) -> list:
        """Every active run of the experiment that matches ``filter_string`` (MLflow search syntax),
        page by page; empty when offline."""

        def search() -> list:
            runs: list = []
            token = None
            while True:
                page = self._client.search_runs(
                    [self._experiment_id],
                    filter_string=filter_string,
                    max_results=1000,
                    page_token=token,
                )
                runs.extend(page)
                token = page.token
                if not token:
                    return runs

        return self._guard(search) or []

    def end_run(self, run_id: str, status: str) -> None:
        """End a run (e.g. one a stopped process left RUNNING) with ``status``."""
        self._best_effort(
            lambda: self._client.set_terminated(run_id, status=status), f"ending run {run_id}"
        )

    def delete_run(self, run_id: str) -> None:
        self._best_effort(lambda: self._client.delete_run(run_id), f"deleting run {run_id}")

    def mark_pareto(self, study: str, front_run_ids: set[str]) -> None:
        """Set ``pareto`` to true on exactly the runs of ``front_run_ids`` among the study's
        children."""
        tagged = self._best_effort(
            lambda: self._client.search_runs(
                [self._experiment_id],
                max_results=10_000,
                filter_string=f"tags.study = {quoted(study)} and tags.pareto = 'true'",
            ),
            "finding the runs tagged pareto",
        )
        if tagged is None:
            return
        for run in self.own(tagged):
            if run.info.run_id not in front_run_ids:
                self.set_tags(run.info.run_id, {"pareto": "false"})
        for run_id in front_run_ids:
            try:
                self._guard(functools.partial(self._log, run_id, tags={"pareto": "true"}))
            except MlflowException:
                pass  # the run was deleted in MLflow (or lives in another store): nothing to tag
            except Exception as e:
                if self.log_error is None:
                    self.log_error = redact(
                        f"tagging the front failed in MLflow: {innermost_cause(e)}"
                    )

    def set_tags(self, run_id: str | None, tags: Mapping[str, str]) -> None:
        """Tags on run ``run_id``; nothing for None (a parent run that was never started)."""
        if run_id is not None:
            self._best_effort(lambda: self._log(run_id, tags=tags), f"tagging run {run_id}")

    def log_metrics(
        self,
        run_id: str | None,
        metrics: Mapping[str, float],
        step: int = 0,
        timestamp_ms: int | None = None,
    ) -> None:
        """Metrics on run ``run_id`` at ``step`` (a later step of a metric is its latest value in
        the UI); nothing for None (a parent run that was never started)."""
        if run_id is not None:
            self._best_effort(
                lambda: self._log(run_id, metrics=metrics, step=step, timestamp_ms=timestamp_ms),
                f"logging metrics to run {run_id}",
            )

    def log_text(self, text: str, artifact_file: str) -> None:
        """``text`` as artifact ``artifact_file`` of the parent run."""
        parent_id = self.parent_id
        if parent_id is not None:
            self._best_effort(
                lambda: self._client.log_text(parent_id, text, artifact_file),
                f"logging {artifact_file}",
            )

    def log_artifact(self, path: Path) -> None:
        if self.offline_reason is not None:
            return
        parent_id = self.parent_id
        assert parent_id is not None, "start_parent() first"
        self._best_effort(
            lambda: self._client.log_artifact(parent_id, str(path)), f"logging {path.name}"
        )

    def end_parent(self, status: str = "FINISHED") -> None:
        parent_id = self.parent_id
        if parent_id is not None:
            self._best_effort(
                lambda: self._client.set_terminated(parent_id, status=status),
                "ending the parent run",
            )

    def describe(self, run_id: str | None, markdown: str) -> None:
        """``markdown`` as the description of run ``run_id`` (shown on its page in the UI)."""
        self.set_tags(run_id, {NOTE: markdown})

    def ui_url(self, study: str) -> str | None:
        """The UI page that compares ``study``'s Pareto-optimal runs: the run pages (not the GenAI
        ones), filtered to the front, fastest first, as charts. Local stores: where ``mlflow ui``
        listens by default. None when offline."""
        if self.experiment_id is None:
            return None
        base = "http://127.0.0.1:5000" if is_local(self.uri) else redact(self.uri).rstrip("/")
        query = urlencode(
            {
                "workflowType": "machine_learning",
                "searchFilter": f"tags.study = {quoted(study)} and tags.pareto = 'true'",
                "orderByKey": "metrics.`throughput`",
                "orderByAsc": "false",
                "compareRunsMode": "CHART",
            },
            quote_via=quote,
        )
        return f"{base}/#/experiments/{self.experiment_id}/runs?{query}"

    def ui_command(self) -> str:
        if self.uri.startswith("sqlite:///") and not self.uri.startswith("sqlite:////"):
            # A relative path works only from this directory: print the absolute one.
            return (
                "mlflow ui --backend-store-uri sqlite:///"
                f"{Path(self.uri[len('sqlite:///') :]).resolve()}"
            )
        if is_local(self.uri):
            return f"mlflow ui --backend-store-uri {self.uri}"
        return f"open {self.uri}"

    def _log(
        self,
        run_id: str,
        params: Mapping[str, Any] = {},
        metrics: Mapping[str, float] = {},
        tags: Mapping[str, str] = {},
        step: int = 0,
        timestamp_ms: int | None = None,
    ) -> None:
        now_ms = timestamp_ms if timestamp_ms is not None else int(time.time() * 1000)
        # One call: MlflowClient.log_batch splits into requests within the server's per-request
        # limits (100 params or tags, 1000 metrics) itself.
        self._client.log_batch(
            run_id,
            metrics=[Metric(k, float(v), now_ms, step) for k, v in metrics.items()],
            params=[Param(k, str(v)) for k, v in params.items()],
            tags=[RunTag(k, str(v)) for k, v in tags.items()],
        )
