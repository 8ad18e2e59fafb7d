"""Which tracking URIs are refused as MLflow's file store before any store is opened."""

from __future__ import annotations

import dataclasses

import pytest
from factories import llm_settings

from search.core.errors import ConfigError
from search.storage import stores


def _with_tracking_uri(uri: str):
    settings = llm_settings()
    return dataclasses.replace(settings, tracking=dataclasses.replace(settings.tracking, uri=uri))


@pytest.mark.parametrize("uri", ["mlruns", "./runs/mlruns", "file:///tmp/mlruns"])
def test_a_folder_is_refused_with_the_uris_to_give_instead(uri, tmp_path, monkeypatch):
    monkeypatch.setattr(stores.Tracker, "open", lambda *a: pytest.fail("opened a file store"))
    with pytest.raises(ConfigError, match="names a folder .*sqlite:///runs/mlflow.db"):
        stores._open_tracker(_with_tracking_uri(uri), tmp_path)


@pytest.mark.parametrize(
    "uri", ["databricks", "databricks://profile", "sqlite:///runs/mlflow.db", "http://host:5000"]
)
def test_a_uri_without_a_folder_goes_to_mlflow(uri, tmp_path, monkeypatch):
    opened = []
    monkeypatch.setattr(stores.Tracker, "open", lambda u, *a: opened.append(u) or "tracker")
    assert stores._open_tracker(_with_tracking_uri(uri), tmp_path) == "tracker"
    assert opened == [uri]
