"""Hydra's and OmegaConf's errors as one line that says what to fix: an unknown key with the
keys that exist, a value of the wrong type with the type the schema wants, an override Hydra
cannot parse with how to quote it (``search.config.compose`` raises them as ``ConfigError``)."""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import (
    ConfigKeyError,
    MissingMandatoryValue,
    OmegaConfBaseException,
    ValidationError,
)

from search.config.settings import SLO_EXPECTED, Settings

__all__ = [
    "KNOB_MAPPING_EXPECTED",
    "expected",
    "failing_key",
    "field_type",
    "not_text",
    "one_line",
    "schema_message",
]


def not_text(error: UnicodeDecodeError, files: Iterable[Path]) -> str:
    """A file that is not text, named: the first of ``files`` (the user's spaces) that fails to
    decode, else ``error`` alone (the file Hydra read is not in it)."""
    for path in files:
        try:
            path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            return f"{path} is not UTF-8 text (byte {error.start}): a space is a YAML file"
    return f"a config file is not UTF-8 text: {error.reason} at byte {error.start}"


KNOB_MAPPING_EXPECTED = "a mapping of knob name to value, e.g. noise.control={precision:fp32}"


def failing_key(schema: DictConfig, cfg: DictConfig) -> str:
    """The deepest key whose merge fails: OmegaConf names none when a list replaces a mapping
    (``noise.control=[1]``)."""
    tree = OmegaConf.to_container(cfg, resolve=False)
    assert isinstance(tree, dict)
    return _failing_path(schema, tree, [])


def _failing_path(schema: DictConfig, tree: Mapping[Any, Any], path: list[str]) -> str:
    """The key below ``path`` in ``tree`` (plain containers) that fails to merge into
    ``schema``."""
    for key, value in tree.items():
        only = {key: value}
        for parent in reversed(path):
            only = {parent: only}
        try:
            OmegaConf.merge(schema, OmegaConf.create(only))
        except OmegaConfBaseException as e:
            here = [*path, str(key)]
            if isinstance(value, Mapping):
                return _failing_path(schema, value, here) or ".".join(here)
            return str(e.full_key or ".".join(here))
    return ""


def schema_message(error: OmegaConfBaseException, key: Any, cfg: DictConfig) -> str:
    key = str(key or "")
    text = " ".join(str(getattr(error, "msg", None) or error).splitlines()[0].split())
    if isinstance(error, ConfigKeyError) and " not in " in text:
        return unknown_key(key)
    if isinstance(error, MissingMandatoryValue):
        return f"{key} has no value: keep the default of conf/config.yaml, or set {key}=..."
    if isinstance(error, ValidationError) and key:
        return f"{key} must be {expected(field_type(key))}, but got {received(text, key, cfg)}"
    # a resolver's own message is the one to show, not OmegaConf's wrapping of it
    text = re.sub(r"^\w+ raised while resolving interpolation: ", "", text)
    return f"cannot resolve {key}: {text}" if key else text


def unknown_key(key: str) -> str:
    section, _, name = key.rpartition(".")
    owner = field_type(section) if section else Settings
    known = [f.name for f in dataclasses.fields(owner)] if dataclasses.is_dataclass(owner) else []
    if name in known:  # ~KEY KEY=VALUE: Hydra removed it, then had nothing to set
        return (
            f"config key '{key}' was removed (~{key}) before an override set it: "
            f"drop ~{key}, or set it alone ({key}=VALUE)"
        )
    where = f"the keys under {section} are" if section else "the keys are"
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"; did you mean '{section + '.' if section else ''}{close[0]}'?" if close else ""
    return f"unknown config key '{key}': {where} {', '.join(known)}{hint}"


def field_type(key: str) -> Any:
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


def expected(kind: Any) -> str:
    """A field type as an error message says it."""
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    if typing.get_origin(kind) in (typing.Union, types.UnionType) and len(args) == 1:
        return f"{expected(args[0])} or null"
    if typing.get_origin(kind) is dict:
        # slo maps metrics to limits; noise.control maps knobs to values.
        return SLO_EXPECTED if typing.get_args(kind)[1] is float else KNOB_MAPPING_EXPECTED
    if dataclasses.is_dataclass(kind):
        return f"a mapping of its settings ({', '.join(f.name for f in dataclasses.fields(kind))})"
    names = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}
    return names.get(kind, "a value of the schema's type")


def received(text: str, key: str, cfg: DictConfig) -> str:
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


def one_line(error: Exception, spaces: Sequence[str]) -> str:
    """``error`` of Hydra's composition as one line saying what to fix (``spaces``: the built-in
    spaces' names, joined)."""
    text = str(error).strip()
    if isinstance(error, yaml.MarkedYAMLError):
        return _not_yaml(error)
    if "Could not find 'space/" in text:
        name = text.split("Could not find 'space/")[1].split("'")[0]
        return (
            f"unknown space '{name}': built-in spaces are {', '.join(spaces)}; "
            "a space of your own goes in DIR/space/NAME.yaml with --config-dir DIR"
        )
    if text.startswith("Config group override must be a string"):  # +space=5
        return f"+space takes the name of a space (built-in: {', '.join(spaces)})"
    if text.startswith("Could not override '"):
        key = text.split("'")[1]
        inner = error.__cause__
        if isinstance(inner, ConfigKeyError) and inner.full_key and inner.full_key != key:
            key = str(inner.full_key)  # study={a:1}: the unknown key is study.a, not study
        if key.startswith("slo"):
            return f"SLO limits are added with a plus: +{key}=VALUE (e.g. +slo.latency_p95_ms=200)"
        section = key.rpartition(".")[0]
        if not section or dataclasses.is_dataclass(field_type(section)):
            # The schema knows every key of this section: a '+' would only be refused next.
            return unknown_key(key)
        return _unknown_open_key(key, inner)
    cause = error.__cause__
    if text.startswith("Error merging override ") and isinstance(cause, OmegaConfBaseException):
        return merge_override_message(text, cause)
    if "missing EQUAL" in text and text.startswith("Error parsing override '"):
        word = text[len("Error parsing override '") :].split("'\n")[0]
        return (
            f"{word!r} is not an override KEY=VALUE, nor a command where one goes first "
            "(python -m search --help lists the commands)"
        )
    if "mismatched input '<EOF>'" in text:
        return "an empty argument is no override: drop it, or give KEY=VALUE"
    if type(error).__name__ == "OverrideParseException" or "LexerNoViableAltException" in text:
        # Hydra's text is either "LexerNoViableAltException: <override> ^" or "no viable
        # alternative at input '<the rest>'" with a link on its next line
        at = re.search(r"at input '(.*)'", text.splitlines()[0])
        bad = text.splitlines()[0].split(": ", 1)[-1].split(" ^")[0].strip()
        what = (
            f"an override at {at.group(1)!r} (a bracket or quote left open?)"
            if at
            else f"override {bad!r}"
        )
        return (
            f"cannot parse {what}: quote values that hold spaces or symbols, "
            "e.g. \"space.constraints=['a < b']\" (Hydra override syntax)"
        )
    first, *rest = [line.strip() for line in text.splitlines() if line.strip()]
    return " ".join([first, *rest[:2]]) if len(first) < 60 else first


def _not_yaml(error: yaml.MarkedYAMLError) -> str:
    """A config file that is not valid YAML: which space, where, and what the parser expected."""
    mark = error.problem_mark or error.context_mark
    path = Path(mark.name) if mark is not None else None
    where = f"{path}, line {mark.line + 1}, column {mark.column + 1}" if mark and path else ""
    what = f"space '{path.stem}' ({where})" if path and path.parent.name == "space" else where
    problem = error.problem or "cannot be parsed"
    opened = error.context_mark
    context = (
        f" ({error.context}"
        + (f" at line {opened.line + 1}" if opened is not None and opened is not mark else "")
        + ")"
        if error.context
        else ""
    )
    return f"{what or 'a config file'}: not valid YAML: {problem}{context}; fix the file"


def _unknown_open_key(key: str, inner: BaseException | None) -> str:
    """An unknown key of a section the schema leaves open (the space): the closest key there is,
    read from the node Hydra could not find it in."""
    parent = getattr(inner, "parent_node", None)
    name = str(getattr(inner, "key", "") or key.rpartition(".")[2])
    known = [str(k) for k in parent.keys()] if isinstance(parent, DictConfig) else []
    close = difflib.get_close_matches(name, known, n=1)
    if close:
        near = key.rpartition(name)[0] + close[0]
        return f"unknown config key '{key}': did you mean '{near}'? (or add it with +{key}=...)"
    return (
        f"unknown config key '{key}': check the spelling "
        "(python -m search --cfg +space=NAME prints every key), "
        f"or add it with +{key}=..."
    )


def merge_override_message(text: str, cause: OmegaConfBaseException) -> str:
    """``slo=[1]``: Hydra cannot merge a list into a mapping; say what the key must be instead."""
    key, value = str(cause.full_key or ""), text.split("=", 1)[-1]
    if key and field_type(key) is not Any:
        return f"{key} must be {expected(field_type(key))}, but got {value}"
    if key.startswith("space.params.") and value.startswith("["):
        return (
            f"{key} is a range or a list of choices, which a list cannot replace: narrow it "
            f"({key}.low=... {key}.high=..., or {key}.choices=[...]), or fix one value ({key}=...)"
        )
    return f"{text}: {str(cause).splitlines()[0]}"
