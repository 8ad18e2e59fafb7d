"""Hydra composition: ``conf/config.yaml`` + a space (``+space=NAME``) + the user's overrides.

The built-in spaces in ``spaces/`` are registered as Hydra config group ``space``; a user's own
``DIR/space/NAME.yaml`` joins the same group through ``--config-dir DIR`` (Hydra's search path).
Every failure to compose becomes a ``ConfigError`` whose message is one line saying what to fix.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Any, Sequence

import torch
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, OmegaConf, open_dict

def _data_dir(name: str) -> Path:
    """``conf/`` or ``spaces/``: package data ``search.NAME`` when installed, else the repository's own.

    A wheel installs them as data-only packages (see pyproject.toml); an editable install does not
    map them, so a source checkout finds them beside the package.
    """
    spec = importlib.util.find_spec(f"search.{name}")
    if spec is not None and spec.submodule_search_locations:
        return Path(list(spec.submodule_search_locations)[0])
    return Path(__file__).resolve().parent.parent / name


CONF_DIR = _data_dir("conf")
SPACES_DIR = _data_dir("spaces")


class ConfigError(ValueError):
    """Bad input on the command line or in a config file; the message says what to change."""


PRESETS = ("auto", "cpu", "cuda")


def device_type(root: DictConfig) -> str:
    """'cpu' or 'cuda': the type of the chosen ``device`` (names the study)."""
    device = str(root.get("device", "auto"))
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device.split(":")[0]


def preset(root: DictConfig) -> str:
    """'cpu' or 'cuda': the explicit ``preset``, else the device type (picks ``${by_device:A,B}``)."""
    chosen = str(root.get("preset", "auto"))
    if chosen not in PRESETS:
        raise ConfigError(f"preset must be one of {', '.join(PRESETS)}, but got {chosen!r}")
    return device_type(root) if chosen == "auto" else chosen


def redact(text: str) -> str:
    """``scheme://user:password@host`` with the password replaced, for logs and screens."""
    return re.sub(r"(://[^:/@\s]+:)[^@\s]+@", r"\1***@", text)


def _register_resolvers() -> None:
    if not OmegaConf.has_resolver("by_device"):
        OmegaConf.register_new_resolver("by_device", lambda cpu, cuda, *, _root_: cpu if preset(_root_) == "cpu" else cuda)
        OmegaConf.register_new_resolver("device_type", lambda *, _root_: device_type(_root_))


def builtin_spaces() -> list[str]:
    return sorted(p.stem for p in SPACES_DIR.glob("*.yaml"))


def _register_builtin_spaces() -> None:
    store = ConfigStore.instance()
    for name in builtin_spaces():
        store.store(group="space", name=name, node=OmegaConf.load(SPACES_DIR / f"{name}.yaml"))


def compose_config(overrides: Sequence[str], config_dirs: Sequence[str] = ()) -> DictConfig:
    """Compose the run's config; ``config_dirs`` are extra Hydra search-path roots (``--config-dir``)."""
    _register_resolvers()
    overrides = list(overrides)
    if config_dirs:
        roots = ",".join(f"file://{Path(d).resolve()}" for d in config_dirs)
        overrides.append(f"hydra.searchpath=[{roots}]")
    GlobalHydra.instance().clear()
    try:
        _register_builtin_spaces()
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose("config", overrides=overrides, return_hydra_config=True)
    except Exception as e:  # Hydra raises several types; all are the user's input
        raise ConfigError(_one_line(e)) from None
    finally:
        GlobalHydra.instance().clear()
    space_name = cfg.hydra.runtime.choices.get("space")
    with open_dict(cfg):
        del cfg["hydra"]
    _check_space_chosen(cfg, space_name)
    _check_no_added_keys(cfg)
    with open_dict(cfg):
        cfg.space.name = cfg.space.get("name") or space_name
    return cfg


def _check_space_chosen(cfg: DictConfig, space_name: str | None) -> None:
    available = ", ".join(builtin_spaces())
    if "space" not in cfg:
        raise ConfigError(f"no search space chosen: add +space=NAME (built-in: {available})")
    if not isinstance(cfg.space, DictConfig) or space_name is None:
        # Hydra turns `+space=X` into the plain string "X" when the group cannot be found.
        raise ConfigError(f"unknown space {cfg.space!r}: built-in spaces are {available}; "
                          "a space of your own goes in DIR/space/NAME.yaml with --config-dir DIR")


def _check_no_added_keys(cfg: DictConfig) -> None:
    """``+study.n_trails=3`` would add a key nothing reads: refuse keys the defaults do not have.

    ``space`` (free-form) and ``slo`` (a mapping of limits) are open to additions.
    """
    defaults = OmegaConf.load(CONF_DIR / "config.yaml")
    for key in cfg:
        if key in ("space", "slo"):
            continue
        if key not in defaults:
            raise ConfigError(f"unknown config key '{key}': the keys are {', '.join(map(str, defaults))}")
        if isinstance(cfg[key], DictConfig):
            extra = set(cfg[key]) - set(defaults[key])
            if extra:
                raise ConfigError(f"unknown config key '{key}.{sorted(extra)[0]}': the keys under {key} are "
                                  f"{', '.join(map(str, defaults[key]))}")


def _one_line(error: Exception) -> str:
    text = str(error).strip()
    if "Could not find 'space/" in text:
        name = text.split("Could not find 'space/")[1].split("'")[0]
        return (f"unknown space '{name}': built-in spaces are {', '.join(builtin_spaces())}; "
                "a space of your own goes in DIR/space/NAME.yaml with --config-dir DIR")
    if text.startswith("Could not override '"):
        key = text.split("'")[1]
        if key.startswith("slo"):
            return f"SLO limits are added with a plus: +{key}=VALUE (e.g. +slo.latency_p95_ms=200)"
        return f"unknown config key '{key}': check the spelling (python -m search --cfg +space=NAME prints every key), or add it with +{key}=..."
    if type(error).__name__ == "OverrideParseException" or "LexerNoViableAltException" in text:
        bad = text.split(": ", 1)[-1].split(" ^")[0].strip()
        return (f"cannot parse override {bad!r}: quote values that hold spaces or symbols, "
                "e.g. \"space.constraints=['a < b']\" (Hydra override syntax)")
    first, *rest = [line.strip() for line in text.splitlines() if line.strip()]
    return " ".join([first, *rest[:2]]) if len(first) < 60 else first


def resolve(cfg: DictConfig) -> dict[str, Any]:
    """The config as plain containers with every interpolation resolved."""
    preset(cfg)  # a bad preset is named as such, not as a failed interpolation
    try:
        return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
    except Exception as e:
        raise ConfigError(_one_line(e)) from None


def resolve_device(spec: str) -> torch.device:
    """``auto`` | ``cpu`` | ``cuda`` | ``cuda:N`` as a torch.device that exists on this machine."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(spec)
    except (RuntimeError, ValueError):
        raise ConfigError(f"unknown device {spec!r}: use auto, cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"unsupported device {spec!r}: use auto, cpu, cuda or cuda:N")
    if device.type == "cuda":
        count = torch.cuda.device_count()
        if count == 0:
            raise ConfigError(f"device={spec} but no CUDA device is visible here: use device=cpu (or auto)")
        if (device.index or 0) >= count:
            raise ConfigError(f"device={spec} but only {count} CUDA device(s) exist: use cuda:0..cuda:{count - 1}")
    return device
