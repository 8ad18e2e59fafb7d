"""Before anything is written: the space as this device can run it, the workload it names, and the
fingerprint of what is measured.

Every check here raises ``ConfigError`` with one line saying what to fix; nothing is opened or
created until they pass.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import json
import random
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate

from search.config.compose import resolve_device
from search.config.contract import check_workload_contract, one_config_per_own_value
from search.config.refusals import without_values_it_refuses
from search.config.settings import Settings
from search.core.errors import ConfigError, KnobError, SpaceError
from search.core.knob_registry import GENERIC_KNOBS
from search.core.metrics import METRICS
from search.execution.fp8 import FP8_PRECISIONS
from search.execution.knobs import (
    Knobs,
    attention_precision_unsupported,
    together_unsupported,
    unsupported_reason,
    value_rule,
)
from search.execution.recompute import named_by, recompute_setting
from search.execution.worker_server import serve_workers_with
from search.measurement.energy import energy_unavailable_reason
from search.space.params import CategoricalParam, FloatParam, IntParam, Param
from search.space.parse import parse_space
from search.space.search_space import SearchSpace
from search.workloads import ServingWorkload, Workload

__all__ = ["Prepared", "control_config", "fingerprint", "load_space", "prepare", "workload_class"]


@dataclass(frozen=True)
class Prepared:
    """What a run is checked to be able to run, before anything is opened or written."""

    device: torch.device
    space: SearchSpace
    notes: list[str]
    """The choices this device cannot run, dropped (``load_space``)."""
    control: dict[str, Any] | None
    """The control configuration (``control_config``); None when no control runs are made."""


def prepare(settings: Settings) -> Prepared:
    """The device, the space as it runs there and the control of ``settings``: a run's checks,
    which ``--cfg`` makes too (so that it refuses what a run would refuse)."""
    device = resolve_device(settings.device)
    space, notes = load_space(settings.space, device, settings.slo)
    # Before the first worker (the contract's check): each starts with the workload's modules.
    serve_workers_with(getattr(workload_class(space), "preload", ()))
    # Here, not in load_space: it runs the workload's code in a worker, which only a run needs.
    check_workload_contract(space, _configs_to_check(space))
    chosen, budget = settings.noise.control, settings.noise.budget
    # A control of one's own is checked even where no control runs are made: a typo in it is
    # refused, not left to surprise the next run that makes them.
    control = control_config(space, chosen) if budget > 0 or chosen else None
    return Prepared(device, space, notes, control if budget > 0 else None)


def _configs_to_check(space: SearchSpace) -> list[dict[str, Any]]:
    """Every feasible configuration of ``space`` or, where it is too large to list or has a float
    knob, the feasible ones among its corners and draws at random (``feasible_sample``; each
    knob's ends and choices are among the corners), or one drawn until found where none is among
    them: what the checks of the workload before a study read."""
    configs = space.feasible_configs()
    if configs is not None:
        return configs
    rng = random.Random(0)
    try:
        configs = space.feasible_sample(rng)
        if not configs:  # feasible configurations are rare: draw on until one is found
            found = space.random_feasible(rng)
            configs = [found] if found else []
    except SpaceError as e:  # a constraint the probe's fewer draws could evaluate
        message, prefix = str(e), f"space '{space.name}': "
        raise ConfigError(message if message.startswith(prefix) else prefix + message) from None
    return configs


def load_space(
    raw: Mapping[str, Any], device: torch.device, slo: Mapping[str, Any] | None = None
) -> tuple[SearchSpace, list[str]]:
    """The space file's resolved mapping ``raw`` as ``device`` can run it. On a CPU a choice it
    cannot run is refused (the space was written for a GPU); on a GPU, a choice this one cannot run
    (too old for it, an optional package missing) is dropped with a note, so that a CUDA preset
    runs on any GPU. ``slo``'s metrics must be ones its workload measures."""
    try:
        space = parse_space(raw["name"], raw)
        if device.type != "cuda":
            _refuse_foreign_choices(space, device)
        space, notes = space.without_choices(
            lambda name, value: (
                unsupported_reason(name, value, device) if name in GENERIC_KNOBS else None
            )
        )
        feasible = space.feasible_configs()
        if feasible is None:  # too large to list, or continuous: probe it instead
            rng = random.Random(0)
            space.probe_constraints(rng)
            feasible = [] if space.random_feasible(rng) is None else None
    except SpaceError as e:
        message = str(e)
        prefix = f"space '{raw['name']}': "
        raise ConfigError(message if message.startswith(prefix) else prefix + message) from None
    if feasible is not None and not feasible:
        try:
            never = space.never_holding(random.Random(0))
        except SpaceError:  # a constraint that cannot be evaluated: said by the line below
            never = []
        raise ConfigError(
            f"space '{space.name}': no configuration satisfies the constraints "
            f"{[c.text for c in space.constraints]}"
            + (" (none of 10000 random draws did)" if space.feasible_configs() is None else "")
            + (f"; alone, {' and '.join(map(repr, never))} held for none tried" if never else "")
            + "; loosen them or widen the ranges"
        )
    _check_generic_knobs(space)
    _check_some_config_passes_the_step(space, feasible, device)
    space, pairs = _without_pairs_it_refuses(space, device)
    notes += pairs
    _check_fixed_knobs_run_here(space, device)
    _check_workload(space)
    space, refused = without_values_it_refuses(space, _check_workload_settings(space, slo or {}))
    notes += refused
    _check_metrics_apply(space, slo or {})
    _check_energy_measurable(space, slo or {}, device)
    return space, notes


def _check_energy_measurable(
    space: SearchSpace, slo: Mapping[str, Any], device: torch.device
) -> None:
    """An energy objective, or an energy limit (which no configuration could then meet), where
    this device's energy cannot be measured is refused."""
    objective = any(o.metric == "energy_per_item_j" for o in space.objectives)
    if not (objective or "energy_per_item_j" in slo):
        return
    reason = energy_unavailable_reason(device)
    if reason is None:
        return
    if objective:
        raise ConfigError(
            f"space '{space.name}': objective energy_per_item_j cannot be measured here "
            f"({reason}); remove it from objectives"
        )
    raise ConfigError(
        f"slo.energy_per_item_j cannot be measured here ({reason}), so no configuration "
        "could meet it; remove it from the slo"
    )


def _refuse_foreign_choices(space: SearchSpace, device: torch.device) -> None:
    """The first searched choice of a generic knob ``device`` cannot run, refused with the
    override that leaves it out."""
    for name, param in space.params.items():
        if name not in GENERIC_KNOBS or not isinstance(param, CategoricalParam):
            continue
        reasons = {v: unsupported_reason(name, v, device) for v in param.choices}
        refused = [v for v, reason in reasons.items() if reason]
        if refused:
            kept = ",".join(str(v) for v in param.choices if v not in refused)
            fix = f"space.params.{name}.choices=[{kept}]" if kept else f"another {name}"
            raise ConfigError(
                f"space '{space.name}': params.{name} choice {refused[0]} cannot run on "
                f"{device.type}: {reasons[refused[0]]}; leave it out ({fix})"
            )


def _check_generic_knobs(space: SearchSpace) -> None:
    """Every value a generic knob can take is one the knob understands."""
    if "batch_size" not in space.params:
        raise ConfigError(
            f"space '{space.name}': params must set batch_size (samples per optimizer step)"
        )
    for name in GENERIC_KNOBS:
        valid, expected = value_rule(name)
        param = space.params.get(name)
        # An int range is checked at its ends (every rule here is about sign and type).
        values = (
            param.extremes() if isinstance(param, IntParam) else param.values() if param else []
        )
        bad = [v for v in values or [] if not valid(v)]
        if bad or (name in space.params and values is None):
            raise ConfigError(
                f"space '{space.name}': params.{name} must be {expected}, "
                f"but got {bad or 'a float range'}"
            )


def _check_some_config_passes_the_step(
    space: SearchSpace, feasible: list[dict[str, Any]] | None, device: torch.device
) -> None:
    """A listed space where every configuration breaks the step's own rules (a micro-batch that
    divides no batch, an unknown recompute setting) or pairs two knobs ``device`` cannot run
    together is refused: its study could only fail."""
    if not feasible:
        return  # too large to list (or nothing feasible, refused above)
    first_error: Exception | None = None
    for config in feasible:
        try:
            knobs = Knobs(**{k: v for k, v in config.items() if k in GENERIC_KNOBS})
            together = together_unsupported(knobs, device)
            if together is None:
                return
            first_error = first_error or KnobError(together)
        except (KnobError, TypeError) as e:
            first_error = first_error or e
    raise ConfigError(
        f"space '{space.name}': no configuration can run, e.g. {first_error} Add a constraint "
        "or narrow the ranges"
    )


def _without_pairs_it_refuses(
    space: SearchSpace, device: torch.device
) -> tuple[SearchSpace, list[str]]:
    """``space`` with a constraint that keeps the attention kernels ``device`` runs at half
    precision only (CUDA's flash and cuDNN, ``attention_precision_unsupported``) to the half
    precisions, and a note saying so; ``space`` itself where no such pair can be proposed.

    Why: such a pair is refused by the trial's own process, after it started and imported torch,
    and counted as a trial. At an fp32 best the order tried both kernels there, and the sampler
    could draw them at any time; as a constraint, none of them is proposed or counted."""
    kernels, precisions = (
        [str(v) for v in space.params[k].values() or []] if k in space.params else []
        for k in ("attention", "precision")
    )
    refused = [
        k for k in kernels if any(attention_precision_unsupported(k, p, device) for p in precisions)
    ]
    halves = [
        p
        for p in precisions
        if not any(attention_precision_unsupported(k, p, device) for k in refused)
    ]
    if not refused:
        return space, []
    text = " and ".join(f"attention != {k!r}" for k in refused)
    text = " or ".join([f"({text})", *(f"precision == {p!r}" for p in halves)])
    where = f"precision {'/'.join(halves)} only" if halves else "never (no half precision here)"
    return space.with_constraint(text), [
        f"attention={'/'.join(refused)} at {where}: on {device.type.upper()} these kernels take "
        f"half-precision inputs only (constraint {text})"
    ]


def _check_recompute(space: SearchSpace, cls: type) -> None:
    """A recompute setting the workload cannot name is refused: blocks need
    ``recompute_modules``, a part's name needs ``recompute_parts``."""
    param = space.params.get("recompute")
    settings = {recompute_setting(v) for v in (param.values() or [])} if param else set()
    for method in ("recompute_modules", "recompute_parts"):
        names = {s for s in settings if named_by(s) == method}
        if names and getattr(cls, method, None) is getattr(Workload, method):
            raise ConfigError(
                f"space '{space.name}': workload {space.workload['_target_']} cannot recompute "
                f"{', '.join(sorted(names))}: implement {method}(model) to name what to "
                "recompute, or leave those settings out of recompute"
            )


def _check_kernels(space: SearchSpace, cls: type) -> None:
    """Fused kernels need a workload that says how to patch them in (``use_kernels``)."""
    param = space.params.get("kernels")
    patched = [v for v in (param.values() or []) if v != "torch"] if param else []
    if patched and getattr(cls, "use_kernels", None) is Workload.use_kernels:
        raise ConfigError(
            f"space '{space.name}': workload {space.workload['_target_']} cannot use "
            f"kernels={', '.join(map(str, patched))}: implement use_kernels(model, kernels) to "
            "patch them in, or leave kernels out"
        )


def _check_fixed_knobs_run_here(space: SearchSpace, device: torch.device) -> None:
    """A generic knob fixed at a value this device cannot run is refused (a searched one only
    loses that choice, with a note)."""
    for name, value in space.fixed.items():
        reason = unsupported_reason(name, value, device) if name in GENERIC_KNOBS else None
        if reason:
            raise ConfigError(
                f"space '{space.name}': params.{name}={value} cannot run on {device.type}: "
                f"{reason}; pick another {name}"
            )


def workload_class(space: SearchSpace) -> type:
    target = space.workload["_target_"]
    module_name, _, class_name = target.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), class_name)
    # ImportError, AttributeError, an error raised by the module itself, or its sys.exit()
    except (Exception, SystemExit) as e:
        raise ConfigError(
            f"space '{space.name}': workload._target_ {target!r} does not import "
            f"({type(e).__name__}: {e}); check the name and that its package is on PYTHONPATH"
        ) from None


_TASK_METHODS = {
    "train": ("build_model", "make_batch", "loss"),
    "serve": ("build_model", "make_prompts", "forward", "generation_length"),
}
_TASK_BASES = {"train": "search.Workload", "serve": "search.ServingWorkload"}


def _check_workload(space: SearchSpace) -> None:
    """The workload has its task's methods, takes every knob that is not a generic one, and every
    generic knob the space searches applies to its task."""
    target, cls = space.workload["_target_"], workload_class(space)
    for module, install in getattr(cls, "requires", {}).items():
        if importlib.util.find_spec(module) is None:
            raise ConfigError(
                f"space '{space.name}': workload {target} needs {module}, which is not "
                f"installed; install it with: {install}"
            )
    task = getattr(cls, "task", "train")
    missing = [m for m in _TASK_METHODS.get(task, ()) if not callable(getattr(cls, m, None))]
    if task not in _TASK_METHODS or missing:
        raise ConfigError(
            f"space '{space.name}': workload {target} lacks {', '.join(missing) or 'a task'}; "
            f"subclass {_TASK_BASES.get(task, 'search.Workload')} (see "
            "docs/guide/own-workload.md)"
        )
    applies = getattr(cls, "knobs", GENERIC_KNOBS)
    for name in space.params:
        if name in GENERIC_KNOBS and name not in applies:
            raise ConfigError(
                f"space '{space.name}': knob {name} does not apply to workload {target} (task "
                f"{task}: its generic knobs are {', '.join(applies)}); remove it from params"
            )
    _check_recompute(space, cls)
    _check_kernels(space, cls)
    precision = space.params.get("precision")
    fp8 = [v for v in (precision.values() or []) if v in FP8_PRECISIONS] if precision else []
    if task == "serve" and fp8:
        raise ConfigError(
            f"space '{space.name}': precision {fp8[0]} does not apply to serving (it is torchao's "
            "float8 training); leave the fp8 precisions out"
        )
    accepted = inspect.signature(cls).parameters
    if any(p.kind is p.VAR_KEYWORD for p in accepted.values()):
        return
    for name in space.params:
        if name not in GENERIC_KNOBS and name not in accepted:
            raise ConfigError(
                f"space '{space.name}': knob {name!r} is neither a generic knob "
                f"({', '.join(GENERIC_KNOBS)}) nor a parameter of {target}({', '.join(accepted)})"
            )


def _check_workload_settings(space: SearchSpace, slo: Mapping[str, Any]) -> Any:
    """The workload's constructor takes its settings and, in a configuration the constraints
    allow, every value of each of its own knobs (an int range at its ends): a value it refuses
    would fail every trial that draws it. The constructor runs here, in the study's process, once
    per value; it is meant to store settings, not to build the model. The first one built (None
    where no configuration is feasible)."""
    own = [n for n in space.params if n not in GENERIC_KNOBS]
    configs = _configs_to_check(space)
    built_first = None
    if not configs:
        return built_first
    tried = [(configs[0], None), *one_config_per_own_value(space, configs)]
    target = space.workload["_target_"]
    for config, knob in tried:
        settings = {k: config[k] for k in own}
        try:
            built = instantiate(
                dict(space.workload), _convert_="all", _recursive_=False, **settings
            )
        except (Exception, SystemExit) as e:  # the constructor's own check, a TypeError, ...
            cause = e.__cause__ or e  # Hydra wraps what the constructor raised
            what = (
                f"refuses {knob}={config[knob]!r}" if knob else "cannot be built from its settings"
            )
            first = (
                f"it called sys.exit({cause.code!r})"
                if isinstance(cause, SystemExit)
                else (str(cause).strip().splitlines() or [type(cause).__name__])[0]
            )
            raise ConfigError(f"space '{space.name}': workload {target} {what}: {first}") from None
        built_first = built_first if built_first is not None else built
        tpot = [o.metric for o in space.objectives] + list(slo)
        if (
            isinstance(built, ServingWorkload)
            and built.generation_length() < 2
            and any(m.startswith("tpot_") for m in tpot)
        ):
            raise ConfigError(
                f"space '{space.name}': time per output token needs at least 2 generated tokens, "
                f"but {target} generates {built.generation_length()}; raise its generation length "
                "or drop the tpot objectives and slo"
            )
    return built_first


def _check_metrics_apply(space: SearchSpace, slo: Mapping[str, Any]) -> None:
    """Every objective and SLO metric is one the workload's task measures."""
    cls = workload_class(space)
    task = getattr(cls, "task", "train")
    named = [(f"objective {o.metric}", o.metric) for o in space.objectives]
    named += [(f"slo.{metric}", metric) for metric in slo]
    for what, metric in named:
        if metric in METRICS and task not in METRICS[metric].tasks:
            tasks = " or ".join(METRICS[metric].tasks)
            raise ConfigError(
                f"space '{space.name}': {what} is measured only for {tasks} workloads, and "
                f"{space.workload['_target_']} is a {task} workload; name another metric"
            )


def fingerprint(space: SearchSpace, env: Mapping[str, str]) -> str:
    """Identifies what is measured where: the workload's settings and class source, device, torch.

    Trials of another fingerprint stay in the study but are neither reused nor put on the front.
    """
    try:
        source = Path(inspect.getsourcefile(workload_class(space)) or "").read_bytes()
    except (OSError, TypeError):
        source = space.workload["_target_"].encode()
    identity = {"workload": space.workload, "device": env["device_name"], "torch": env["torch"]}
    return hashlib.sha256(
        json.dumps(identity, sort_keys=True, default=str).encode() + source
    ).hexdigest()[:12]


def control_config(space: SearchSpace, chosen: Mapping[str, Any] | None) -> dict[str, Any]:
    """The control configuration: ``chosen`` knob values (``noise.control``), every other knob at
    its smallest value (a categorical's first choice); when that breaks a constraint and nothing
    was chosen, the first feasible configuration in the same order."""
    chosen = dict(chosen or {})
    unknown = sorted(set(chosen) - set(space.params))
    if unknown:
        raise ConfigError(
            f"noise.control names {', '.join(unknown)}, which space '{space.name}' does not have; "
            f"its knobs: {', '.join(space.params)}"
        )
    config = {name: chosen.get(name, _smallest(param)) for name, param in space.params.items()}
    if space.contains(config):
        return config
    if not chosen:
        feasible = space.feasible_configs()
        if feasible:
            return feasible[0]
    outside = [f"{name}={config[name]!r}" for name in space.outside(config)]
    why = (
        f"{', '.join(outside)}: not among the values the space gives it"
        if outside
        else f"it breaks {'; '.join(space.violations(config))}"
    )
    raise ConfigError(
        f"noise.control {config} is not a configuration of space '{space.name}' ({why}); "
        "name knob values inside the ranges that meet the constraints"
    )


def _smallest(param: Param) -> Any:
    if isinstance(param, FloatParam):
        return param.low
    if isinstance(param, IntParam):
        return param.extremes()[0]
    values = param.values()
    assert values  # every other kind lists its values, smallest (or first) first
    return values[0]
