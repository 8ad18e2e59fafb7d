"""Writes architecture/layout.md at build time (mkdocs-gen-files), so the map has one source.

The package's layers come from the import rules in ``pyproject.toml`` (``[tool.importlinter]``,
the contract ``lint-imports`` holds in CI), top first; each package's and module's one-line
summary is the first paragraph of its docstring, read with ``ast`` (nothing is imported). The
hand-written part (what lies outside the package) is ``architecture/layout-template.md``: the
tables replace its marker line. A module without a docstring fails the build.

Run it alone to print the page: ``python docs/gen_layout.py``.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "search"
TEMPLATE = ROOT / "docs" / "architecture" / "layout-template.md"
MARKER = "<!-- the generated tables of every package and module go here (docs/gen_layout.py) -->"
PAGE = "architecture/layout.md"


def layers() -> list[list[str]]:
    """The layers of the import contract, top first, each a list of dotted names."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (contract,) = [c for c in config["contracts"] if c["type"] == "layers"]
    return [
        [name.strip() for name in layer.replace("|", ":").split(":")]
        for layer in contract["layers"]
    ]


def summary(path: Path) -> str:
    """The first paragraph of a module's docstring, on one line; a module without one fails the
    build."""
    doc = ast.get_docstring(ast.parse(path.read_text()))
    if not doc:
        raise SystemExit(f"{path.relative_to(ROOT)} has no docstring: say what it holds")
    return " ".join(doc.split("\n\n")[0].split()).replace("|", "\\|")


def rows_of(dotted: str) -> tuple[str, list[str]]:
    """A package's summary and a table row per module; a single module's row."""
    path = ROOT.joinpath(*dotted.split("."))
    if not path.is_dir():
        source = path.with_suffix(".py")
        return summary(source), [f"| `{source.relative_to(ROOT).as_posix()}` | {summary(source)} |"]
    modules = sorted(p for p in path.glob("*.py") if p.name != "__init__.py")
    rows = [f"| `{p.relative_to(ROOT).as_posix()}` | {summary(p)} |" for p in modules]
    return summary(path / "__init__.py"), rows


def page() -> str:
    out: list[str] = []
    for number, layer in enumerate(layers()):
        for dotted in layer:
            package_summary, rows = rows_of(dotted)
            out += [
                f"### `{dotted}`",
                "",
                f"Layer {number + 1} from the top. {package_summary}",
                "",
            ]
            out += ["| module | what it holds |", "|---|---|", *rows, ""]
    return TEMPLATE.read_text().replace(MARKER, "\n".join(out).rstrip("\n"))


if __name__ == "__main__":
    print(page(), end="")
else:  # run by mkdocs-gen-files during a build
    import mkdocs_gen_files

    with mkdocs_gen_files.open(PAGE, "w") as f:
        f.write(page())
    mkdocs_gen_files.set_edit_path(PAGE, "gen_layout.py")
