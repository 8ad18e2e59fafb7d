"""``search.tune`` and ``search.retune``: the command line's tuning and re-tune as calls that
return what they found, for a notebook, a pipeline or a training script.

Each composes the same config the command line would from the same overrides, and runs the same
invocation (``search.commands.tune``): every check applies, and where the command line prints one
line and exits 2, these raise the same line as a ``SearchError`` (``ConfigError``, a subclass).
Trials run in fresh processes that import the workload class by name: a class in an importable
module, or in the script that calls ``tune`` (each trial imports that script under another name,
as ``multiprocessing`` does, so its top-level work must sit under ``if __name__ == "__main__"``).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from search.core.errors import ConfigError

if TYPE_CHECKING:
    import optuna
    import pandas
    from omegaconf import DictConfig

    from search.commands.tune import Ran

__all__ = ["RetuneResult", "TuneResult", "retune", "tune"]


@dataclass(frozen=True)
class TuneResult:
    """What a tuning found."""

    recommended: dict[str, Any] | None
    """The recommended configuration (``best.yaml``'s ``recommended.config``); None where no
    stable front configuration met the slo."""
    best: dict[str, Any]
    """``best.yaml`` in full: the recommendation's metrics, its confirmed figure and interval."""
    front: pandas.DataFrame
    """The final Pareto front (``pareto.csv``): one row a configuration, its knobs, its metrics
    and their intervals (``throughput_ci_low``, ``throughput_ci_high``, ...), fastest first."""
    study: optuna.Study
    """The Optuna study, every trial of every invocation in it."""
    mlflow_run_id: str | None
    """This invocation's MLflow parent run (None where MLflow could not be reached)."""
    study_dir: Path
    """Where the files are: ``best.yaml``, ``pareto.csv``, ``summary.md``, the plots."""
    exit_code: int
    """As the command line's: 0 done, 1 stopped early (too many trials failed), 3 a re-tune's
    regression."""


@dataclass(frozen=True)
class RetuneResult(TuneResult):
    """What a re-tune found, and its verdict."""

    verdict: str
    """regression, moved, improved, same or ambiguous (``search.retuning.verdict``)."""
    line: str
    """The verdict's line as the command line prints it last."""


def tune(
    space: str,
    overrides: Sequence[str] = (),
    *,
    workload: type | str | None = None,
    workload_settings: Mapping[str, Any] | None = None,
    config_dir: str | Path | None = None,
) -> TuneResult:
    """Tune ``space`` (a space's name: ``spaces/NAME.yaml``, or ``config_dir/space/NAME.yaml``)
    with Hydra ``overrides`` (``["study.n_trials=8", "device=cpu"]``), as
    ``python -m search +space=NAME OVERRIDES`` would. ``workload``: a ``Workload`` class (or its
    dotted name) in place of the space's, built with ``workload_settings`` as keyword arguments;
    the space's knobs and objectives stay. Raises ``SearchError`` on bad input."""
    from search.commands.tune import tuning

    asked = _Asked(space, overrides, workload, workload_settings, config_dir)
    ran, cfg = _invoked(tuning, asked, [], [])
    return TuneResult(**_found(ran, cfg))


def retune(
    space: str,
    overrides: Sequence[str] = (),
    *,
    workload: type | str | None = None,
    workload_settings: Mapping[str, Any] | None = None,
    config_dir: str | Path | None = None,
) -> RetuneResult:
    """Re-tune ``space`` against its last tuning, as ``python -m search retune`` would (the same
    arguments as ``tune``). A regression is a verdict, not an error: ``verdict == "regression"``
    and ``exit_code == 3``."""
    from search.commands.tune import retuning

    asked = _Asked(space, overrides, workload, workload_settings, config_dir)
    reports: list[Path] = []  # the reports before this re-tune: its own is the one not among them
    ran, cfg = _invoked(retuning, asked, ["retune"], reports)
    report = _new_report(ran.study_dir, reports)
    return RetuneResult(
        **_found(ran, cfg), verdict=report.get("verdict", ""), line=report.get("line", "")
    )


@dataclass(frozen=True)
class _Asked:
    """What a call of ``tune`` or ``retune`` was given."""

    space: str
    overrides: Sequence[str]
    workload: type | str | None
    workload_settings: Mapping[str, Any] | None
    config_dir: str | Path | None


def _composed(asked: _Asked) -> tuple[DictConfig, list[str]]:
    """The config the command line would compose, with ``asked.workload`` in place of the
    space's; and the words of the equivalent command line (the parent run's ``command`` tag)."""
    from omegaconf import OmegaConf, open_dict

    from search.commands.cli import refuse_a_file_store
    from search.config.compose import compose_config

    if isinstance(asked.overrides, str):
        raise ConfigError(f"overrides must be a list of key=value strings, not {asked.overrides!r}")
    space = asked.space
    words = [space if space.startswith("+space=") else f"+space={space}", *asked.overrides]
    dirs = [str(asked.config_dir)] if asked.config_dir is not None else []
    cfg = compose_config(words, dirs)
    if asked.workload is not None:
        node = {"_target_": _target(asked.workload), **(asked.workload_settings or {})}
        try:
            created = OmegaConf.create(node)
        except Exception as e:  # a value a config cannot hold: a callable, a dtype, ...
            raise ConfigError(f"workload_settings: {' '.join(str(e).split())[:200]}") from None
        with open_dict(cfg):
            cfg.space.workload = created
    elif asked.workload_settings:
        raise ConfigError("workload_settings needs workload (the class they are passed to)")
    refuse_a_file_store(str(cfg.tracking.uri))
    return cfg, words + [w for d in dirs for w in ("--config-dir", d)]


def _target(workload: type | str) -> str:
    """The dotted name trials import ``workload`` by; a class that no fresh process can import
    (one defined in a notebook's cell or in a function) is refused with the way out."""
    if isinstance(workload, str):
        return workload
    module, name = workload.__module__, workload.__qualname__
    if "<locals>" in name:
        raise ConfigError(
            f"workload {name} is defined inside a function: trials run in fresh processes that "
            "import it by name; define it at a module's top level"
        )
    if module == "__main__" and not getattr(sys.modules["__main__"], "__file__", None):
        raise ConfigError(
            f"workload {name} is defined in an interactive session (a notebook, say): trials run "
            "in fresh processes that import it by name; put it in a .py file beside the notebook "
            "and import it from there"
        )
    return f"{module}.{name}"


def _invoked(
    invocation: Any, asked: _Asked, command: list[str], reports: list[Path]
) -> tuple[Ran, DictConfig]:
    """``invocation`` (``tuning`` or ``retuning``) of what was ``asked``, run as the command line
    runs it: the trials' fork server first, the invocation recorded as its ``command`` words; a
    bad input's line raised as the command line prints it (passwords redacted), Ctrl-C raised as
    ``KeyboardInterrupt`` once the invocation has ended its runs. ``reports``: filled with the
    re-tune reports that were there before it ran."""
    from search.commands.invocation import invoked_as
    from search.config.compose import redact
    from search.execution.worker_server import start_worker_server

    start_worker_server()
    try:
        cfg, words = _composed(asked)
        reports += _reports(_study_dir(cfg))
        with invoked_as([*command, *words]):
            ran = invocation(cfg)
    except ConfigError as e:
        raise ConfigError(redact(str(e))) from None
    if ran.code == 130:  # the invocation caught Ctrl-C to end its runs as KILLED
        raise KeyboardInterrupt
    return ran, cfg


def _study_dir(cfg: DictConfig) -> Path:
    from search.config.compose import resolve

    resolved = resolve(cfg)
    return Path(resolved["runs_dir"]) / resolved["study"]["name"]


def _found(ran: Ran, cfg: DictConfig) -> dict[str, Any]:
    """``TuneResult``'s fields from what ``ran`` left in its study folder and stores."""
    import optuna
    import pandas
    import yaml

    from search.config.compose import resolve

    best_path, front_path = ran.study_dir / "best.yaml", ran.study_dir / "pareto.csv"
    best = yaml.safe_load(best_path.read_text()) if best_path.exists() else {}
    recommended = (best.get("recommended") or {}).get("config")
    front = pandas.read_csv(front_path) if front_path.exists() else pandas.DataFrame()
    study_settings = resolve(cfg)["study"]
    study = optuna.load_study(study_name=study_settings["name"], storage=study_settings["storage"])
    return {
        "recommended": dict(recommended) if recommended else None,
        "best": best or {},
        "front": front,
        "study": study,
        "mlflow_run_id": ran.parent_run_id,
        "study_dir": ran.study_dir,
        "exit_code": ran.code,
    }


def _reports(study_dir: Path) -> list[Path]:
    return sorted((study_dir / "retune").glob("*.json"))


def _new_report(study_dir: Path, before: list[Path]) -> dict[str, Any]:
    """The report this re-tune wrote (``retune/<time>.json``); empty where it wrote none."""
    new = [p for p in _reports(study_dir) if p not in before]
    return json.loads(new[-1].read_text()) if new else {}
