"""Opening the Optuna study: retried while processes race to create it, its storage errors as one
line, and the study id that keeps two studies of one name apart in MLflow."""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Callable
from typing import Any

import optuna
from optuna.study import StudyDirection

from search.config.compose import redact
from search.core.errors import ConfigError
from search.core.metrics import ranked_on
from search.space.search_space import SearchSpace
from search.storage.liveness import Recovery, engine_kwargs

__all__ = [
    "OPEN_ATTEMPTS",
    "STUDY_ID",
    "STUDY_ID_SETTLE_S",
    "STUDY_ID_WAIT_S",
    "open_study",
    "storage_error",
    "study_id",
    "with_retries",
]

OPEN_ATTEMPTS = 4


def with_retries(open_store: Callable[[], Any]) -> Any:
    """``open_store()``, tried again after a short pause if it fails: processes started together on
    a new sqlite file race to create its tables, and all but one see an error the first time.

    Not ``search.storage.retried_writes.retried``, which differs in each of its three choices.
    What is retried: here any error, since the race surfaces as whatever the database, Optuna or
    MLflow raises while another process creates the tables; a write retries only the storage's
    failures and raises a refusal of the write at once. The pause: here a few short ones with a
    random part, to spread apart processes that started together; a write backs off
    exponentially, long enough to outlast a lock. The last failure: here raised as it is, for the
    caller to name the bad input (``storage_error``); a write raises ``StoreError``."""
    for attempt in range(OPEN_ATTEMPTS):
        try:
            return open_store()
        except Exception:
            if attempt == OPEN_ATTEMPTS - 1:
                raise
            time.sleep(0.5 * (attempt + 1) + random.random() * 0.5)


def storage_error(storage: str, e: Exception) -> ConfigError:
    """One line on why ``storage`` could not be opened; a missing database driver is named."""
    hint = ""
    if isinstance(e, ImportError):
        scheme = storage.split(":", 1)[0].split("+", 1)[0]
        driver = {"postgresql": "psycopg[binary]", "mysql": "PyMySQL"}.get(scheme)
        if driver:
            hint = f" (the {scheme} driver is missing: pip install '{driver}')"
    return ConfigError(
        f"cannot open study.storage {redact(storage)!r}: {type(e).__name__}: "
        f"{str(e).splitlines()[0] if str(e) else ''}{hint}"
    )


def open_study(
    name: str, storage: str, space: SearchSpace, recovery: Recovery | None = None
) -> optuna.Study:
    """Create or load the study; a storage that cannot be opened or other objectives are bad input.

    With ``recovery``, the storage keeps heartbeats of running trials (see
    ``search.storage.liveness``).
    """
    directions = [o.direction for o in space.objectives]
    # What Optuna ranks: docs/method/ranking.md.
    metrics = [ranked_on(o.metric) for o in space.objectives]

    def create() -> tuple[optuna.Study, bool]:
        backend = (
            recovery.storage(storage)
            if recovery is not None
            else optuna.storages.RDBStorage(storage, engine_kwargs=engine_kwargs(storage))
        )
        try:
            created = optuna.create_study(
                study_name=name,
                storage=backend,
                directions=[StudyDirection[d.upper()] for d in directions],
            )
            return created, True
        except optuna.exceptions.DuplicatedStudyError:
            return optuna.load_study(study_name=name, storage=backend), False

    try:
        study, created = with_retries(create)
    except Exception as e:  # sqlalchemy, driver and connection errors alike: all about the URL
        raise storage_error(storage, e) from None
    stored = [d.name.lower() for d in study.directions]
    stored_metrics = study.metric_names
    if stored != directions or (stored_metrics is not None and stored_metrics != metrics):
        raise ConfigError(
            f"study '{name}' holds objectives {stored_metrics or stored} but the space asks for "
            f"{dict(zip(metrics, directions, strict=True))}: choose a new study.name, "
            "or restore the objectives"
        )
    study.set_metric_names(metrics)
    _give_id(study, created)
    return study


STUDY_ID = "study_id"
"""Study user attr: a random id given when the study is created, tagged on every MLflow run of
the study, so that two studies of one name (say, each machine's own sqlite ``llm-cpu``) logging to
one MLflow server never take each other's runs for their own."""
STUDY_ID_WAIT_S = 5.0
"""How long a process that found the study waits for its creator to write the id."""
STUDY_ID_SETTLE_S = 0.5
"""How long a process that gave an older study its id waits before reading back the one that
stands (another process may have written its own meanwhile)."""


def _give_id(study: optuna.Study, created: bool) -> None:
    """Give a study its id: the process that created it writes one; one that found it reads the
    creator's (waiting a moment for a creator that started together with it); a study created
    before ids existed gets one from the first process that opens it."""
    if created:
        study.set_user_attr(STUDY_ID, uuid.uuid4().hex)
        return
    deadline = time.monotonic() + STUDY_ID_WAIT_S
    while STUDY_ID not in study.user_attrs:
        if study.trials or time.monotonic() > deadline:
            # An older study: another process opening it now may write an id of its own. The last
            # write stands; reading it back after a moment (``study_id``) makes every process use
            # that one.
            study.set_user_attr(STUDY_ID, uuid.uuid4().hex)
            time.sleep(STUDY_ID_SETTLE_S)
            return
        time.sleep(0.1)


def study_id(study: optuna.Study) -> str:
    """The study's id (see ``STUDY_ID``)."""
    return str(study.user_attrs[STUDY_ID])
