"""The package's shape: the import rules of ``pyproject.toml`` cover every module, so a new one
must take a place in the layers (``lint-imports``, run in CI, then checks that its imports point
only downwards), and every public module says what it exports (``__all__``)."""

from __future__ import annotations

import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_every_module_of_the_package_has_a_layer():
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    (layers,) = [c["layers"] for c in config["contracts"] if c["type"] == "layers"]
    placed = {name.strip() for layer in layers for name in layer.replace("|", ":").split(":")}
    package = REPO / "search"
    modules = {
        f"search.{p.stem if p.is_file() else p.name}"
        for p in package.iterdir()
        if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").exists()
    }
    assert modules - placed == set(), "add these modules to a layer in pyproject.toml"
    assert placed - modules == set(), "these layers name modules that do not exist"


def test_every_public_module_says_what_it_exports():
    import importlib

    package = REPO / "search"
    for path in sorted(package.rglob("*.py")):
        if path.name.startswith("_"):
            continue  # __init__ (its own list), __main__, private modules
        name = ".".join(path.relative_to(REPO).with_suffix("").parts)
        module = importlib.import_module(name)
        exported = getattr(module, "__all__", None)
        assert exported is not None, f"{name} has no __all__"
        missing = [x for x in exported if not hasattr(module, x)]
        assert not missing, f"{name}.__all__ names what it does not define: {missing}"


MODULE_LINES = 500
FUNCTION_LINES = 60


def test_no_module_over_500_lines_and_no_function_over_60():
    """A module holds one concept and a function fits on a screen (docstrings count)."""
    import ast

    too_long = []
    for path in sorted((REPO / "search").rglob("*.py")):
        text = path.read_text()
        name = path.relative_to(REPO)
        if len(text.splitlines()) > MODULE_LINES:
            too_long.append(f"{name}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                if lines > FUNCTION_LINES:
                    too_long.append(f"{name}:{node.lineno} {node.name}: {lines} lines")
    assert too_long == [], "split these: " + "; ".join(too_long)


FUNCTION_PARAMETERS = 6


def test_no_function_takes_over_6_parameters():
    """Values, not long argument lists. The 60-line cap split long functions into helpers that
    each took what the whole had in scope, and their argument lists grew to 9 or 13; a value
    (a dataclass) says what travels together and gives it a name, and a call site stays
    readable. Counted: every parameter but ``self`` and ``cls``, ``*args`` and ``**kwargs`` one
    each."""
    import ast

    too_many = []
    for path in sorted((REPO / "search").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                a = node.args
                names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
                names += [x.arg for x in (a.vararg, a.kwarg) if x is not None]
                counted = [n for n in names if n not in ("self", "cls")]
                if len(counted) > FUNCTION_PARAMETERS:
                    name = path.relative_to(REPO)
                    too_many.append(f"{name}:{node.lineno} {node.name}: {len(counted)} parameters")
    assert too_many == [], "pass values instead: " + "; ".join(too_many)
