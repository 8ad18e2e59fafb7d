"""Writes guide/options.md at build time (mkdocs-gen-files), so the options have one source.

Every key comes from the typed settings: ``search/config/settings.py`` (one dataclass per section
of ``conf/config.yaml``) and ``search/measurement/protocol.py`` (``MeasureSettings``, the
``measure`` section), each field followed by a docstring. The defaults and their inline comments
come from ``conf/config.yaml``. The Python is read with ``ast``, never imported (no torch
needed); a key the YAML and the dataclasses do not agree on fails the build. The hand-written
prose around the tables is ``guide/options-template.md``: the tables replace its marker line.

Run it alone to print the page: ``python docs/gen_options.py``.
"""

from __future__ import annotations

import ast
import inspect
import posixpath
import re
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = ROOT / "search" / "config" / "settings.py"
MEASURE = ROOT / "search" / "measurement" / "protocol.py"
CONFIG = ROOT / "conf" / "config.yaml"
TEMPLATE = ROOT / "docs" / "guide" / "options-template.md"
MARKER = "<!-- the generated tables of every key go here (docs/gen_options.py) -->"
PAGE = "guide/options.md"

TOP = "Settings"
"""The dataclass of the whole config; its fields typed with another dataclass are sections."""

# Where each section's behaviour is explained (pages of this site, relative to docs/).
PROPOSALS = ("Proposals: constraints, repeats, resuming", "guide/proposals.md")
EXPLAINED = {
    "study": [PROPOSALS, ("Choice of sampler", "method/sampler.md")],
    "runner": [("When trials fail", "operations/failures.md")],
    "measure": [("How it measures", "method/measuring.md")],
    "stable": [
        ("The noise floor", "method/noise-floor.md"),
        ("Re-validation, stable, recommended", "method/revalidation.md"),
    ],
    "noise": [("The noise floor", "method/noise-floor.md")],
    "revalidate": [
        ("Re-validation, stable, recommended", "method/revalidation.md"),
        ("Where the time goes", "method/time.md"),
    ],
    "retune": [("Nightly re-tuning", "guide/nightly.md")],
    "tracking": [
        ("MLflow layout", "operations/mlflow-layout.md"),
        ("When the MLflow server is down", "operations/mlflow-down.md"),
    ],
}


class Field:
    def __init__(self, name: str, annotation: str, doc: str | None) -> None:
        self.name, self.annotation, self.doc = name, annotation, doc


class Dataclass:
    def __init__(self, name: str, doc: str, fields: list[Field], source: Path) -> None:
        self.name, self.doc, self.fields, self.source = name, doc, fields, source


def dataclasses_of(path: Path) -> dict[str, Dataclass]:
    """The ``@dataclass`` classes of a module: each field with the string literal after it."""
    found = {}
    for node in ast.parse(path.read_text()).body:
        if not isinstance(node, ast.ClassDef):
            continue
        if not any(ast.unparse(d).split("(")[0].endswith("dataclass") for d in node.decorator_list):
            continue
        fields = []
        for statement, following in zip(node.body, node.body[1:] + [None], strict=True):
            if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
                literal = isinstance(following, ast.Expr) and isinstance(
                    following.value, ast.Constant
                )
                doc = following.value.value if literal else None
                annotation = ast.unparse(statement.annotation)
                fields.append(Field(statement.target.id, annotation, doc))
        found[node.name] = Dataclass(node.name, ast.get_docstring(node) or "", fields, path)
    return found


def inline_comments(text: str) -> dict[str, str]:
    """``section.key`` (or ``key``) -> the comment on its line of the YAML."""
    comments, section = {}, None
    for line in text.splitlines():
        match = re.match(r"^(\s*)([A-Za-z_]\w*):(.*)$", line)
        if not match:
            continue
        indent, key, rest = match.groups()
        if not indent:
            section = key
        dotted = key if not indent else f"{section}.{key}"
        if "#" in rest:
            comments[dotted] = rest.split("#", 1)[1].strip()
    return comments


def prose(text: str) -> str:
    """A docstring or comment as one line of Markdown that fits a table cell."""
    text = " ".join(inspect.cleandoc(text).split())
    text = text.replace("``", "`")
    return link_docs(escape_pipes(text))


def escape_pipes(text: str) -> str:
    """A ``|`` outside code spans would end the table cell; inside one it shows as it is."""
    parts = text.split("`")
    for i in range(0, len(parts), 2):  # the even parts lie outside code spans
        parts[i] = parts[i].replace("|", r"\|")
    return "`".join(parts)


def link_docs(text: str) -> str:
    """``docs/x/y.md`` named in a comment becomes a link from this page; a code span around it is
    dropped (a link inside one would show as its raw text)."""

    def link(match: re.Match[str]) -> str:
        target = posixpath.relpath(match.group(2), posixpath.dirname(PAGE))
        return f"[{match.group(1)}]({target})"

    return re.sub(r"`?(docs/([\w/-]+\.md))`?", link, text)


BY_DEVICE = re.compile(r"^\$\{by_device:([^,}]*),([^}]*)\}$")
PLACEHOLDERS = {"runs_dir": "<runs_dir>", "space.name": "<space>", "device_type:": "<device type>"}


def show(value: object) -> str:
    """A default as the page shows it; ``${by_device:A,B}`` as A on a CPU, B on CUDA."""
    if isinstance(value, str):
        by_device = BY_DEVICE.match(value)
        if by_device:
            cpu, cuda = (v.strip() for v in by_device.groups())
            return f"`{cpu}` (CPU) / `{cuda}` (CUDA)"
        value = re.sub(
            r"\$\{([^}]*)\}", lambda m: PLACEHOLDERS.get(m.group(1), f"<{m.group(1)}>"), value
        )
        return f"`{value}`"
    return f"`{yaml.safe_dump(value, default_flow_style=True).strip().removesuffix('...').strip()}`"


def words(text: str) -> set[str]:
    return set(re.findall(r"[a-z0-9]+", text.lower()))


def says_nothing_more(comment: str, doc: str) -> bool:
    """Whether the YAML comment only repeats the docstring (nearly all its words are there)."""
    said = words(comment)
    return len(said - words(doc)) <= 0.15 * len(said)


def table(rows: list[tuple[str, str, str]]) -> list[str]:
    out = ["| key | default | meaning |", "|---|---|---|"]
    out += [f"| `{key}` | {default} | {meaning} |" for key, default, meaning in rows]
    return out + [""]


def row(key: str, default: str, field: Field, comments: dict[str, str]) -> tuple[str, str, str]:
    if not (isinstance(field.doc, str) and field.doc.strip()):
        sys.exit(f"{key} has no docstring in the settings")
    meaning = prose(field.doc)
    comment = comments.get(key)
    if comment and not says_nothing_more(comment, field.doc):
        meaning += f"<br>*`conf/config.yaml`:* {prose(comment)}"
    return key, default, meaning


def page() -> str:
    classes = {**dataclasses_of(MEASURE), **dataclasses_of(SETTINGS)}
    raw = CONFIG.read_text()
    config = yaml.safe_load(raw)
    comments = inline_comments(raw)
    top = classes[TOP]
    sections = {f.name: classes[f.annotation] for f in top.fields if f.annotation in classes}
    plain = [f for f in top.fields if f.name not in sections]

    expected = {f.name for f in top.fields} - {"space"}  # the space comes from +space=NAME
    if set(config) != expected:
        sys.exit(f"conf/config.yaml and {TOP} disagree on the keys: {set(config) ^ expected}")
    for name, cls in sections.items():
        keys, fields = set(config[name] or {}), {f.name for f in cls.fields}
        if keys != fields:
            sys.exit(f"conf/config.yaml '{name}' and {cls.name} disagree: {keys ^ fields}")

    template = TEMPLATE.read_text()
    if template.count(MARKER) != 1:
        sys.exit(f"{TEMPLATE.name} must hold the line {MARKER!r} once")
    out = [
        "## Every key",
        "",
        "Generated from the settings' docstrings (`search/config/settings.py`, and "
        "`search/measurement/protocol.py` for `measure`) and the defaults and comments of "
        "`conf/config.yaml`, so it always says what the code says. A default written "
        "`A (CPU) / B (CUDA)` is `${by_device:A,B}` in"
        " the file: A under the CPU preset, B under the CUDA preset. `<runs_dir>` stands for the"
        " value of `runs_dir`, `<space>` for the space's name and `<device type>` for `cpu` or"
        " `cuda`.",
        "",
        "### Top level",
        "",
        f"{prose(top.doc)} (`{top.name}` in `search/config/settings.py`)",
        "",
    ]
    rows = []
    for field in plain:
        default = show(config[field.name]) if field.name in config else "`+space=NAME`"
        rows.append(row(field.name, default, field, comments))
    out += table(rows)

    for name, cls in sections.items():
        source = cls.source.relative_to(ROOT).as_posix()
        out += [f"### `{name}`", "", f"{prose(cls.doc)} (`{cls.name}` in `{source}`)", ""]
        if name in comments:
            out += [f"*`conf/config.yaml`:* {prose(comments[name])}", ""]
        pages = EXPLAINED.get(name, [])
        if pages:
            links = ", ".join(
                f"[{title}]({posixpath.relpath(p, posixpath.dirname(PAGE))})" for title, p in pages
            )
            out += [f"Explained in: {links}.", ""]
        rows = [
            row(f"{name}.{f.name}", show(config[name][f.name]), f, comments) for f in cls.fields
        ]
        out += table(rows)
    return template.replace(MARKER, "\n".join(out).rstrip("\n"))


if __name__ == "__main__":
    print(page(), end="")
else:  # run by mkdocs-gen-files during a build
    import mkdocs_gen_files

    with mkdocs_gen_files.open(PAGE, "w") as f:
        f.write(page())
    mkdocs_gen_files.set_edit_path(PAGE, "gen_options.py")
