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


def test_every_package_exports_what_it_imports_for_export():
    """A package's ``__init__`` names its public face in ``__all__``: every name resolves (also
    where it is exported lazily, through ``search.core.lazy_exports``), and the names it imports
    from its modules, for use or for type checkers, are those of ``__all__``."""
    import ast
    import importlib

    for path in sorted((REPO / "search").glob("*/__init__.py")):
        name = f"search.{path.parent.name}"
        package = importlib.import_module(name)
        exported = getattr(package, "__all__", None)
        assert exported is not None, f"{name} has no __all__"
        missing = [x for x in exported if not hasattr(package, x)]
        assert not missing, f"{name}.__all__ names what it does not export: {missing}"
        imported = {
            alias.asname or alias.name
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(f"{name}.")
            for alias in node.names
        } - {"lazy_exports"}
        assert imported == set(exported), f"{name}: its imports and its __all__ differ"


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


def test_no_two_modules_share_a_file_name():
    """A module's file name says what it holds, so two modules of one name would hold one thing
    twice, or be named after too little: ``knobs.py`` for the registry and for the step's knobs."""
    names: dict[str, list[str]] = {}
    for path in sorted((REPO / "search").rglob("*.py")):
        if path.name != "__init__.py":
            names.setdefault(path.name, []).append(str(path.relative_to(REPO)))
    shared = {name: paths for name, paths in names.items() if len(paths) > 1}
    assert shared == {}, f"name these after what each holds: {shared}"


def test_no_two_classes_share_a_name():
    """A class name is one thing across the package: a reader who meets ``Verdict`` should not
    have to look up which module it came from to know what it holds."""
    import ast

    where: dict[str, list[str]] = {}
    for path in sorted((REPO / "search").rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                where.setdefault(node.name, []).append(str(path.relative_to(REPO)))
    shared = {name: paths for name, paths in where.items() if len(paths) > 1}
    assert shared == {}, f"name these after what each is: {shared}"


OPTUNA_PRIVATE = "search/storage/optuna_private.py"
OPTUNA_PRIVATE_NAMES = {"_storage", "_trial_id", "_study_id", "_contains", "_get_stale_trial_ids"}


def test_optuna_private_api_is_used_in_one_module_only():
    """Optuna's private names (a module or attribute starting with ``_``) are reached only through
    ``search.storage.optuna_private``, so that an Optuna release that changes one breaks one module,
    the one that says why each is needed. Attributes are checked by name (those the package has
    needed), on anything but ``self``."""
    import ast

    found = []
    for path in sorted((REPO / "search").rglob("*.py")):
        name = str(path.relative_to(REPO))
        if name == OPTUNA_PRIVATE:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("optuna"):
                parts = (node.module or "").split(".") + [a.name for a in node.names]
                if parts[0] == "optuna" and any(p.startswith("_") for p in parts):
                    found.append(f"{name}:{node.lineno} from {node.module} import ...")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    parts = alias.name.split(".")
                    if parts[0] == "optuna" and any(p.startswith("_") for p in parts):
                        found.append(f"{name}:{node.lineno} import {alias.name}")
            elif (
                isinstance(node, ast.Attribute)
                and node.attr in OPTUNA_PRIVATE_NAMES
                and not (isinstance(node.value, ast.Name) and node.value.id == "self")
            ):
                found.append(f"{name}:{node.lineno} .{node.attr}")
    assert found == [], f"call {OPTUNA_PRIVATE} instead: " + "; ".join(found)
