"""Hydra composition: ``conf/config.yaml`` + a space (``+space=NAME``) + the user's overrides.

The built-in spaces in ``spaces/`` are registered as Hydra config group ``space``; a user's own
``DIR/space/NAME.yaml`` joins the same group through ``--config-dir DIR`` (Hydra's search path).
The composed config is then checked against ``search.config.settings.Settings``, the schema
registered in Hydra's ConfigStore: types, unknown keys and every value's range (see
``load_settings``).
Every failure to compose becomes a ``ConfigError`` whose message is one line saying what to fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import re
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict
from omegaconf.errors import (
    ConfigKeyError,
    MissingMandatoryValue,
    OmegaConfBaseException,
    ValidationError,
)

from search.config.settings import PRESETS, SLO_EXPECTED, Settings
from search.core.errors import ConfigError
from search.measurement.protocol import MeasureSettings

__all__ = [
    "CONF_DIR",
    "ENV_RESOLVER",
    "MIN_MASKED_LEN",
    "SCHEMA_NAME",
    "SECRET_KEYS",
    "SPACES_DIR",
    "builtin_spaces",
    "compose_config",
    "device_type",
    "for_logging",
    "load_settings",
    "preset",
    "redact",
    "redact_tree",
    "resolve",
    "resolve_device",
]


def _data_dir(name: str) -> Path:
    """``conf/`` or ``spaces/``: package data ``search.NAME`` when installed, else the repository's
    own.

    A wheel installs them as data-only packages (see pyproject.toml); an editable install does not
    map them, so a source checkout finds them beside the package.
    """
    spec = importlib.util.find_spec(f"search.{name}")
    if spec is not None and spec.submodule_search_locations:
        return Path(list(spec.submodule_search_locations)[0])
    return Path(__file__).resolve().parents[2] / name


CONF_DIR = _data_dir("conf")
SPACES_DIR = _data_dir("spaces")


def device_type(root: DictConfig) -> str:
    """'cpu' or 'cuda': the type of the chosen ``device`` (names the study)."""
    device = str(root.get("device", "auto"))
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device.split(":")[0]


def preset(root: DictConfig) -> str:
    """'cpu' or 'cuda': the explicit ``preset``, else the device type (picks
    ``${by_device:A,B}``)."""
    chosen = str(root.get("preset", "auto"))
    if chosen not in PRESETS:
        raise ConfigError(f"preset must be one of {', '.join(PRESETS)}, but got {chosen!r}")
    return device_type(root) if chosen == "auto" else chosen


_USERINFO = re.compile(
    r"(?P<scheme>[A-Za-z][\w+.-]*://)(?P<user>[^:/@\s'\"]*)(?P<pw>:[^@/\s'\"]*)?@"
)
_SECRET_QUERY = re.compile(
    r"(?i)(?P<key>[?&;](?:password|passwd|pwd|token|access_token|api_key|apikey|secret|key)=)"
    r"[^&;\s'\"]+"
)
SECRET_KEYS = re.compile(r"(?i)(password|passwd|secret|token|api_?key|credential)")
"""Config keys whose values are secrets as a whole (``db_password``, ``tracking.token``)."""


def redact(text: str) -> str:
    """``text`` with the secrets URLs carry replaced by ``***``, for screens, logs and stores:
    ``scheme://user:PASSWORD@host``, ``scheme://TOKEN@host``, ``scheme://:PASSWORD@host`` and
    query parameters such as ``?password=...`` or ``&token=...``."""

    def userinfo(m: re.Match[str]) -> str:
        if m["pw"] is not None:
            return f"{m['scheme']}{m['user']}:***@"
        return f"{m['scheme']}***@"

    return _SECRET_QUERY.sub(r"\g<key>***", _USERINFO.sub(userinfo, text))


def redact_tree(tree: Any, key: str = "") -> Any:
    """A config tree with every string redacted and the values under secret-looking keys
    (``SECRET_KEYS``) replaced whole."""
    if isinstance(tree, Mapping):
        return {k: redact_tree(v, str(k)) for k, v in tree.items()}
    if isinstance(tree, list):
        return [redact_tree(v, key) for v in tree]
    if key and SECRET_KEYS.search(key) and tree is not None:
        return "***"
    return redact(tree) if isinstance(tree, str) else tree


def _register_resolvers() -> None:
    if not OmegaConf.has_resolver("by_device"):
        OmegaConf.register_new_resolver(
            "by_device", lambda cpu, cuda, *, _root_: cpu if preset(_root_) == "cpu" else cuda
        )
        OmegaConf.register_new_resolver("device_type", lambda *, _root_: device_type(_root_))


def builtin_spaces() -> list[str]:
    return sorted(p.stem for p in SPACES_DIR.glob("*.yaml"))


def _register_builtin_spaces() -> None:
    store = ConfigStore.instance()
    for name in builtin_spaces():
        store.store(group="space", name=name, node=OmegaConf.load(SPACES_DIR / f"{name}.yaml"))


def compose_config(overrides: Sequence[str], config_dirs: Sequence[str] = ()) -> DictConfig:
    """Compose the run's config; ``config_dirs`` are extra Hydra search-path roots
    (``--config-dir``)."""
    _register_resolvers()
    overrides = list(overrides)
    if config_dirs:
        # Quoted: a path may hold a comma, a bracket or a quote, which the list syntax would split.
        roots = ",".join(_hydra_quoted(f"file://{Path(d).resolve()}") for d in config_dirs)
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
    with open_dict(cfg):
        cfg.space.name = cfg.space.get("name") or space_name
    # Checked here, so that --cfg refuses what a run would refuse. The config itself is returned
    # as composed: printed and logged as written (a timeout of 120 stays 120, not 120.0).
    load_settings(cfg)
    return cfg


def _hydra_quoted(text: str) -> str:
    """``text`` as a quoted string of Hydra's override grammar."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _check_space_chosen(cfg: DictConfig, space_name: str | None) -> None:
    available = ", ".join(builtin_spaces())
    if "space" not in cfg:
        raise ConfigError(f"no search space chosen: add +space=NAME (built-in: {available})")
    if space_name is not None and not isinstance(cfg.space, DictConfig):
        held = "a list" if isinstance(cfg.space, ListConfig) else f"the value {cfg.space!r}"
        raise ConfigError(
            f"space '{space_name}' must be a mapping of workload, params and objectives, but its "
            f"file holds {held}"
        )
    if space_name is not None and not cfg.space:
        raise ConfigError(
            f"space '{space_name}' is empty: it needs workload, params and objectives "
            "(see spaces/llm.yaml)"
        )
    if not isinstance(cfg.space, DictConfig) or space_name is None:
        # Hydra turns `+space=X` into the plain string "X" when the group cannot be found.
        raise ConfigError(
            f"unknown space {cfg.space!r}: built-in spaces are {available}; "
            "a space of your own goes in DIR/space/NAME.yaml with --config-dir DIR"
        )


# ---------------------------------------------------------------------------------------------
# The schema: search.config.settings, applied to the composed config


SCHEMA_NAME = "search_settings"
"""``search.config.settings.Settings`` in Hydra's ConfigStore."""


def load_settings(cfg: DictConfig) -> Settings:
    """The typed settings of a composed config: interpolations resolved, every value checked.

    Raises ConfigError with one line naming the key when a value has the wrong type, a key is
    unknown, or a value is out of range (NaN and inf included).
    """
    _register_resolvers()
    typed = cfg if OmegaConf.get_type(cfg) is Settings else _apply_schema(cfg)
    preset(typed)  # a bad preset is named as such, not as a failed ${by_device:...}
    try:
        # Resolves first, then builds the dataclasses: their __post_init__ sees final values.
        settings = OmegaConf.to_object(typed)
    except OmegaConfBaseException as e:
        raise ConfigError(_schema_message(e, e.full_key, typed)) from None
    except ValueError as e:  # a __post_init__ check
        raise ConfigError(" ".join(str(e).split())) from None
    assert isinstance(settings, Settings)
    return settings


def _schema(cfg: DictConfig) -> DictConfig:
    store = ConfigStore.instance()
    store.store(name=SCHEMA_NAME, node=Settings)
    schema = store.load(f"{SCHEMA_NAME}.yaml").node  # a copy of the stored node
    if "measure" in cfg:
        # OmegaConf makes the node of a frozen dataclass read-only, and merging into it fails;
        # the frozen MeasureSettings is still what to_object builds.
        measure = OmegaConf.structured(MeasureSettings)
        OmegaConf.set_readonly(measure, False)
        schema.measure = measure
    return schema


def _apply_schema(cfg: DictConfig) -> DictConfig:
    """``cfg`` typed by the schema: closed to unknown keys, each value converted to its type.

    Interpolations stay as they are; ``load_settings`` resolves them and checks the results.
    """
    schema = _schema(cfg)
    try:
        merged = OmegaConf.merge(schema, cfg)
    except OmegaConfBaseException as e:
        key = e.full_key or _failing_key(schema, cfg)
        raise ConfigError(_schema_message(e, key, cfg)) from None
    assert isinstance(merged, DictConfig)  # a mapping merged into a mapping stays one
    return merged


def _failing_key(schema: DictConfig, cfg: DictConfig) -> str:
    """The top-level key whose merge fails: OmegaConf names none when a list replaces a mapping."""
    for key in cfg:
        try:
            OmegaConf.merge(schema, OmegaConf.masked_copy(cfg, [str(key)]))
        except OmegaConfBaseException as e:
            return str(e.full_key or key)
    return ""


def _schema_message(error: OmegaConfBaseException, key: Any, cfg: DictConfig) -> str:
    key = str(key or "")
    text = " ".join(str(getattr(error, "msg", None) or error).splitlines()[0].split())
    if isinstance(error, ConfigKeyError) and " not in " in text:
        return _unknown_key(key)
    if isinstance(error, MissingMandatoryValue):
        return f"{key} has no value: keep the default of conf/config.yaml, or set {key}=..."
    if isinstance(error, ValidationError) and key:
        return f"{key} must be {_expected(_field_type(key))}, but got {_received(text, key, cfg)}"
    return f"cannot resolve {key}: {text}" if key else text


def _unknown_key(key: str) -> str:
    section, _, name = key.rpartition(".")
    owner = _field_type(section) if section else Settings
    known = [f.name for f in dataclasses.fields(owner)] if dataclasses.is_dataclass(owner) else []
    where = f"the keys under {section} are" if section else "the keys are"
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"; did you mean '{section + '.' if section else ''}{close[0]}'?" if close else ""
    return f"unknown config key '{key}': {where} {', '.join(known)}{hint}"


def _field_type(key: str) -> Any:
    """The schema's type for a dotted key: ``study.n_trials`` -> int, ``slo.x`` -> float."""
    kind: Any = Settings
    for part in key.split(".") if key else []:
        if dataclasses.is_dataclass(kind):
            kind = typing.get_type_hints(kind).get(part, Any)
        elif typing.get_origin(kind) is dict:
            kind = typing.get_args(kind)[1]
        else:
            return Any
    return kind


def _expected(kind: Any) -> str:
    """A field type as an error message says it."""
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    if typing.get_origin(kind) in (typing.Union, types.UnionType) and len(args) == 1:
        return f"{_expected(args[0])} or null"
    if typing.get_origin(kind) is dict:
        return SLO_EXPECTED
    if dataclasses.is_dataclass(kind):
        return f"a mapping of its settings ({', '.join(f.name for f in dataclasses.fields(kind))})"
    names = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}
    return names.get(kind, "a value of the schema's type")


def _received(text: str, key: str, cfg: DictConfig) -> str:
    """The offending value: OmegaConf's message quotes it; else it is read back from ``cfg``."""
    quoted = re.search(r"[Vv]alue '(.*?)'(?: of type '(\w+)')?", text)
    if quoted:
        value, kind = quoted.groups()
        spelled = {"None": "null", "True": "true", "False": "false"}  # as YAML and Hydra write them
        return repr(value) if kind == "str" else spelled.get(value, value)
    value = OmegaConf.select(cfg, key, throw_on_resolution_failure=False)
    if isinstance(value, (DictConfig, ListConfig)):
        value = OmegaConf.to_container(value)
    return "null" if value is None else repr(value)


def _one_line(error: Exception) -> str:
    text = str(error).strip()
    if "Could not find 'space/" in text:
        name = text.split("Could not find 'space/")[1].split("'")[0]
        return (
            f"unknown space '{name}': built-in spaces are {', '.join(builtin_spaces())}; "
            "a space of your own goes in DIR/space/NAME.yaml with --config-dir DIR"
        )
    if text.startswith("Could not override '"):
        key = text.split("'")[1]
        if key.startswith("slo"):
            return f"SLO limits are added with a plus: +{key}=VALUE (e.g. +slo.latency_p95_ms=200)"
        return (
            f"unknown config key '{key}': check the spelling "
            "(python -m search --cfg +space=NAME prints every key), "
            f"or add it with +{key}=..."
        )
    cause = error.__cause__
    if text.startswith("Error merging override ") and isinstance(cause, OmegaConfBaseException):
        return _merge_override_message(text, cause)
    if "missing EQUAL" in text and text.startswith("Error parsing override '"):
        word = text[len("Error parsing override '") :].split("'\n")[0]
        return (
            f"{word!r} is not an override KEY=VALUE, nor a command where one goes first "
            "(python -m search --help lists the commands)"
        )
    if "mismatched input '<EOF>'" in text:
        return "an empty argument is no override: drop it, or give KEY=VALUE"
    if type(error).__name__ == "OverrideParseException" or "LexerNoViableAltException" in text:
        bad = text.split(": ", 1)[-1].split(" ^")[0].strip()
        return (
            f"cannot parse override {bad!r}: quote values that hold spaces or symbols, "
            "e.g. \"space.constraints=['a < b']\" (Hydra override syntax)"
        )
    first, *rest = [line.strip() for line in text.splitlines() if line.strip()]
    return " ".join([first, *rest[:2]]) if len(first) < 60 else first


def _merge_override_message(text: str, cause: OmegaConfBaseException) -> str:
    """``slo=[1]``: Hydra cannot merge a list into a mapping; say what the key must be instead."""
    key, value = str(cause.full_key or ""), text.split("=", 1)[-1]
    if key and _field_type(key) is not Any:
        return f"{key} must be {_expected(_field_type(key))}, but got {value}"
    return f"{text}: {str(cause).splitlines()[0]}"


ENV_RESOLVER = "oc.env:"
"""An interpolation that reads an environment variable: its value is never logged."""
MIN_MASKED_LEN = 4
"""An environment value this long or longer is masked wherever it appears in a logged string."""


def for_logging(cfg: DictConfig) -> dict[str, Any]:
    """The config as ``resolve`` gives it, fit to store (MLflow params, ``config.yaml``): a value
    read from the environment (``${oc.env:NAME}``) is shown as that interpolation, not as its
    value, and the value is masked wherever else it appears (``${other.key}`` pointing at it, a
    URL built from it); then ``redact_tree``."""
    raw = OmegaConf.to_container(cfg, resolve=False)
    resolved = resolve(cfg)
    secrets: set[str] = set()

    def from_env(raw_node: Any, node: Any) -> Any:
        if isinstance(raw_node, Mapping) and isinstance(node, Mapping):
            return {k: from_env(raw_node.get(k), v) for k, v in node.items()}
        if isinstance(raw_node, list) and isinstance(node, list) and len(raw_node) == len(node):
            return [from_env(r, v) for r, v in zip(raw_node, node, strict=True)]
        if isinstance(raw_node, str) and ENV_RESOLVER in raw_node:
            if node is not None and len(str(node)) >= MIN_MASKED_LEN:
                secrets.add(str(node))
            return raw_node
        return node

    shown = from_env(raw, resolved)

    def masked(node: Any) -> Any:
        if isinstance(node, Mapping):
            return {k: masked(v) for k, v in node.items()}
        if isinstance(node, list):
            return [masked(v) for v in node]
        if isinstance(node, str) and ENV_RESOLVER not in node:
            for secret in sorted(secrets, key=len, reverse=True):
                node = node.replace(secret, "***")
        return node

    tree = redact_tree(masked(shown))
    assert isinstance(tree, dict)
    return tree


def resolve(cfg: DictConfig) -> dict[str, Any]:
    """The config as plain containers with every interpolation resolved."""
    preset(cfg)  # a bad preset is named as such, not as a failed interpolation
    try:
        container = OmegaConf.to_container(cfg, resolve=True)
    except Exception as e:
        raise ConfigError(_one_line(e)) from None
    assert isinstance(container, dict)  # a DictConfig becomes a dict
    return {str(key): value for key, value in container.items()}


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
            raise ConfigError(
                f"device={spec} but no CUDA device is visible here: use device=cpu (or auto)"
            )
        if (device.index or 0) >= count:
            raise ConfigError(
                f"device={spec} but only {count} CUDA device(s) exist: use cuda:0..cuda:{count - 1}"
            )
    return device
