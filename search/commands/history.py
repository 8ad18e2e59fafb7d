"""``python -m search history +space=NAME [overrides]``: the study's tunings and re-tunes, run by
run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import optuna
from rich.table import Table

from search.config.compose import load_settings, redact
from search.core.errors import ConfigError
from search.core.records import si
from search.reporting.report import console
from search.retuning.tuned import tuned_runs
from search.retuning.tuning_history import config_text, history_rows, write_history
from search.storage.stores import quiet_libraries, require_study

__all__ = ["run_history"]


def run_history(cfg_node: Any) -> int:
    """``python -m search history``: the study's tunings and re-tunes as a table, and
    ``history.csv`` / ``history.png`` in ``runs_dir/<study>/``."""
    quiet_libraries()
    settings = load_settings(cfg_node)
    name, storage = settings.study.name, settings.study.storage
    require_study(name, storage)
    study = optuna.load_study(study_name=name, storage=storage)
    runs = tuned_runs(study)
    if not runs:
        raise ConfigError(
            f"study '{name}' in {redact(storage)} has no finished tuning recorded yet: run the "
            "tuning first (python -m search with the same arguments)"
        )
    table = Table(title=f"{name}: the recommended configuration, run by run")
    for column in ("run", "device", "verdict", "throughput (95% CI)", "runs", "configuration"):
        table.add_column(column)
    for row in history_rows(runs):
        figure = (
            f"{si(float(row['throughput']))} [{si(float(row['ci_low']))}, "
            f"{si(float(row['ci_high']))}] {row['unit']}"
            if row["throughput"]
            else "none"
        )
        confirmed = str(row["confirmed_runs"]) if row["confirmed_runs"] else "unconfirmed"
        config = config_text(row["config"])
        table.add_row(row["name"], row["device"], row["verdict"], figure, confirmed, config)
    out = console()
    out.print(table)
    csv_path, png_path = write_history(
        Path(settings.runs_dir) / name, runs, f"{name}: recommended, run by run"
    )
    out.print(f"files: {csv_path}, {png_path.name}", markup=False)
    return 0
