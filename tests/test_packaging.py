"""A non-editable install carries conf/ and spaces/ and runs from anywhere."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


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
