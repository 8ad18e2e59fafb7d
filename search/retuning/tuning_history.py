"""The history of a study's tunings and re-tunes: the recommendation run by run, as rows,
``history.csv`` and ``history.png``."""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from search.core.records import value_text
from search.retuning.tuned import Tuned

__all__ = ["HISTORY_COLUMNS", "config_text", "history_rows", "write_history"]

HISTORY_COLUMNS = [
    "name",
    "kind",
    "device",
    "verdict",
    "throughput",
    "ci_low",
    "ci_high",
    "unit",
    "confirmed_runs",
    "config",
    "mlflow_run_id",
]
"""``confirmed_runs``: the fresh runs behind the figure (0: a search figure, never confirmed; such a
run cannot be a re-tune's baseline). ``mlflow_run_id``: the invocation's parent run (tagged
``recorded_as`` with ``name``)."""


def config_text(config_json: str) -> str:
    """A row's configuration (JSON in ``history.csv``) as a person reads it: ``k=v, k=v``."""
    if not config_json:
        return "-"
    return ", ".join(f"{k}={value_text(v)}" for k, v in json.loads(config_json).items())


def history_rows(runs: Sequence[Tuned]) -> list[dict[str, Any]]:
    rows = []
    for t in runs:
        r = t.recommended
        rows.append(
            {
                "name": t.name,
                "kind": t.kind,
                "device": t.device,
                "verdict": t.verdict or "-",
                "throughput": "" if r is None else f"{r.throughput:.6g}",
                "ci_low": "" if r is None else f"{r.low:.6g}",
                "ci_high": "" if r is None else f"{r.high:.6g}",
                "unit": f"{t.unit}/s",
                "confirmed_runs": 0 if r is None else len(r.runs),
                "config": "" if r is None else json.dumps(r.config, sort_keys=True),
                "mlflow_run_id": t.mlflow_run_id or "",
            }
        )
    return rows


def write_history(study_dir: Path, runs: Sequence[Tuned], title: str) -> tuple[Path, Path]:
    """``history.csv`` and ``history.png``: the recommended configuration's throughput (with its
    interval) and which configuration it was, run after run."""
    study_dir.mkdir(parents=True, exist_ok=True)
    csv_path = study_dir / "history.csv"
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=HISTORY_COLUMNS)
        writer.writeheader()
        writer.writerows(history_rows(runs))
    png_path = study_dir / "history.png"
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [t for t in runs if t.recommended is not None]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(shown) + 2), 4.5))
    configs: list[str] = []
    for i, t in enumerate(shown):
        r = t.recommended
        assert r is not None
        key = json.dumps(r.config, sort_keys=True)
        if key not in configs:
            configs.append(key)
        color = f"C{configs.index(key) % 10}"
        ax.errorbar(
            [i],
            [r.throughput],
            yerr=[[r.throughput - r.low], [r.high - r.throughput]],
            fmt="o",
            color=color,
            capsize=4,
        )
        ax.annotate(
            f"#{configs.index(key) + 1}",
            (i, r.high),
            textcoords="offset points",
            xytext=(0, 4),
            ha="center",
            fontsize=8,
        )
    ax.set_xticks(range(len(shown)), [t.name for t in shown], rotation=30, ha="right", fontsize=7)
    unit = shown[0].unit if shown else "items"
    ax.set_ylabel(f"recommended throughput ({unit}/s, 95% CI)")
    ax.set_title(title, fontsize=9)
    legend = "\n".join(f"#{i + 1}: {config_text(c)}" for i, c in enumerate(configs))
    if legend:
        # below the run names, where a long configuration has the figure's width, not a margin's
        ax.text(0.0, -0.3, legend, transform=ax.transAxes, fontsize=7, va="top")
    fig.savefig(png_path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return csv_path, png_path
