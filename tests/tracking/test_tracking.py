"""An unreachable MLflow server costs seconds, never results: real clients against dead or failing
servers.

The servers are real sockets on this machine: a closed port (connection refused), a listening socket
that never answers (timeout) and a tiny HTTP server that answers every request with one status code.
The working store is one sqlite MLflow database shared by the module (creating one costs seconds).
"""

from __future__ import annotations

import http.server
import os
import socket
import threading
import time
from pathlib import Path

import pytest
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from search.core.records import TrialRecord
from search.tracking.connection import NETWORK_LIMITS, limit_network
from search.tracking.tracker import Tracker

RECORD = TrialRecord(
    number=3,
    config={"batch_size": 8, "precision": "bf16"},
    state="complete",
    metrics={"throughput": 100.0, "throughput_ci_low": 90.0},
    stable=True,
    unit="tokens",
)


# Tracker sets MLflow's network limits in os.environ (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("network_env")


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("mlflow")


def working(store: Path, experiment: str) -> Tracker:
    return Tracker.open(f"sqlite:///{store}/mlflow.db", experiment, store / "mlartifacts")


@pytest.fixture
def answering(request):
    """``answering(status)``: the URI of a local HTTP server that answers every request with
    ``status``."""
    servers = []

    def start(status: int) -> str:
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            do_POST = do_GET

            def log_message(self, *args):
                pass

        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def assert_no_ops(tracker: Tracker, tmp_path: Path) -> None:
    """Every method of an offline tracker returns at once without raising."""
    artifact = tmp_path / "a.txt"
    artifact.write_text("x")
    started = time.monotonic()
    assert tracker.start_parent("p", {"a": 1}, {"study": "s"}) is None
    tracker.log_text("text", "config.yaml")
    assert tracker.log_trial(RECORD, 1.0, {"study": "s"}) is None
    tracker.set_tags("some-run", {"k": "v"})
    tracker.log_metrics("some-run", {"m": 1.0})
    tracker.mark_pareto("s", {"some-run"})
    tracker.log_artifact(artifact)
    assert tracker.trial_runs("s") == ({}, [])
    assert tracker.find_runs("tags.study = 's'") == []
    tracker.end_run("some-run", "KILLED")
    tracker.delete_run("some-run")
    tracker.end_parent("FINISHED")
    assert time.monotonic() - started < 1.0, "an offline tracker must not touch the network"


def test_closed_port_gives_an_offline_tracker_in_seconds(dead_uri, tmp_path):
    started = time.monotonic()
    tracker = Tracker.open(dead_uri, "exp", tmp_path / "mlartifacts")
    elapsed = time.monotonic() - started
    assert elapsed < 30, f"took {elapsed:.1f} s to notice a refused connection"
    assert tracker.offline_reason is not None
    assert dead_uri in tracker.offline_reason and "unreachable" in tracker.offline_reason
    assert "\n" not in tracker.offline_reason
    assert_no_ops(tracker, tmp_path)
    assert tracker.unlogged_trials == 1
    assert tracker.parent_id is None


def test_network_limits_are_set_unless_the_user_set_them(dead_uri, tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "7")
    Tracker.open(dead_uri, "exp", tmp_path)
    assert os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "7"
    assert (
        os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"]
        == NETWORK_LIMITS["MLFLOW_HTTP_REQUEST_MAX_RETRIES"]
    )
    assert (
        os.environ["MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR"]
        == NETWORK_LIMITS["MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR"]
    )
    assert os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] == "true"


def test_server_that_never_answers_times_out_into_offline(tmp_path, monkeypatch):
    # the default 10 s x 3 attempts is too slow for a test
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "1")
    with (
        socket.socket() as listening
    ):  # the kernel completes the handshake; nobody ever reads or replies
        listening.bind(("127.0.0.1", 0))
        listening.listen(8)
        uri = f"http://127.0.0.1:{listening.getsockname()[1]}"
        started = time.monotonic()
        tracker = Tracker.open(uri, "exp", tmp_path)
        assert time.monotonic() - started < 30
    assert tracker.offline_reason is not None and uri in tracker.offline_reason
    assert "Timeout" in tracker.offline_reason or "timed out" in tracker.offline_reason


def test_server_errors_5xx_give_an_offline_tracker(answering, tmp_path):
    uri = answering(503)
    started = time.monotonic()
    tracker = Tracker.open(uri, "exp", tmp_path)
    assert time.monotonic() - started < 30
    assert tracker.offline_reason is not None and uri in tracker.offline_reason


@pytest.mark.parametrize(
    "uri", ["foo://bar", "http://", "http://127.0.0.1:notaport", "https://host:99999"]
)
def test_bad_input_still_raises(uri, tmp_path):
    with pytest.raises(Exception) as error:
        Tracker.open(uri, "exp", tmp_path)
    assert not isinstance(error.value, AssertionError)


def test_a_server_that_is_not_mlflow_is_bad_input_not_an_outage(answering, tmp_path):
    with pytest.raises(MlflowException):
        Tracker.open(answering(404), "exp", tmp_path)


def test_sqlite_path_that_cannot_be_created_still_raises(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    # Whatever MLflow or SQLAlchemy raises: only that it raises (no offline tracker) is the point.
    with pytest.raises(Exception):  # noqa: B017
        Tracker.open(f"sqlite:///{blocker}/sub/mlflow.db", "exp", tmp_path)


def test_server_gone_mid_run_switches_offline_without_raising(store, dead_uri, tmp_path):
    tracker = working(store, "gone-mid-run")
    assert tracker.offline_reason is None
    parent = tracker.start_parent("p", {"a": 1}, {"study": "gone"})
    first = tracker.log_trial(RECORD, 1.0, {"study": "gone"})
    assert first is not None and tracker.unlogged_trials == 0

    # The same tracker, now talking to a server that is not there (a real client, not a mock). A
    # tracker opened on an http URI limits the network waits itself; this one was opened on sqlite.
    limit_network()
    tracker.uri, tracker.client = dead_uri, MlflowClient(tracking_uri=dead_uri)
    started = time.monotonic()
    assert tracker.log_trial(RECORD, 1.0, {"study": "gone"}) is None
    assert time.monotonic() - started < 30
    assert tracker.offline_reason is not None and dead_uri in tracker.offline_reason
    assert "became unreachable" in tracker.offline_reason
    assert tracker.unlogged_trials == 1
    assert_no_ops(tracker, tmp_path)  # one more unlogged trial, no more network waits
    assert tracker.unlogged_trials == 2

    stored = MlflowClient(tracking_uri=f"sqlite:///{store}/mlflow.db")
    assert stored.get_run(first).info.status == "FINISHED"
    # nobody could end it: the server was gone
    assert stored.get_run(parent).info.status == "RUNNING"


def test_other_mlflow_errors_keep_their_handling(store):
    tracker = working(store, "other-errors")
    tracker.start_parent("p", {}, {"study": "other"})
    # a run deleted in MLflow: nothing to tag, as before
    tracker.mark_pareto("other", {"no-such-run"})
    assert tracker.log_error is None
    # Any other error after the start costs the copy, never the run: kept, said once, not offline
    tracker.set_tags("no-such-run", {"k": "v"})
    assert tracker.log_error is not None and "tagging run no-such-run failed" in tracker.log_error
    assert tracker.offline_reason is None
    tracker.set_tags(tracker.parent_id, {"k": "v"})  # and the tracker goes on logging
    assert tracker.client.get_run(tracker.parent_id).data.tags["k"] == "v"


def test_log_trial_takes_the_trials_own_end_time(store):
    tracker = working(store, "end-time")
    tracker.start_parent("p", {}, {"study": "end"})
    end_ms = int(time.time() * 1000) - 3_600_000
    run_id = tracker.log_trial(RECORD, 12.5, {"study": "end"}, end_ms=end_ms)
    run = tracker.client.get_run(run_id)
    assert run.info.end_time == end_ms and run.info.start_time == end_ms - 12_500
    assert run.data.tags["trial"] == "3" and run.data.tags["throughput_unit"] == "tokens/s"
    assert tracker.trial_runs("end") == ({3: run_id}, [])


def test_log_text_writes_an_artifact_of_the_parent(store):
    tracker = working(store, "log-text")
    parent = tracker.start_parent("p", {}, {"study": "text"})
    tracker.log_text("a: 1\n", "config.yaml")
    assert {a.path for a in tracker.client.list_artifacts(parent)} == {"config.yaml"}


def test_runs_cut_off_are_told_apart_from_complete_ones(store):
    tracker = working(store, "cut-off")
    tracker.start_parent("p", {}, {"study": "cut"})
    complete = tracker.log_trial(RECORD, 1.0, {"study": "cut"})
    running = tracker.client.create_run(
        tracker.experiment_id, tags={"study": "cut", "trial": "4"}
    ).info.run_id
    killed = tracker.client.create_run(
        tracker.experiment_id, tags={"study": "cut", "trial": "5"}
    ).info.run_id
    tracker.end_run(killed, "KILLED")
    found, cut_off = tracker.trial_runs("cut")
    assert found == {3: complete}
    assert sorted(cut_off) == [(4, running), (5, killed)]
    found_ids = {r.info.run_id for r in tracker.find_runs("tags.study = 'cut'")}
    assert found_ids == {tracker.parent_id, complete, running, killed}


def test_more_params_and_tags_than_one_mlflow_request_takes_are_all_logged(store):
    # MLflow's stores (this sqlite one too) refuse over 100 params or tags in one request;
    # MlflowClient.log_batch splits the one call Tracker makes.
    tracker = working(store, "many-values")
    params = {f"param_{i}": i for i in range(250)}
    parent = tracker.start_parent("p", params, {"study": "many"})
    tags = {f"tag_{i}": f"value {i}" for i in range(150)}
    tracker.set_tags(parent, tags)
    data = tracker.client.get_run(parent).data
    assert data.params == {key: str(value) for key, value in params.items()}
    assert {key: data.tags[key] for key in tags} == tags


def test_any_error_while_logging_a_trial_costs_the_run_not_the_study(store, monkeypatch):
    # A 403 from a proxy, a TLS error, a busy sqlite store: not an outage, but the trial is in
    # Optuna already. Nothing raises; the half-logged run is ended KILLED (cut off, so that sync
    # deletes it and copies the trial again); the first error is kept, with no secret in it.
    tracker = working(store, "forbidden")
    tracker.uri = "https://alice:s3cret@mlflow.example"
    tracker.start_parent("p", {}, {"study": "forbidden"})

    def forbidden(*args, **kwargs):
        raise MlflowException(
            "API request to https://alice:s3cret@mlflow.example/api failed: 403 Forbidden"
        )

    monkeypatch.setattr(tracker.client, "log_batch", forbidden)
    assert tracker.log_trial(RECORD, 1.0, {"study": "forbidden"}) is None
    assert tracker.log_trial(RECORD, 1.0, {"study": "forbidden"}) is None
    assert tracker.unlogged_trials == 2 and tracker.offline_reason is None
    assert tracker.log_error is not None and "403 Forbidden" in tracker.log_error
    assert "s3cret" not in tracker.log_error and "trial 3" in tracker.log_error
    complete, cut_off = tracker.trial_runs("forbidden")
    assert complete == {} and len(cut_off) == 2
    statuses = {tracker.client.get_run(run_id).info.status for _, run_id in cut_off}
    assert statuses == {"KILLED"}


def test_two_studies_of_one_name_keep_to_their_own_runs(store):
    # Two machines, each with its own sqlite study 'llm-cpu', one MLflow server: each sees, tags
    # and repairs only the runs of its own study id (runs without an id are older ones: kept).
    mine, theirs = working(store, "one-name"), working(store, "one-name")
    mine.bind("aaaa"), theirs.bind("bbbb")
    mine.start_parent("p", {}, {"study": "llm-cpu"})
    theirs.start_parent("p", {}, {"study": "llm-cpu"})
    my_run = mine.log_trial(RECORD, 1.0, {"study": "llm-cpu"})
    their_run = theirs.log_trial(RECORD, 1.0, {"study": "llm-cpu"})
    older = mine.client.create_run(mine.experiment_id, tags={"study": "llm-cpu", "trial": "7"})
    mine.end_run(older.info.run_id, "FINISHED")
    assert mine.client.get_run(my_run).data.tags["study_id"] == "aaaa"
    assert mine.trial_runs("llm-cpu") == ({3: my_run, 7: older.info.run_id}, [])
    assert theirs.trial_runs("llm-cpu")[0] == {3: their_run, 7: older.info.run_id}

    theirs.mark_pareto("llm-cpu", {their_run})
    mine.mark_pareto("llm-cpu", {my_run})
    tags = {r: mine.client.get_run(r).data.tags["pareto"] for r in (my_run, their_run)}
    assert tags == {my_run: "true", their_run: "true"}, "one study untagged the other's front"
