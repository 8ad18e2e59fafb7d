"""What a study concludes and what a person reads: what a finished study hands its reports
(``study_result``), the trial line, the Pareto table and the files (``report``), what a study
concludes (``results``), the oracle view (``oracle``), the memory wall (``walls``), what compiling
cost and bought (``compiled``).

Exported: what the commands use, lazily (``search.core.lazy_exports``): ``results`` imports MLflow
(the tracker) and ``report`` rich, which the modules that only compute from records (``walls``,
``compiled``) do without. ``oracle`` is both a module and its main function; the package
leaves that name to the module (``from search.reporting.oracle import oracle``), so that
``search.reporting.oracle`` means one thing, and ``results`` is used as a module."""

from __future__ import annotations

from typing import TYPE_CHECKING

from search.core.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from search.reporting.compiled import compile_lines
    from search.reporting.oracle import oracle_lines, oracle_values, write_oracle_plot
    from search.reporting.report import (
        DESCRIPTION_CHARS,
        Columns,
        StudyProgress,
        console,
        front_cells,
        knobs_text,
        pareto_table,
        shown_metrics,
        summary_lines,
        summary_markdown,
        trial_line,
        write_noise_plot,
    )
    from search.reporting.study_result import StudyResult
    from search.reporting.walls import memory_walls, predicted_text, prediction_lines, wall_lines

__all__ = [
    "DESCRIPTION_CHARS",
    "Columns",
    "StudyProgress",
    "StudyResult",
    "compile_lines",
    "console",
    "front_cells",
    "knobs_text",
    "memory_walls",
    "oracle_lines",
    "oracle_values",
    "pareto_table",
    "predicted_text",
    "prediction_lines",
    "shown_metrics",
    "summary_lines",
    "summary_markdown",
    "trial_line",
    "wall_lines",
    "write_noise_plot",
    "write_oracle_plot",
]

__getattr__ = lazy_exports(
    __name__,
    {
        "compiled": ["compile_lines"],
        "oracle": ["oracle_lines", "oracle_values", "write_oracle_plot"],
        "report": [
            "DESCRIPTION_CHARS",
            "Columns",
            "StudyProgress",
            "console",
            "front_cells",
            "knobs_text",
            "pareto_table",
            "shown_metrics",
            "summary_lines",
            "summary_markdown",
            "trial_line",
            "write_noise_plot",
        ],
        "study_result": ["StudyResult"],
        "walls": ["memory_walls", "predicted_text", "prediction_lines", "wall_lines"],
    },
)
