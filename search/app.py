"""One invocation: validate everything, open the stores, run the study, report.

All validation happens before anything is written, and a store that cannot be opened removes the
``runs_dir`` this invocation created, so bad input leaves nothing behind. Once the parent run has
started it is always ended: FINISHED, KILLED (Ctrl-C) or FAILED.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import inspect
import json
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Mapping

import torch
import yaml
from omegaconf import DictConfig

from search import pareto
from search.config import ConfigError, redact, resolve, resolve_device
from search.knobs import GENERIC_KNOBS, PRECISIONS, unsupported_reason
from search.measure import MeasureSettings
from search.records import TrialRecord
from search.revalidate import CONSERVATIVE, revalidate
from search.report import (console, pareto_table, shown_metrics, si, summary_lines, trial_line, write_best,
                           write_csv, write_plot)
from search.runner import COMPLETE, TrialRequest, TrialResult, run_isolated
from search.space import SearchSpace, SpaceError, parse_space
from search.study import SAMPLERS, StudyDriver, StudyOutcome, open_study, with_retries
from search.gpu_telemetry import energy_unavailable_reason
from search.liveness import Heartbeat, Recovery, agree_on_heartbeat, owner, stale_runs
from search.telemetry import contention, environment
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
    _check_generic_knobs(space)
    _check_workload(space)
    if any(o.metric == "energy_per_item_j" for o in space.objectives):
        reason = energy_unavailable_reason(device)
        if reason:
            raise ConfigError(f"space '{space.name}': objective energy_per_item_j cannot be measured here ({reason}); "
                              "remove it from objectives")
    return space, notes


def _check_generic_knobs(space: SearchSpace) -> None:
    """Every value a generic knob can take is one the knob understands."""
    if "batch_size" not in space.params:
        raise ConfigError(f"space '{space.name}': params must set batch_size (samples per optimizer step)")
    rules = {
        "batch_size": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1, "a positive int"),
        "micro_batch_size": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1, "a positive int"),
        "streams": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1, "a positive int"),
        "precision": (lambda v: v in PRECISIONS, f"one of {', '.join(PRECISIONS)}"),
        "recompute": (lambda v: isinstance(v, bool), "true or false"),
    }
    for name, (valid, expected) in rules.items():
        values = space.params[name].values() if name in space.params else []
        bad = [v for v in values or [] if not valid(v)]
        if bad or (name in space.params and values is None):
            raise ConfigError(f"space '{space.name}': params.{name} must be {expected}, but got {bad or 'a float range'}")


def workload_class(space: SearchSpace) -> type:
    target = space.workload["_target_"]
    module_name, _, class_name = target.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), class_name)
    except Exception as e:  # ImportError, AttributeError, or an error raised by the module itself
        raise ConfigError(f"space '{space.name}': workload._target_ {target!r} does not import "
                          f"({type(e).__name__}: {e}); check the name and that its package is on PYTHONPATH") from None


def _check_workload(space: SearchSpace) -> None:
    """The workload has the contract's methods and takes every knob that is not a generic one."""
    target, cls = space.workload["_target_"], workload_class(space)
    missing = [m for m in ("build_model", "make_batch", "loss") if not callable(getattr(cls, m, None))]
    if missing:
        raise ConfigError(f"space '{space.name}': workload {target} lacks {', '.join(missing)}; "
                          "subclass search.Workload (see README, 'Your own workload')")
    recompute = space.params.get("recompute")
    if recompute is not None and True in recompute.values() and \
            getattr(cls, "recompute_modules", None) is Workload.recompute_modules:
        raise ConfigError(f"space '{space.name}': workload {target} does not support knob recompute: implement "
                          "recompute_modules(model) to name the modules to recompute, or fix recompute: false")
    accepted = inspect.signature(cls).parameters
    if any(p.kind is p.VAR_KEYWORD for p in accepted.values()):
        return
    for name in space.params:
        if name not in GENERIC_KNOBS and name not in accepted:
            raise ConfigError(f"space '{space.name}': knob {name!r} is neither a generic knob "
                              f"({', '.join(GENERIC_KNOBS)}) nor a parameter of {target}({', '.join(accepted)})")


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
    if not isinstance(cfg["seed"], int) or isinstance(cfg["seed"], bool):
        raise ConfigError(f"seed must be an integer, but got {cfg['seed']!r}")
    processes, limit = cfg["revalidate"]["processes"], cfg["revalidate"]["max_candidates"]
    if not isinstance(processes, int) or isinstance(processes, bool) or processes < 0 or processes == 1:
        raise ConfigError(f"revalidate.processes must be 0 (off) or at least 2, but got {processes!r}")
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
        raise ConfigError(f"revalidate.max_candidates must be a positive integer, but got {limit!r}")
    heartbeat = study["heartbeat_s"]
    if not isinstance(heartbeat, int) or isinstance(heartbeat, bool) or heartbeat < 1:
        raise ConfigError(f"study.heartbeat_s must be a positive integer number of seconds, but got {heartbeat!r}")
    rate = study["max_failure_rate"]
    if not isinstance(rate, (int, float)) or isinstance(rate, bool) or not 0 <= rate <= 1:
        raise ConfigError(f"study.max_failure_rate must be a fraction from 0 to 1, but got {rate!r}")
    _check_runner(cfg["runner"], cfg["measure"]["max_time_s"])
    max_cv = cfg["stable"]["max_cv"]
    if not isinstance(max_cv, (int, float)) or isinstance(max_cv, bool) or max_cv <= 0:
        raise ConfigError(f"stable.max_cv must be a positive fraction, but got {max_cv!r}")
    try:
        pareto.check_slo(cfg["slo"] or {})
        return MeasureSettings(**cfg["measure"])
    except (TypeError, ValueError) as e:
        raise ConfigError(f"measure/slo: {e}") from None


def _check_runner(runner: Mapping[str, Any], max_time_s: Any) -> None:
    timeout, limit = runner["timeout_s"], runner["memory_limit_mb"]
    if timeout is not None and (not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0):
        raise ConfigError(f"runner.timeout_s must be a positive number of seconds or null, but got {timeout!r}")
    if timeout is not None and isinstance(max_time_s, (int, float)) and timeout <= max_time_s:
        raise ConfigError(f"runner.timeout_s ({timeout:g} s) must exceed measure.max_time_s ({max_time_s:g} s), "
                          "or every trial would time out; raise runner.timeout_s")
    if limit is not None and (not isinstance(limit, (int, float)) or isinstance(limit, bool) or limit <= 0):
        raise ConfigError(f"runner.memory_limit_mb must be a positive number of MB or null, but got {limit!r}")


def fingerprint(space: SearchSpace, env: Mapping[str, str]) -> str:
    """Identifies what is measured where: the workload's settings and class source, device, torch.

    Trials of another fingerprint stay in the study but are neither reused nor put on the front.
    """
    try:
        source = Path(inspect.getsourcefile(workload_class(space)) or "").read_bytes()
    except (OSError, TypeError):
        source = space.workload["_target_"].encode()
    identity = {"workload": space.workload, "device": env["device_name"], "torch": env["torch"]}
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode() + source).hexdigest()[:12]


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping) and value:
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = redact(value) if isinstance(value, str) else value
    return flat


def _quiet_libraries() -> None:
    """The libraries' own INFO lines and experimental-API warnings would bury the trial lines."""
    import logging
    import warnings

    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    # Heartbeats are kept by search.liveness for ask-and-tell, which Optuna does not expect.
    warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used with Study.optimize")
    logging.getLogger("mlflow").setLevel(logging.WARNING)
    logging.getLogger("alembic").setLevel(logging.WARNING)


def _open_stores(cfg: Mapping[str, Any], space: SearchSpace, recovery: Recovery | None = None):
    """The Optuna study and the MLflow tracker; on failure, remove the runs_dir made for them."""
    runs_dir = Path(cfg["runs_dir"])
    created = not runs_dir.exists()
    try:
        runs_dir.mkdir(parents=True, exist_ok=True)
        study = open_study(cfg["study"]["name"], cfg["study"]["storage"], space, recovery)
        if recovery is not None:
            theirs = agree_on_heartbeat(study, recovery.heartbeat_s)
            if theirs is not None:
                raise ConfigError(f"study '{study.study_name}' keeps heartbeats every {theirs} s, but study.heartbeat_s="
                                  f"{recovery.heartbeat_s}: every process on a study must agree; set "
                                  f"study.heartbeat_s={theirs}")
        try:
            tracker = with_retries(lambda: Tracker.open(cfg["tracking"]["uri"], cfg["tracking"]["experiment"],
                                                        runs_dir / "mlartifacts"))
        except Exception as e:
            raise ConfigError(f"cannot open tracking.uri {redact(cfg['tracking']['uri'])!r}: "
                              f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    except (ConfigError, OSError) as e:
        if created:
            shutil.rmtree(runs_dir, ignore_errors=True)
        if isinstance(e, OSError):
            raise ConfigError(f"cannot write runs_dir {str(runs_dir)!r}: {e.strerror}") from None
        raise
    return study, tracker


def _versions() -> dict[str, str]:
    try:
        return {"search_version": importlib.metadata.version("search")}
    except importlib.metadata.PackageNotFoundError:
        return {}


def run(cfg_node: DictConfig) -> int:
    _quiet_libraries()
    cfg = resolve(cfg_node)
    device = resolve_device(str(cfg["device"]))
    space, notes = load_space(cfg, device)
    settings = check_settings(cfg)
    out = console()
    for note in notes:
        out.print(f"[yellow]note:[/] {note}")
    recovery = Recovery(int(cfg["study"]["heartbeat_s"]))
    study, tracker = _open_stores(cfg, space, recovery)

    if tracker.offline_reason:
        out.print(f"warning: {tracker.offline_reason}; going on without MLflow: results stay in the Optuna "
                  "study, and `python -m search sync` with the same arguments copies them later", markup=False)
    env = {**environment(device), **_versions()}
    shared = contention(device)
    for warning in shared:
        out.print(f"[yellow]warning:[/] {warning}")
    energy_note = energy_unavailable_reason(device)
    if energy_note:
        out.print(f"energy: not measured here ({energy_note}); no energy figure is reported", markup=False)
    print_fn = fingerprint(space, env)
    study_name = cfg["study"]["name"]
    out.print(f"device: [bold]{env['device_name']}[/] ({device}), torch {env['torch']}")
    out.print(f"study: {study_name} in {redact(cfg['study']['storage'])} "
              f"({cfg['study']['n_trials']} new trials, sampler {cfg['study']['sampler']})")
    tracker.start_parent(
        f"{study_name} {time.strftime('%Y-%m-%d %H:%M:%S')}",
        params=_flatten({k: v for k, v in cfg.items() if k != "space"}) | _flatten(cfg["space"], "space."),
        tags={"space": space.name, "study": study_name, "workload_fingerprint": print_fn,
              "contention": "; ".join(shared) or "none seen",
              "energy": f"not measured: {energy_note}" if energy_note else "measured (energy_per_item_j)",
              "command": redact(" ".join(["python -m search", *sys.argv[1:]])),
              **{k: str(v) for k, v in owner().items()},
              **{f"env.{k}": v for k, v in env.items()}},
    )
    status = "FAILED"
    heartbeat = Heartbeat(recovery.heartbeat_s, study._storage, lambda tags: tracker.set_tags(tracker.parent_id, tags))
    try:
        recovery.check(study)
        for note in [*recovery.notes, *_recover_runs(tracker, study_name, recovery.grace_s)]:
            out.print(f"recovered: {note}", markup=False)
        tracker.log_text(yaml.safe_dump(_redacted(cfg), sort_keys=False), "config.yaml")
        driver = _driver(cfg, space, study, print_fn, device, settings, tracker, env, out, recovery, heartbeat)
        outcome = driver.run()
        _finish(cfg, space, driver, outcome, tracker, env, out)
        if outcome.failure_stop:
            print(f"search: error: stopped early: {outcome.failure_stop}", file=sys.stderr)
            return 1
        status = "FINISHED"
        return 0
    except KeyboardInterrupt:
        status = "KILLED"
        out.print("[red]interrupted[/]: the trial in progress is marked failed; re-run the same command to resume")
        return 130
    finally:
        heartbeat.close()
        tracker.end_parent(status)


def _recover_runs(tracker: Tracker, study_name: str, grace_s: float) -> list[str]:
    """End KILLED the MLflow runs of ``study_name`` that a stopped process left RUNNING."""
    runs = tracker.find_runs(f"attributes.status = 'RUNNING' and tags.study = '{study_name}'")
    parents = {r.info.run_id for r in stale_runs([r for r in runs if "mlflow.parentRunId" not in r.data.tags], grace_s)}
    notes = []
    for run in runs:
        parent = run.data.tags.get("mlflow.parentRunId")
        if run.info.run_id in parents or parent in parents:
            tracker.set_tags(run.info.run_id, {"failure": "crash: left running by a process that stopped"})
            tracker.end_run(run.info.run_id, "KILLED")
            notes.append(f"MLflow run {run.info.run_name or run.info.run_id} was left running: ended KILLED")
    return notes


def _redacted(tree: Any) -> Any:
    if isinstance(tree, Mapping):
        return {k: _redacted(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_redacted(v) for v in tree]
    return redact(tree) if isinstance(tree, str) else tree


def _driver(cfg, space, study, print_fn, device, settings, tracker, env, out, recovery=None,
            heartbeat=None) -> StudyDriver:
    knob_names = list(space.searched)
    confidence = settings.confidence
    shown = shown_metrics([o.metric for o in space.objectives])

    runner = cfg["runner"]

    def request(config: Mapping[str, Any]) -> TrialRequest:
        return TrialRequest(space.workload, config, str(device), int(cfg["seed"]), settings,
                            timeout_s=runner["timeout_s"], memory_limit_mb=runner["memory_limit_mb"])

    def log_trial(record: TrialRecord, result: TrialResult) -> str:
        tags = {"study": cfg["study"]["name"], "device": env["device_name"], "workload_fingerprint": print_fn}
        if result.measurement is not None:
            tags["stop_reason"] = result.measurement.stop_reason
        if result.throttle_reasons:
            tags["throttle_reasons"] = result.throttle_reasons
        if record.state != COMPLETE and result.stderr_tail:
            tags["stderr_tail"] = result.stderr_tail[-4000:]
        return tracker.log_trial(record, result.duration_s, tags)

    def progress(record: TrialRecord, driver: StudyDriver) -> None:
        front = stable_front(driver.history(), space)
        out.print(trial_line(record, len(driver.outcome.records), int(cfg["study"]["n_trials"]), len(front),
                             driver.elapsed_s(), knob_names, confidence, shown), markup=False)

    return StudyDriver(cfg, space, study, print_fn, request, log_trial, progress, recovery, heartbeat)


def stable_front(records: list[TrialRecord], space: SearchSpace) -> list[TrialRecord]:
    """Pareto-optimal configurations among the stable, complete ones, on the conservative figures."""
    candidates = [r for r in records if r.state == COMPLETE and r.stable]
    values = [[r.metrics[CONSERVATIVE[o.metric]] for o in space.objectives] for r in candidates]
    mask = pareto.pareto_mask(values, [o.direction for o in space.objectives])
    return [r for r, keep in zip(candidates, mask) if keep]


def _revalidated_front(cfg, space: SearchSpace, driver: StudyDriver, candidates: list[TrialRecord],
                       tracker: Tracker, out) -> list[TrialRecord]:
    """Re-measure the search-time front in fresh processes; the front of what stays stable."""
    processes, limit = int(cfg["revalidate"]["processes"]), int(cfg["revalidate"]["max_candidates"])
    if processes == 0 or not candidates:
        return candidates
    candidates = sorted(candidates, key=lambda r: -r.metrics["throughput_ci_low"])[:limit]
    done = driver.revalidations()
    todo = [c for c in candidates if c.number not in done]
    max_cv, confidence = float(cfg["stable"]["max_cv"]), float(cfg["measure"]["confidence"])
    if todo:
        out.print(f"\nre-validating {len(todo)} Pareto candidate(s) in {processes} fresh processes each, "
                  "interleaved in random order:")

    def measure(candidate: TrialRecord) -> TrialResult:
        return run_isolated(driver.request(candidate.config))

    def progress(i: int, n: int, candidate: TrialRecord, result: TrialResult) -> None:
        figure = (f"{si(result.measurement.throughput)} {candidate.unit}/s, cv {result.measurement.throughput_cv:.1%}"
                  if result.measurement else f"{result.state}: {result.failure}")
        out.print(f"  [revalidate {i}/{n}] #{candidate.number}: {figure}", markup=False)

    for number, pooled in revalidate(todo, processes, measure, int(cfg["seed"]) + len(driver.study.trials),
                                     max_cv, confidence, progress).items():
        driver.save_revalidation(number, pooled)
        done[number] = pooled
        run_id = next(c.run_id for c in candidates if c.number == number)
        if run_id:
            tracker.log_metrics(run_id, {f"revalidated_{k}": v for k, v in pooled.metrics.items()})
            tracker.set_tags(run_id, {"revalidated": "true", "stable": str(pooled.stable).lower(),
                                      **({"revalidation_failure": pooled.reason} if pooled.reason else {})})
    pooled_records = [replace(c, metrics={**c.metrics, **done[c.number].metrics}, stable=done[c.number].stable)
                      for c in candidates]
    front = stable_front(pooled_records, space)
    dropped = [f"#{c.number} ({done[c.number].reason or 'dominated after re-validation'})"
               for c in candidates if c.number not in {r.number for r in front}]
    out.print(f"re-validation: {len(candidates) - len(dropped)} of {len(candidates)} candidate(s) kept their place"
              + (f"; left the front: {', '.join(dropped)}" if dropped else ""))
    return front


def _finish(cfg, space: SearchSpace, driver: StudyDriver, outcome: StudyOutcome, tracker: Tracker,
            env: Mapping[str, str], out) -> None:
    history = driver.history()
    front = _revalidated_front(cfg, space, driver, stable_front(history, space), tracker, out)
    tracker.mark_pareto(outcome.study_name, {r.run_id for r in front if r.run_id})
    best_row = pareto.recommend([{"metrics": r.metrics, "record": r} for r in front], cfg["slo"] or {})
    best = best_row["record"] if best_row else None
    unit = history[0].unit if history else "items"
    confidence = float(cfg["measure"]["confidence"])

    study_dir = Path(cfg["runs_dir"]) / outcome.study_name
    study_dir.mkdir(parents=True, exist_ok=True)
    knob_names = list(space.searched)
    objectives = ", ".join(f"{o.metric} {'max' if o.direction == 'maximize' else 'min'}" for o in space.objectives)
    write_csv(study_dir / "pareto.csv", front, knob_names)
    x_metric = next((o.metric for o in space.objectives if o.direction == "minimize"), "latency_p95_ms")
    write_plot(study_dir / "pareto.png", history, front, best, x_metric, confidence,
               f"{space.name} on {env['device_name']}\nPareto front over: {objectives}")
    write_best(study_dir / "best.yaml", best, {
        "space": space.name, "study": outcome.study_name, "device": env["device_name"],
        "rule": f"highest lower {confidence:.0%} CI bound of throughput among stable Pareto-optimal configurations"
                + (f" meeting slo {cfg['slo']}" if cfg["slo"] else ""),
    })
    for name in ("pareto.csv", "pareto.png", "best.yaml"):
        tracker.log_artifact(study_dir / name)
    if best is not None:
        tracker.set_tags(tracker.parent_id, {"best_trial": str(best.number)})
        tracker.log_metrics(tracker.parent_id, {f"best_{k}": v for k, v in best.metrics.items()})

    for line in summary_lines(outcome, history, driver.recovery.notes if driver.recovery else (), best=best,
                              max_cv=float(cfg["stable"]["max_cv"])):
        out.print(line, markup=False)
    if front:
        processes = int(cfg["revalidate"]["processes"])
        title = "Pareto-optimal stable configurations" + (
            f" (figures pooled from {processes} fresh processes each)" if processes else " (search-time figures)")
        out.print(pareto_table(front, best, knob_names, unit, confidence,
                               shown_metrics([o.metric for o in space.objectives]), title))
    else:
        out.print("[yellow]no stable configuration yet[/]: nothing is on the front; see the trial lines above")
    if best is None and front:
        out.print("[yellow]no Pareto configuration meets the slo[/]; best.yaml records none")
    out.print(f"files: {study_dir}/best.yaml, pareto.csv, pareto.png")
    if tracker.offline_reason:
        out.print(f"MLflow: {tracker.offline_reason}. {tracker.unlogged_trials} trial(s) of this run are in the "
                  f"Optuna study only; when the server is back, copy them with: {_sync_command()}", markup=False)
    else:
        out.print(f"compare runs in the MLflow UI: [bold]{redact(tracker.ui_command())}[/]")


def _sync_command() -> str:
    return redact(" ".join(["python -m search sync", *sys.argv[1:]]))
