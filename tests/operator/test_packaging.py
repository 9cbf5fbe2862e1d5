"""A plain `pip install kvoffload` (no extras) in a fresh venv: `kvoffload inject` works, and
`kvoffload operator` names the missing extra in one line instead of a traceback."""

from __future__ import annotations

import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from tests.operator.golden import IMAGE_ARGS, cases

ROOT = Path(__file__).parents[2]
SOURCES = ("pyproject.toml", "README.md", "cli", "sidecar", "connector", "operator", "protos/gen")


@pytest.fixture(scope="module")
def base_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real venv with only the base install (what the images' build stage does, no extras)."""
    tmp = tmp_path_factory.mktemp("pkg")
    src = tmp / "src"
    for name in SOURCES:  # a copy: building in the shared checkout would write build/ into it
        if (ROOT / name).is_dir():
            shutil.copytree(
                ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.so")
            )
        else:
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(ROOT / name, src / name)
    env_dir = tmp / "venv"
    base = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else sys.executable
    subprocess.run([base, "-m", "venv", str(env_dir)], check=True)
    if not (env_dir / "bin" / "pip").exists():  # pragma: no cover - venv without ensurepip
        venv.create(env_dir, with_pip=True)
    res = subprocess.run(
        [str(env_dir / "bin" / "pip"), "install", "-q", str(src)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return env_dir


@pytest.mark.process
def test_inject_runs_from_the_base_install(base_venv: Path) -> None:
    py = base_venv / "bin" / "python"
    for mod in ("kopf", "kubernetes", "cryptography"):  # really absent: the check means something
        probe = subprocess.run([str(py), "-c", f"import {mod}"], capture_output=True)
        assert probe.returncode != 0, f"{mod} is installed in the base venv"
    case = next(c for c in cases() if c.name == "deployment-command")
    res = subprocess.run(
        [
            str(base_venv / "bin" / "kvoffload"),
            "inject",
            "-f",
            str(case.input),
            "--policy",
            str(case.policy_file),
            *IMAGE_ARGS,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout == case.golden.read_text()


@pytest.mark.process
def test_operator_without_the_extra_says_so_in_one_line(base_venv: Path) -> None:
    res = subprocess.run(
        [str(base_venv / "bin" / "kvoffload"), "operator"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 1
    assert res.stdout == ""
    lines = res.stderr.splitlines()
    assert len(lines) == 1, res.stderr
    assert "pip install 'kvoffload[operator]'" in lines[0] and "Traceback" not in res.stderr
