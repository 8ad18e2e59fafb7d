"""One invocation: validate everything, then run the study and report.

All validation happens before anything is written, so bad input leaves ``runs_dir`` untouched.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import sys
import time
from pathlib import Path
from typing import Any, Mapping

import torch
from omegaconf import DictConfig, OmegaConf

from search import pareto
from search.config import ConfigError, resolve, resolve_device
from search.knobs import GENERIC_KNOBS, unsupported_reason
from search.measure import MeasureSettings
from search.report import console, pareto_table, trial_line, write_best, write_csv, write_plot
from search.runner import COMPLETE, TrialRequest, TrialResult
from search.space import SearchSpace, SpaceError, parse_space
from search.study import SAMPLERS, StudyDriver, TrialRecord
from search.telemetry import environment
from search.tracking import Tracker
from search.workloads import Workload


def load_space(cfg: Mapping[str, Any], device: torch.device) -> tuple[SearchSpace, list[str]]:
    """The space of ``cfg`` for ``device``: choices the device cannot run are dropped, with notes."""
    try:
        space = parse_space(cfg["space"]["name"], cfg["space"])
        space, notes = space.without_choices(
            lambda name, value: unsupported_reason(name, value, device) if name in GENERIC_KNOBS else None
        )
        feasible = space.feasible_configs()
    except SpaceError as e:
        raise ConfigError(str(e)) from None
    if feasible is not None and not feasible:
        raise ConfigError(f"space '{space.name}': no configuration satisfies the constraints "
                          f"{[c.text for c in space.constraints]}; loosen them or widen the ranges")
    _check_workload(space)
    return space, notes


def workload_class(space: SearchSpace) -> type:
    target = space.workload["_target_"]
    module_name, _, class_name = target.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), class_name)
    except Exception as e:  # ImportError, AttributeError, or an error raised by the module itself
        raise ConfigError(f"space '{space.name}': workload._target_ {target!r} does not import "
                          f"({type(e).__name__}: {e}); check the name and that its package is on PYTHONPATH") from None


def _check_workload(space: SearchSpace) -> None:
    target = space.workload["_target_"]
    cls = workload_class(space)
    missing = [m for m in ("build_model", "make_batch", "loss") if not callable(getattr(cls, m, None))]
    if missing:
        raise ConfigError(f"space '{space.name}': workload {target} lacks {', '.join(missing)}; "
                          "subclass search.workloads.Workload (see README, 'Your own workload')")
    recompute = space.params.get("recompute")
    if recompute is not None and True in recompute.values() and \
            getattr(cls, "recompute_modules", None) is Workload.recompute_modules:
        raise ConfigError(f"space '{space.name}': workload {target} does not support knob recompute: implement "
                          "recompute_modules(model) to name the modules to recompute, or fix recompute: false")


def check_settings(cfg: Mapping[str, Any]) -> MeasureSettings:
    study = cfg["study"]
    n_trials = study["n_trials"]
    if not isinstance(n_trials, int) or isinstance(n_trials, bool) or n_trials < 1:
        raise ConfigError(f"study.n_trials must be a positive integer, but got {n_trials!r}")
    if study["sampler"] not in SAMPLERS:
        raise ConfigError(f"study.sampler must be one of {', '.join(SAMPLERS)}, but got {study['sampler']!r}")
    timeout = study["timeout_s"]
    if timeout is not None and (not isinstance(timeout, (int, float)) or timeout <= 0):
        raise ConfigError(f"study.timeout_s must be a positive number of seconds or null, but got {timeout!r}")
    if not isinstance(cfg["stable"]["max_cv"], (int, float)) or cfg["stable"]["max_cv"] <= 0:
        raise ConfigError(f"stable.max_cv must be a positive fraction, but got {cfg['stable']['max_cv']!r}")
    try:
        pareto.check_slo(cfg["slo"] or {})
        return MeasureSettings(**cfg["measure"])
    except (TypeError, ValueError) as e:
        raise ConfigError(f"measure/slo: {e}") from None


def fingerprint(space: SearchSpace) -> str:
    """Identifies what is measured: the workload's settings and the source of its class."""
    cls = workload_class(space)
    try:
        source = Path(inspect.getsourcefile(cls) or "").read_bytes()
    except (OSError, TypeError):
        source = cls.__qualname__.encode()
    digest = hashlib.sha256(json.dumps(space.workload, sort_keys=True, default=str).encode() + source)
    return digest.hexdigest()[:12]


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping) and value:
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _quiet_libraries() -> None:
    """The libraries' own INFO lines and experimental-API warnings would bury the trial lines."""
    import logging
    import warnings

    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    logging.getLogger("mlflow").setLevel(logging.WARNING)
    logging.getLogger("alembic").setLevel(logging.WARNING)


def run(cfg_node: DictConfig) -> int:
    _quiet_libraries()
    cfg = resolve(cfg_node)
    device = resolve_device(str(cfg["device"]))
    space, notes = load_space(cfg, device)
    settings = check_settings(cfg)
    out = console()
    for note in notes:
        out.print(f"[yellow]note:[/] {note}")

    runs_dir = Path(cfg["runs_dir"])
    study_dir = runs_dir / cfg["study"]["name"]
    study_dir.mkdir(parents=True, exist_ok=True)
    env = environment(device)
    print_fn = fingerprint(space)
    tracker = Tracker(cfg["tracking"]["uri"], cfg["tracking"]["experiment"], runs_dir / "mlartifacts")
    out.print(f"device: [bold]{env['device_name']}[/] ({device}), torch {env['torch']}")
    out.print(f"study: {cfg['study']['name']} in {cfg['study']['storage']} "
              f"({cfg['study']['n_trials']} new trials, sampler {cfg['study']['sampler']})")

    tracker.start_parent(
        f"{cfg['study']['name']} {time.strftime('%Y-%m-%d %H:%M:%S')}",
        params=_flatten({k: v for k, v in cfg.items() if k != "space"}) | _flatten(cfg["space"], "space."),
        tags={"space": space.name, "study": cfg["study"]["name"], "workload_fingerprint": print_fn,
              "command": " ".join(["python -m search", *sys.argv[1:]]),
              **{f"env.{k}": v for k, v in env.items()}},
    )
    tracker.client.log_text(tracker.parent_id, OmegaConf.to_yaml(cfg_node, resolve=True), "config.yaml")
    knob_names = list(space.searched)
    unit_box = {"unit": "items"}

    def request(config: Mapping[str, Any]) -> TrialRequest:
        return TrialRequest(space.workload, config, str(device), int(cfg["seed"]), settings)

    def log_trial(record: TrialRecord, result: TrialResult) -> str:
        unit_box["unit"] = result.unit
        tags = {"state": record.state, "stable": str(record.stable).lower(), "pareto": "false",
                "trial": str(record.number), "throughput_unit": f"{result.unit}/s",
                "workload_fingerprint": print_fn}
        if result.measurement is not None:
            tags["stop_reason"] = result.measurement.stop_reason
        if record.failure:
            tags["failure"] = record.failure
        return tracker.log_child(f"trial-{record.number}", record.config, record.metrics, tags)

    def progress(record: TrialRecord, driver: StudyDriver) -> None:
        front = stable_front(driver.history(), space)
        out.print(trial_line(record, len(driver.outcome.records), int(cfg["study"]["n_trials"]), len(front),
                             driver.elapsed_s(), knob_names, unit_box["unit"]))

    driver = StudyDriver(cfg, space, print_fn, request, log_trial, progress)
    try:
        outcome = driver.run()
    except KeyboardInterrupt:
        tracker.end_parent("KILLED")
        out.print("[red]interrupted[/]: the trial in progress is marked failed; re-run the same command to resume")
        return 130
    return _finish(cfg, space, outcome, tracker, study_dir, unit_box["unit"], env, out)


def stable_front(records: list[TrialRecord], space: SearchSpace) -> list[TrialRecord]:
    """Pareto-optimal configurations among the stable, complete ones."""
    candidates = [r for r in records if r.state == COMPLETE and r.stable]
    values = [[r.metrics[o.metric] for o in space.objectives] for r in candidates]
    mask = pareto.pareto_mask(values, [o.direction for o in space.objectives])
    return [r for r, keep in zip(candidates, mask) if keep]


def _finish(cfg, space, outcome, tracker, study_dir, unit, env, out) -> int:
    history = outcome.history
    front = stable_front(history, space)
    on_front = {r.number for r in front}
    for r in history:
        if r.run_id:
            tracker.set_tags(r.run_id, {"pareto": str(r.number in on_front).lower()})
    best_row = pareto.recommend([{"metrics": r.metrics, "record": r} for r in front], cfg["slo"] or {})
    best = best_row["record"] if best_row else None

    knob_names = list(space.searched)
    write_csv(study_dir / "pareto.csv", front, knob_names)
    write_plot(study_dir / "pareto.png", history, front, unit, f"{space.name} on {env['device_name']}")
    write_best(study_dir / "best.yaml", best, unit, {
        "space": space.name, "study": cfg["study"]["name"], "device": env["device_name"],
        "rule": "highest lower 95% CI bound of throughput among stable Pareto-optimal configurations"
                + (f" meeting slo {cfg['slo']}" if cfg["slo"] else ""),
    })
    for name in ("pareto.csv", "pareto.png", "best.yaml"):
        tracker.log_artifact(study_dir / name)
    if best is not None:
        tracker.set_tags(tracker.parent_id, {"best_trial": str(best.number)})
        tracker.log_metrics(tracker.parent_id, {f"best_{k}": v for k, v in best.metrics.items()})
    tracker.end_parent("FINISHED")

    _summary(outcome, history, front, best, knob_names, unit, out)
    out.print(f"files: {study_dir}/best.yaml, pareto.csv, pareto.png")
    out.print(f"compare runs in the MLflow UI: [bold]{tracker.ui_command()}[/]")
    return 0


def _summary(outcome, history, front, best, knob_names, unit, out) -> None:
    states = [r.state for r in outcome.records]
    counts = ", ".join(f"{states.count(s)} {s}" for s in sorted(set(states))) or "none"
    out.print(f"\nthis run: {len(outcome.records)} measured ({counts}); {outcome.rejected} proposals broke "
              f"a constraint, {outcome.reused} repeated an earlier measurement (reused, not re-run); "
              f"stopped by {outcome.stop_reason}. Study total: {len(history)} measured.")
    unstable = sum(1 for r in history if r.state == COMPLETE and not r.stable)
    if unstable:
        out.print(f"{unstable} measured configuration(s) were unstable (throughput CV above the bound) "
                  "and are left off the front.")
    if front:
        out.print(pareto_table(front, best, knob_names, unit))
    else:
        out.print("[yellow]no stable configuration yet[/]: nothing is on the front; see the trial lines above")
    if best is None and front:
        out.print("[yellow]no Pareto configuration meets the slo[/]; best.yaml records none")
