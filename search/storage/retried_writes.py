"""Writes to a study storage that fails: retried with back-off, and a measurement the storage would
not take kept in ``runs_dir/unsaved.jsonl`` until ``sync`` adds it to the study."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import optuna
from optuna.trial import FrozenTrial, TrialState

from search.config.compose import redact
from search.core.errors import StoreError
from search.storage.optuna_private import distribution_contains

__all__ = ["UNSAVED", "WRITE_ATTEMPTS", "keep_unsaved", "restore_unsaved", "retried"]

T = TypeVar("T")

WRITE_ATTEMPTS = 6
"""Attempts at one write to the study before it is given up (waits of 0.5, 1, 2, 4, 8 s between:
over 15 s, three times sqlite's own wait for a lock)."""
UNSAVED = "unsaved.jsonl"
"""In ``runs_dir``: measurements the study could not take (one JSON object a line), for ``sync``
to add to the study."""


def retried(write: Callable[[], T], what: str) -> T:
    """``write()``, tried again with back-off while the storage fails (a locked sqlite file, a
    full disk, a dropped database connection); ``StoreError`` after the last attempt. Refusals of
    the write itself (a finished trial, a bad value) are raised at once. Opening the study is
    retried otherwise (``search.storage.opening.with_retries`` says how and why)."""
    for attempt in range(WRITE_ATTEMPTS):
        try:
            return write()
        except (optuna.exceptions.StorageInternalError, OSError) as e:
            if attempt == WRITE_ATTEMPTS - 1:
                cause = str(e.__cause__ or e).strip().splitlines()
                raise StoreError(
                    f"cannot {what} after {WRITE_ATTEMPTS} attempts: {type(e).__name__}"
                    + (f": {redact(cause[0])}" if cause else "")
                ) from e
            time.sleep(0.5 * 2**attempt)
    raise AssertionError("unreachable")


def keep_unsaved(
    runs_dir: Path, study: optuna.Study, number: int, attrs: Mapping[str, Any], values: Any
) -> Path | None:
    """Append a measurement the study could not take to ``runs_dir/unsaved.jsonl``; its path, or
    None when that cannot be written either (then the line goes to stderr)."""
    try:
        study_id = study.user_attrs.get("study_id")
    except Exception:  # the storage that just failed may fail this read too
        study_id = None
    line = json.dumps(
        {
            "study": study.study_name,
            "study_id": study_id,
            "trial": number,
            "user_attrs": dict(attrs),
            "values": None if values is None else [float(v) for v in values],
        },
        default=str,
    )
    path = runs_dir / UNSAVED
    try:
        runs_dir.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write(line + "\n")
        return path
    except OSError:
        print(f"search: unsaved measurement: {line}", file=sys.stderr)
        return None


def restore_unsaved(
    study: optuna.Study, runs_dir: Path, distributions: Mapping[str, tuple[str, Any]]
) -> list[int]:
    """Add the measurements of this study kept in ``runs_dir/unsaved.jsonl`` (see
    ``store_measured``) to the study as new trials; the numbers they had. Lines of other studies
    stay in the file; one already in the study (the write had gone through after all) is not added
    twice. ``distributions``: each searched knob's Optuna name and distribution, so that the
    sampler learns from a restored trial whose configuration still fits them."""
    path = runs_dir / UNSAVED
    if not path.exists():
        return []
    ours = {study.study_name}
    kept, restored = [], []

    def key(attrs: Mapping[str, Any]) -> tuple[str, Any, Any]:
        config = json.dumps(attrs.get("config"), sort_keys=True)
        return config, attrs.get("measured_at"), attrs.get("state")

    finished = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.FAIL))
    present = {key(t.user_attrs) for t in finished}
    for line in path.read_text().splitlines():
        entry = json.loads(line)
        if entry.get("study") not in ours or entry.get("study_id") not in (
            None,
            study.user_attrs.get("study_id"),
        ):
            kept.append(line)
            continue
        attrs, values = entry["user_attrs"], entry["values"]
        if key(attrs) not in present:
            study.add_trial(_restored_trial(attrs, values, distributions))
            present.add(key(attrs))
        restored.append(int(entry["trial"]))
    if kept:
        path.write_text("".join(f"{line}\n" for line in kept))
    else:
        path.unlink()
    return restored


def _restored_trial(
    attrs: Mapping[str, Any], values: Sequence[float] | None, distributions: Mapping[str, Any]
) -> FrozenTrial:
    config = attrs.get("config", {})
    params = {name: config[knob] for knob, (name, _) in distributions.items() if knob in config}
    dists = {name: dist for knob, (name, dist) in distributions.items() if knob in config}
    fits = len(params) == len(distributions) and all(
        distribution_contains(dists[n], v) for n, v in params.items()
    )
    return optuna.trial.create_trial(
        params=params if fits else None,
        distributions=dists if fits else None,
        values=values,
        state=TrialState.COMPLETE if values is not None else TrialState.FAIL,
        user_attrs={**attrs, "restored_from": "unsaved.jsonl"},
    )
