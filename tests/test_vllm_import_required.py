"""A broken vLLM fails the session instead of skipping the engine tests (tests/conftest.py).

pytest runs in a subprocess on a sample folder holding a copy of this suite's conftest.py and
one test marked `vllm`, with `PYTHONPATH` naming a `vllm` package whose import raises: the
session must exit non-zero and name the import error; deselecting the `vllm` tests runs the
rest as before.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.process]

CONFTEST = Path(__file__).resolve().parent / "conftest.py"
BROKEN = "this vllm is broken on purpose"


def _pytest(sample: Path, broken: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(broken))
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *args, str(sample)]
    return subprocess.run(cmd, cwd=sample, env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture
def sample(tmp_path: Path) -> tuple[Path, Path]:
    broken = tmp_path / "site"
    (broken / "vllm").mkdir(parents=True)
    (broken / "vllm" / "__init__.py").write_text(f"raise ImportError({BROKEN!r})\n")
    suite = tmp_path / "suite"
    suite.mkdir()
    shutil.copyfile(CONFTEST, suite / "conftest.py")
    (suite / "pytest.ini").write_text(
        "[pytest]\naddopts = --strict-markers\nmarkers =\n    vllm: runs a real vLLM engine\n"
    )
    (suite / "test_sample.py").write_text(
        "import pytest\n\n\n"
        "@pytest.mark.vllm\ndef test_engine():\n    pass\n\n\n"
        "def test_plain():\n    pass\n"
    )
    return suite, broken


def test_the_session_fails_naming_the_import_error(sample):
    suite, broken = sample
    proc = _pytest(suite, broken)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "1 selected tests are marked `vllm`" in out, out
    assert "vLLM does not import" in out, out
    assert f"ImportError: {BROKEN}" in out, out  # the import's own traceback
    assert "passed" not in out and "skipped" not in out, out  # nothing ran, nothing skipped


def test_tests_not_marked_vllm_still_run_without_it(sample):
    suite, broken = sample
    proc = _pytest(suite, broken, "-m", "not vllm")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "1 passed, 1 deselected" in out, out
