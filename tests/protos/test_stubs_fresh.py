"""The generated stubs in protos/gen match protos/ (what `make protos` would write)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GEN = ROOT / "tools" / "gen_protos.py"


def _check(src: Path, out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(GEN), "--check", str(src), str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_checked_in_stubs_are_fresh() -> None:
    result = _check(ROOT / "protos", ROOT / "protos" / "gen")
    assert result.returncode == 0, result.stderr + result.stdout
    assert "up to date" in result.stdout


def test_a_tampered_copy_is_reported_stale(tmp_path: Path) -> None:
    gen = tmp_path / "gen"
    shutil.copytree(ROOT / "protos" / "gen", gen, ignore=shutil.ignore_patterns("__pycache__"))
    stub = gen / "kvoffload" / "v1" / "pool_pb2.py"
    stub.write_text(stub.read_text() + "\n# hand edit\n")
    result = _check(ROOT / "protos", gen)
    assert result.returncode != 0
    assert "stale" in result.stderr
    assert "pool_pb2.py" in result.stderr


def test_an_extra_file_is_reported_stale(tmp_path: Path) -> None:
    gen = tmp_path / "gen"
    shutil.copytree(ROOT / "protos" / "gen", gen, ignore=shutil.ignore_patterns("__pycache__"))
    (gen / "kvoffload" / "v1" / "leftover_pb2.py").write_text("# not generated\n")
    result = _check(ROOT / "protos", gen)
    assert result.returncode != 0
    assert "leftover_pb2.py" in result.stderr
