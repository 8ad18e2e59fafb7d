"""The re-tune's report files: ``retune/<time>.md`` for a person and ``.json`` for a program."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from search.core.records import si
from search.retuning.figure import Figure
from search.retuning.tuned import Tuned
from search.retuning.verdict import MOVED, Conclusion

__all__ = ["write_report"]


def write_report(
    study_dir: Path, base: Tuned, today: Tuned, conclusion: Conclusion, knob_names: Sequence[str]
) -> tuple[Path, Path]:
    """``retune/<time>.md`` and ``.json`` under ``study_dir``."""
    folder = study_dir / "retune"
    folder.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(today.time_s))
    json_path = folder / f"{stamp}.json"
    json_path.write_text(json.dumps(_report_data(base, today, conclusion), indent=2, default=str))
    md_path = folder / f"{stamp}.md"
    md_path.write_text("\n".join(_report_lines(base, today, conclusion, knob_names)))
    return md_path, json_path


def _report_data(base: Tuned, today: Tuned, conclusion: Conclusion) -> dict[str, Any]:
    """What the ``.json`` report holds: the verdict, every comparison, and both runs in full."""
    return {
        "verdict": conclusion.verdict,
        "line": conclusion.line,
        "comparisons": [_finite_or_none(asdict(c)) for c in conclusion.comparisons],
        "changed": conclusion.changed,
        "gate": None if conclusion.gate is None else conclusion.gate.what,
        "hint": conclusion.hint,
        "baseline": base.as_dict(),
        "today": today.as_dict(),
    }


def _report_lines(
    base: Tuned, today: Tuned, conclusion: Conclusion, knob_names: Sequence[str]
) -> list[str]:
    """The ``.md`` report, line by line: the verdict, the comparisons as a table, what changed,
    and both recommendations."""

    def shown_config(f: Figure | None) -> str:
        if f is None:
            return "none"
        return ", ".join(f"{k}={f.config[k]}" for k in knob_names if k in f.config)

    def shown(f: Figure | None) -> str:
        if f is None:
            return "none"
        return (
            f"{shown_config(f)}: {si(f.throughput)} [{si(f.low)}, {si(f.high)}] {today.unit}/s"
            + (f" ({len(f.runs)} fresh runs)" if f.runs else "")
        )

    return [
        f"# Re-tune {today.name}: {conclusion.verdict}",
        "",
        conclusion.line,
        "",
        *_notes(base, today, conclusion, shown_config),
        "| comparison | verdict | ratio | 95% CI | fresh runs (today, baseline) |",
        "|---|---|---|---|---|",
        *[
            f"| {c.what} | {c.label} | {c.ratio:.3f} | [{c.low:.3f}, {c.high:.3f}] | "
            f"{c.runs[0]}, {c.runs[1]} |"
            for c in conclusion.comparisons
        ],
        "",
        *([conclusion.hint, ""] if conclusion.hint else []),
        "## What changed",
        "",
        *([f"- {c}" for c in conclusion.changed] or ["- nothing recorded"]),
        "",
        "## Recommendations",
        "",
        f"- baseline ({base.name}): {shown(base.recommended)}",
        f"- today ({today.name}): {shown(today.recommended)}",
        "",
    ]


def _notes(
    base: Tuned, today: Tuned, conclusion: Conclusion, shown_config: Callable[[Figure | None], str]
) -> list[str]:
    """Where the recommendation moved, or was kept though the search found another."""
    if conclusion.verdict == MOVED:
        return [
            f"Optimum moved: {shown_config(base.recommended)} -> {shown_config(today.recommended)}",
            "",
        ]
    kept = conclusion.kept
    if kept is None:
        return []
    return [
        f"The old recommendation was kept: the search's best read {kept.ratio:.3f}x "
        f"[{kept.low:.3f}, {kept.high:.3f}] of it in the same rounds, not surely faster by more "
        "than retune.threshold.",
        "",
    ]


def _finite_or_none(d: Mapping[str, Any]) -> dict[str, Any]:
    """``d`` with infinite numbers (an unbounded interval) as None: JSON has no infinity."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in d.items()}
