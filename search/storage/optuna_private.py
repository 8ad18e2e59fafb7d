"""Optuna's private API, in one place: what the study needs that Optuna has no public call for.

Every use of a private Optuna name (one starting with ``_``) in the package goes through a function
here, so that an Optuna release that changes one breaks this module alone, and the reason for each
use stays next to it. Checked against Optuna 5.0.0 (``pyproject.toml`` allows ``>=5.0,<6``).

- ``Study._storage`` and ``Trial._trial_id`` / ``FrozenTrial._trial_id``: a ``Trial`` caches its
  attributes as this process set them, and ``Study`` reads its trials through a cache of its own,
  so what another process (a racing claimant, a recovery) or a sampler wrote to a trial is seen
  only by asking the storage, which names a trial by its id, not its number. The heartbeat writes
  through the storage too (``record_heartbeat`` takes a trial id), and a constraint list only the
  storage's ``set_trial_system_attr`` sets.
- ``Study._study_id`` and ``BaseHeartbeat._get_stale_trial_ids``: which trials' heartbeats are past
  the grace period, so that they are failed here with the reason in their attributes, before
  ``optuna.storages.fail_stale_trials`` fails them with none.
- ``optuna.storages._heartbeat.is_heartbeat_enabled``: whether the storage keeps heartbeats at
  all (a module Optuna does not export).
- ``BaseDistribution._contains``: whether a value lies in a distribution, as Optuna itself checks a
  fixed or enqueued parameter; a measurement restored from ``unsaved.jsonl`` keeps its parameters
  only where they still fit the space's distributions.
"""

from __future__ import annotations

from typing import Any

import optuna
from optuna.distributions import BaseDistribution
from optuna.storages import BaseStorage
from optuna.storages._heartbeat import is_heartbeat_enabled
from optuna.trial import FrozenTrial, Trial

__all__ = [
    "distribution_contains",
    "heartbeat_enabled",
    "stale_trial_ids",
    "stored_trial",
    "study_storage",
    "trial_id",
]


def study_storage(study: optuna.Study) -> BaseStorage:
    """The storage ``study`` reads and writes, past the study's and its trials' caches."""
    return study._storage


def trial_id(trial: Trial | FrozenTrial) -> int:
    """The id the storage names ``trial`` by (its number is the study's count, not the key)."""
    return trial._trial_id


def stored_trial(study: optuna.Study, trial: Trial | FrozenTrial) -> FrozenTrial:
    """``trial`` as ``study``'s storage holds it now: with what other processes and the sampler
    wrote to it, which the trial's own cached attributes do not show."""
    return study._storage.get_trial(trial._trial_id)


def heartbeat_enabled(storage: BaseStorage) -> bool:
    """Whether ``storage`` keeps trial heartbeats (an ``RDBStorage`` with an interval, or Optuna's
    cache in front of one)."""
    return is_heartbeat_enabled(storage)


def stale_trial_ids(study: optuna.Study) -> list[int]:
    """The ids of ``study``'s running trials whose heartbeat is older than the grace period; only
    for a storage that keeps heartbeats (``heartbeat_enabled``)."""
    storage = study._storage
    return storage._get_stale_trial_ids(study._study_id)  # type: ignore[attr-defined]


def distribution_contains(distribution: BaseDistribution, value: Any) -> bool:
    """Whether ``value`` (as a space gives it) lies in ``distribution``."""
    return distribution._contains(distribution.to_internal_repr(value))
