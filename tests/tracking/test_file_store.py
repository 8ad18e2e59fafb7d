"""Which tracking URIs are refused as MLflow's file store (``file_store_refusal``), before any
command opens a store."""

from __future__ import annotations

import pytest

from search.tracking.connection import file_store_refusal


@pytest.mark.parametrize("uri", ["mlruns", "./runs/mlruns", "file:///tmp/mlruns"])
def test_a_folder_is_refused_with_the_uris_to_give_instead(uri, monkeypatch):
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    refusal = file_store_refusal(uri)
    assert refusal and f"tracking.uri '{uri}' names a folder" in refusal
    assert "tracking.uri=sqlite:///runs/mlflow.db" in refusal


def test_a_folder_is_taken_where_the_user_opted_back_into_mlflows_file_store(monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    assert file_store_refusal("mlruns") is None


@pytest.mark.parametrize(
    "uri",
    [
        "databricks",
        "databricks://profile",
        "sqlite:///runs/mlflow.db",
        "postgresql://user@host/db",
        "http://host:5000",
        "file://otherhost/mlruns",  # MLflow refuses a remote file: itself, with its own line
    ],
)
def test_a_uri_that_names_no_folder_here_is_left_to_mlflow(uri, monkeypatch):
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    assert file_store_refusal(uri) is None
