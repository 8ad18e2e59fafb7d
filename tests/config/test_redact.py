"""Secrets never reach the terminal, Optuna attributes or MLflow: URLs and keys are redacted."""

import pytest

from search.commands.cli import main
from search.config.compose import redact, redact_tree
from search.core.errors import ConfigError

SECRETS = [
    ("https://alice:s3cret@host:5000/path", "https://alice:***@host:5000/path"),
    ("postgresql://u:pw@db.example/optuna", "postgresql://u:***@db.example/optuna"),
    ("https://TOKEN123@host", "https://***@host"),
    ("redis://:pw@host:6379", "redis://:***@host:6379"),
    (
        "postgresql://host/db?password=x&sslmode=require",
        "postgresql://host/db?password=***&sslmode=require",
    ),
    ("http://host/api?token=abc&user=bob", "http://host/api?token=***&user=bob"),
    (
        "Connection to 'https://alice:s3cret@host' failed: TLS error",
        "Connection to 'https://alice:***@host' failed: TLS error",
    ),
    ("sqlite:///runs/optuna.db", "sqlite:///runs/optuna.db"),
    ("http://mlflow:5000", "http://mlflow:5000"),
]


@pytest.mark.parametrize(("text", "expected"), SECRETS)
def test_every_kind_of_secret_in_a_url_is_redacted(text, expected):
    assert redact(text) == expected


def test_values_under_secret_looking_keys_are_redacted_whole():
    tree = {"tracking": {"uri": "http://h", "token": "abc"}, "db_password": "pw", "n": 3}
    assert redact_tree(tree) == {
        "tracking": {"uri": "http://h", "token": "***"},
        "db_password": "***",
        "n": 3,
    }


def test_an_error_line_that_carries_a_password_is_redacted(monkeypatch, capsys):
    # e.g. a TLS failure: the library's own message repeats the URL with its password
    import search.config.compose

    def fail(*args, **kwargs):
        raise ConfigError("cannot open https://alice:s3cret@host: TLS error")

    monkeypatch.setattr(search.config.compose, "compose_config", fail)
    assert main(["+space=llm"]) == 2
    err = capsys.readouterr().err
    assert "s3cret" not in err and "https://alice:***@host" in err


def test_a_value_read_from_the_environment_is_logged_as_its_interpolation(monkeypatch):
    import json

    from search.config.compose import compose_config, for_logging

    monkeypatch.setenv("HUB_SECRET", "hunter2hunter2")
    cfg = compose_config(
        [
            "+space=llm",
            "+space.workload.hub=${oc.env:HUB_SECRET}",  # a neutral key: no name gives it away
            "+space.workload.copy=${space.workload.hub}",  # the value reached another way
            "+space.workload.url=http://host/${oc.env:HUB_SECRET}/x",
        ]
    )
    logged = for_logging(cfg)
    assert "hunter2" not in json.dumps(logged)
    assert logged["space"]["workload"]["hub"] == "${oc.env:HUB_SECRET}"
    assert logged["space"]["workload"]["copy"] == "***"
    assert logged["study"]["n_trials"] == cfg.study.n_trials, "the rest as resolved"
