"""Hydra composition: ``conf/config.yaml`` + a space (``+space=NAME``) + the user's overrides.

The built-in spaces in ``spaces/`` are registered as Hydra config group ``space``; a user's own
``DIR/space/NAME.yaml`` joins the same group through ``--config-dir DIR`` (Hydra's search path).
The composed config is then checked against ``search.config.settings.Settings``, the schema
registered in Hydra's ConfigStore: types, unknown keys and every value's range (see
``load_settings``).
Every failure to compose becomes a ``ConfigError`` whose message is one line saying what to fix
(``search.config.messages``).
"""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from search.config.messages import failing_key, not_text, one_line, schema_message
from search.config.settings import PRESETS, Settings
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
        OmegaConf.register_new_resolver("by_device", _by_device)
        OmegaConf.register_new_resolver("device_type", lambda *, _root_: device_type(_root_))
        OmegaConf.register_new_resolver("model_suffix", model_suffix)


def model_suffix(model: Any) -> str:
    """``${model_suffix:${model}}``: a model's name as the end of a study's (``hf-gpt2``), empty
    where none is named: a hub name's owner and name joined by ``--`` (as the hub's own cache
    names them), a local config by its folder (or its file's stem where the file is not
    ``config.json``), any other character that a folder name cannot hold as ``-``."""
    if model is None or model == "":
        return ""
    text = str(model)
    path = Path(text)
    if text.endswith(".json"):
        text = path.parent.name if path.name == "config.json" and path.parent.name else path.stem
    elif path.is_dir():
        text = path.resolve().name
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", text.replace("/", "--")).strip("-")
    return f"-{slug or 'model'}"


def _by_device(*values: Any, _root_: Any) -> Any:
    """``${by_device:A,B}``: A on the CPU preset, B on the CUDA one."""
    if len(values) != 2:
        raise ValueError(
            f"${{by_device:...}} takes two values, the CPU preset's then the CUDA preset's "
            f"(e.g. ${{by_device:8,64}}), but got {len(values)}"
        )
    return values[0] if preset(_root_) == "cpu" else values[1]


def builtin_spaces() -> list[str]:
    return sorted(p.stem for p in SPACES_DIR.glob("*.yaml"))


def _register_builtin_spaces(shadowed: set[str]) -> None:
    # A built-in that a user's file shadows is left out: Hydra would otherwise merge the user's
    # file into it as a "schema", with a deprecation warning. compose_config refuses that name.
    store = ConfigStore.instance()
    for name in shadowed:  # the store outlives a call: an earlier one may have stored it
        store.repo.get("space", {}).pop(f"{name}.yaml", None)
    for name in sorted(set(builtin_spaces()) - shadowed):
        store.store(group="space", name=name, node=OmegaConf.load(SPACES_DIR / f"{name}.yaml"))


def _user_space_files(config_dirs: Sequence[str]) -> dict[str, Path]:
    """Each ``DIR/space/NAME.yaml`` of the ``--config-dir`` roots, by NAME; a root that is not a
    directory is refused (Hydra would only warn, and run the built-ins)."""
    files: dict[str, Path] = {}
    for root in config_dirs:
        if not Path(root).is_dir():
            raise ConfigError(f"--config-dir {root}: no such directory (it holds space/NAME.yaml)")
        for path in sorted((Path(root) / "space").glob("*.yaml")):
            files.setdefault(path.stem, path)
    return files


def _check_overrides(overrides: Sequence[str]) -> None:
    for override in overrides:
        key, _, value = override.lstrip("+~").partition("=")
        if not key and value:
            raise ConfigError(f"{override!r} has no key: write KEY=VALUE, e.g. study.n_trials=5")
        if key == "space" and not override.startswith(("+", "~")):
            raise ConfigError(f"{override!r}: a space is added, not set: write +{override}")
        if key == "space" and value.strip().endswith((".yaml", ".yml")):
            # Hydra would load NAME.yaml and name the study, its store and history "NAME.yaml".
            name = value.strip().rsplit(".", 1)[0]
            raise ConfigError(f"{override!r}: name the space without its extension, +space={name}")
        if key == "space" and value.lstrip().startswith("["):
            # Hydra would merge the listed spaces into one, silently.
            raise ConfigError(
                f"{override!r}: choose one space, +space=NAME (built-in: "
                f"{', '.join(builtin_spaces())})"
            )


def compose_config(overrides: Sequence[str], config_dirs: Sequence[str] = ()) -> DictConfig:
    """Compose the run's config; ``config_dirs`` are extra Hydra search-path roots
    (``--config-dir``)."""
    _register_resolvers()
    overrides = list(overrides)
    _check_overrides(overrides)
    user_spaces = _user_space_files(config_dirs)
    shadowed = set(user_spaces) & set(builtin_spaces())
    if config_dirs:
        # Quoted: a path may hold a comma, a bracket or a quote, which the list syntax would split.
        roots = ",".join(_hydra_quoted(f"file://{Path(d).resolve()}") for d in config_dirs)
        overrides.append(f"hydra.searchpath=[{roots}]")
    GlobalHydra.instance().clear()
    try:
        _register_builtin_spaces(shadowed)
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose("config", overrides=overrides, return_hydra_config=True)
    except UnicodeDecodeError as e:
        raise ConfigError(not_text(e, user_spaces.values())) from None
    except Exception as e:  # Hydra raises several types; all are the user's input
        raise ConfigError(one_line(e, builtin_spaces())) from None
    finally:
        GlobalHydra.instance().clear()
    space_name = cfg.hydra.runtime.choices.get("space")
    with open_dict(cfg):
        del cfg["hydra"]
    if space_name in shadowed:
        raise ConfigError(
            f"{user_spaces[space_name]} has the name of a built-in space: rename it (its study "
            "would share the built-in's name, store and history)"
        )
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
    _check_model_is_read(cfg)
    typed = cfg if OmegaConf.get_type(cfg) is Settings else _apply_schema(cfg)
    preset(typed)  # a bad preset is named as such, not as a failed ${by_device:...}
    try:
        # Resolves first, then builds the dataclasses: their __post_init__ sees final values.
        settings = OmegaConf.to_object(typed)
    except OmegaConfBaseException as e:
        raise ConfigError(schema_message(e, e.full_key, typed)) from None
    except ValueError as e:  # a __post_init__ check
        raise ConfigError(" ".join(str(e).split())) from None
    assert isinstance(settings, Settings)
    return settings


def _check_model_is_read(cfg: DictConfig) -> None:
    """``model=`` only with a space whose workload reads it (``${model}``): elsewhere it would be
    ignored, and the run would tune another model than the one named."""
    if cfg.get("model") is None or "space" not in cfg:
        return
    raw = OmegaConf.to_container(cfg.space, resolve=False)
    if not re.search(r"\$\{\s*model\s*\}", json.dumps(raw, default=str)):
        raise ConfigError(
            f"model={cfg.model}: space '{cfg.space.get('name', '?')}' builds its own model and "
            "reads no model=; name a model with a library's space (+space=hf model=gpt2)"
        )


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
        key = e.full_key or failing_key(schema, cfg)
        raise ConfigError(schema_message(e, key, cfg)) from None
    assert isinstance(merged, DictConfig)  # a mapping merged into a mapping stays one
    return merged


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
        raise ConfigError(one_line(e, builtin_spaces())) from None
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
