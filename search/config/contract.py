"""The workload's contract (docs/guide/own-workload.md), checked before a study on what costs no
memory: a few samples drawn on the CPU, and the model built on torch's meta device.

A breach found here could only fail every trial the study runs, each in a fresh process and with
the same error, so it is refused with one line instead. The workload's code runs in a worker of its
own, as a trial's does (``run_in_a_worker``): one that crashes, exits or hangs leaves the study
process as it was. What the meta device cannot run (a kernel with no meta implementation, a step
that reads a value) is left to the step: these checks refuse only what they saw break the contract.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from hydra.utils import instantiate

from search.core.errors import ConfigError
from search.core.knob_registry import GENERIC_KNOBS
from search.execution.isolation import run_in_a_worker
from search.execution.knobs import map_tensors
from search.execution.recompute import named_by, recompute_setting
from search.space.params import FloatParam, IntParam, Param
from search.space.search_space import SearchSpace

__all__ = [
    "CHECK_TIMEOUT_S",
    "check_workload_contract",
    "one_config_per_own_value",
    "read_contract",
    "read_unbuildable",
]

CHECK_TIMEOUT_S = 120.0
"""How long the worker that reads the contract may take; past it the checks are left to the step
(a meta-device model builds in well under a second; a workload's imports may take some)."""


def check_workload_contract(space: SearchSpace, feasible: Sequence[Mapping[str, Any]]) -> None:
    """At the space's smallest micro-batch: a training workload's ``make_batch(size, generator)``
    returns tensors with ``size`` samples along the first dimension, its ``loss`` one value that
    depends on the model's parameters (``backward()`` needs both), and each part's name that
    recompute offers is one its ``recompute_parts`` names. Then the model at each value of the
    workload's own knobs (``read_unbuildable``), in a worker of its own: a value whose build
    crashes or hangs there costs only that check."""
    if not feasible:
        return  # none found to read: the step checks it
    config = min(feasible, key=lambda c: c.get("micro_batch_size") or c["batch_size"])
    size = config.get("micro_batch_size") or config["batch_size"]
    param = space.params.get("recompute")
    settings = {recompute_setting(v) for v in (param.values() or [])} if param else set()
    names = sorted(s for s in settings if named_by(s) == "recompute_parts")
    read = run_in_a_worker(
        read_contract, dict(space.workload), config, size, timeout_s=CHECK_TIMEOUT_S
    )
    breach, parts = read if read is not None else (None, None)
    target = space.workload["_target_"]
    variants = one_config_per_own_value(space, feasible)
    if not breach and variants:
        breach = run_in_a_worker(
            read_unbuildable, dict(space.workload), variants, timeout_s=CHECK_TIMEOUT_S / 2
        )
    if breach:
        raise ConfigError(f"space '{space.name}': workload {target}: {breach}")
    unknown = [n for n in names if parts is not None and n not in parts]
    if unknown:
        named = ", ".join(parts or []) or "no parts"
        raise ConfigError(
            f"space '{space.name}': params.recompute choice {unknown[0]!r} is no part of "
            f"{target}: it takes none, all, every-K and {named}; leave {unknown[0]!r} out"
        )


def one_config_per_own_value(
    space: SearchSpace, configs: Sequence[Mapping[str, Any]]
) -> list[tuple[Mapping[str, Any], str]]:
    """For each value of each of the workload's own knobs (an int or float range at its ends), the
    first of ``configs`` that takes it, with the knob's name: a value the workload cannot take
    would fail every trial that draws it, so each is tried once before the study."""
    tried = []
    for name in (n for n in space.params if n not in GENERIC_KNOBS):
        for value in _ends_and_choices(space.params[name]):
            found = next((c for c in configs if c[name] == value), None)
            if found is not None:
                tried.append((found, name))
    return tried


def _ends_and_choices(param: Param) -> list[Any]:
    if isinstance(param, FloatParam):
        return [param.low, param.high]
    if isinstance(param, IntParam):
        return param.extremes()
    return list(param.values() or [])


def read_contract(
    workload_settings: Mapping[str, Any], config: Mapping[str, Any], size: int
) -> tuple[str | None, list[str] | None]:
    """In the worker: the first breach of the contract seen (None: none seen) and the names of
    ``recompute_parts`` (None where they could not be read)."""
    try:
        workload = _workload(workload_settings, config)
        with torch.device("meta"):
            model = workload.build_model()
    except Exception as e:  # noqa: BLE001 - the constructor is checked on its own; the rest defers
        own = ", ".join(f"{k}={v!r}" for k, v in _own_settings(config).items())
        fix = "fix the workload's settings or its build_model"
        what = f"build_model() with {own}" if own else "build_model()"
        return _code_fault(e, what, fix + (", or leave those values out" if own else "")), None
    try:
        parts = sorted(workload.recompute_parts(model))
    except Exception:  # noqa: BLE001 - any failure here only defers the check to the step
        parts = None
    if not isinstance(model, torch.nn.Module):
        return f"build_model() returned {type(model).__name__}, not a torch.nn.Module", parts
    if getattr(workload, "task", "train") != "train":
        return None, parts
    return _breach(workload, model, size), parts


def read_unbuildable(
    workload_settings: Mapping[str, Any], variants: Sequence[tuple[Mapping[str, Any], str]]
) -> str | None:
    """In the worker: the first of ``variants`` (a configuration, and the knob of the workload's
    own it stands for) whose model fails to build on the meta device with an error of the code's
    own (``CODE_FAULTS``); None where none does."""
    for config, knob in variants:
        try:
            with torch.device("meta"):
                _workload(workload_settings, config).build_model()
        except (Exception, SystemExit) as e:  # noqa: BLE001 - told, or left to the step
            others = ", ".join(f"{k}={v!r}" for k, v in _own_settings(config).items() if k != knob)
            fault = _code_fault(
                e,
                f"build_model() at {knob}={config[knob]!r}"
                + (f" (with {others})" if others else ""),
                "leave that value out of the space, or add a constraint that excludes it",
            )
            if fault:
                return fault
    return None


CODE_FAULTS = (TypeError, ValueError, AttributeError, KeyError, IndexError, NameError, ImportError)
"""What ``build_model`` raises on the meta device as on any other: a setting of the wrong type, a
misspelt name. The meta device's own limits raise ``NotImplementedError`` or ``RuntimeError`` (an
operator with no meta kernel, a value read from a tensor), or name the meta device (a tensor made
into a numpy array), and are left to the step."""


def _code_fault(error: BaseException, what: str, fix: str) -> str | None:
    """``what raised Error: its first line; fix`` for an error of the code's own, else None."""
    if not isinstance(error, CODE_FAULTS) or "meta" in str(error).lower():
        return None
    return f"{what} raised {type(error).__name__}: {_first_line(error)}; {fix}"


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [""])[0]


def _workload(workload_settings: Mapping[str, Any], config: Mapping[str, Any]) -> Any:
    own = _own_settings(config)
    return instantiate(dict(workload_settings), _convert_="all", _recursive_=False, **own)


def _own_settings(config: Mapping[str, Any]) -> dict[str, Any]:
    """The values of ``config``'s knobs that are the workload's own (its constructor takes them)."""
    return {k: v for k, v in config.items() if k not in GENERIC_KNOBS}


def _breach(workload: Any, model: torch.nn.Module, size: int) -> str | None:
    try:
        batch = workload.make_batch(size, torch.Generator().manual_seed(0))
    except Exception as e:  # every trial would raise it too
        return f"make_batch({size}, generator) raised {type(e).__name__}: {_first_line(e)}"
    breach = _batch_breach(batch, size)
    if breach:
        return breach
    try:
        loss = workload.loss(model, map_tensors(lambda t: t.to("meta"), batch))
    except Exception:  # noqa: BLE001 - the meta device cannot run it: the step will
        return None
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        return (
            "loss(model, batch) must return one value (a mean over the batch), but returned "
            f"{shape}; reduce it, e.g. with .mean()"
        )
    if not loss.requires_grad:
        return (
            "loss(model, batch) does not depend on the model's parameters (no gradient to train "
            "on); compute it from the model's output, outside torch.no_grad() and without "
            ".detach()"
        )
    return None


def _batch_breach(batch: Any, size: int) -> str | None:
    tensors = list(_tensors(batch))
    if not tensors:
        return (
            f"make_batch({size}, generator) returned {type(batch).__name__} with no tensor in "
            "it; return a tensor, or a tuple, list or dict of tensors"
        )
    for path, tensor in tensors:
        if tensor.dim() == 0 or tensor.shape[0] != size:
            where = f"the tensor at {path}" if path else "a tensor"
            return (
                f"make_batch({size}, generator) returned {where} of shape {tuple(tensor.shape)}; "
                f"each tensor holds the {size} samples along its first dimension"
            )
    return None


def _tensors(batch: Any, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor in a tensor, or a tuple/list/dict of them (as ``map_tensors`` reaches them),
    with where it sits (``[0]``, ``['tokens']``)."""
    if isinstance(batch, torch.Tensor):
        yield path, batch
    elif isinstance(batch, Mapping):
        for key, value in batch.items():
            yield from _tensors(value, f"{path}[{key!r}]")
    elif isinstance(batch, (list, tuple)):
        for i, value in enumerate(batch):
            yield from _tensors(value, f"{path}[{i}]")
