"""A non-editable install carries every subpackage, conf/ and spaces/, and runs from anywhere."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _subpackages() -> set[str]:
    """Every package under search/ on disk, dotted."""
    return {
        ".".join(init.parent.relative_to(REPO).parts)
        for init in (REPO / "search").rglob("__init__.py")
    }


def test_every_subpackage_is_listed_for_the_install():
    """setuptools installs only the packages listed: four missing ones (storage, strategy,
    stability, revalidation) once left a non-editable install unable to run a study, while an
    editable one (which maps the whole folder) and ``--cfg`` (which imports none of them) hid it."""
    listed = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    missing = _subpackages() - set(listed)
    assert not missing, f"add {sorted(missing)} to [tool.setuptools] packages in pyproject.toml"


@pytest.mark.slow
def test_installed_package_finds_its_config_and_spaces(tmp_path):
    target = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            # the build backend of the test extra (setuptools), not a fresh one installed for
            # the build: the files installed are the same, at a third of the time
            "--no-build-isolation",
            "--target",
            str(target),
            str(REPO),
        ],
        check=True,
        capture_output=True,
        timeout=600,
    )
    installed = {".".join(i.parent.relative_to(target).parts) for i in target.rglob("__init__.py")}
    assert _subpackages() <= installed, sorted(_subpackages() - installed)
    env = {**os.environ, "PYTHONPATH": str(target)}
    result = subprocess.run(
        [sys.executable, "-m", "search", "+space=llm", "--cfg"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "_target_: search.workloads.GPT" in result.stdout
    located = subprocess.run(
        [sys.executable, "-c", "import search.config.compose as c; print(c.SPACES_DIR)"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert Path(located.stdout.strip()).is_relative_to(target)
