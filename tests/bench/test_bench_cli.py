"""Every registered benchmark starts from its one command, and bench/README.md lists each once.

GPU benchmarks cannot run here; their argument parsing and imports can: `python -m bench NAME
--help` for every name (and every `serve` mode), `bash -n` for every script, and a tiny CPU run
of the index benchmark through the shared harness's JSON.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _registry() -> dict[str, str]:
    spec = importlib.util.spec_from_file_location("bench_main", ROOT / "bench" / "__main__.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.BENCHMARKS


def _bench(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "bench", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_every_name_and_serve_mode_parses_its_help() -> None:
    calls = [(name, "--help") for name in _registry()]
    modes = ("sweep", "paired", "merge", "report", "replicas")
    calls += [("serve", mode, "--help") for mode in modes]
    with ThreadPoolExecutor(max_workers=4) as pool:
        done = dict(zip(calls, pool.map(lambda c: _bench(*c), calls), strict=True))
    for call, proc in done.items():
        assert proc.returncode == 0, (call, proc.stderr[-2000:])
        assert "usage" in proc.stdout.lower() or "python -m bench" in proc.stdout, call
    for mode in ("sweep", "replicas"):  # bench/gpu_run.sh's probe
        assert "--budget-s" in done[("serve", mode, "--help")].stdout


def test_unknown_names_and_modes_are_refused() -> None:
    assert _bench("no_such_benchmark").returncode == 2
    assert _bench("serve", "no_such_mode").returncode == 2
    listing = _bench()
    assert listing.returncode == 0 and all(n in listing.stdout for n in _registry())


def test_the_readme_table_has_one_row_per_benchmark_and_each_script_is_one() -> None:
    readme = (ROOT / "bench" / "README.md").read_text()
    rows = re.findall(r"^\| `([a-z0-9_]+)` \|", readme, flags=re.M)
    assert sorted(rows) == sorted(_registry())
    for name in _registry():
        assert (ROOT / "bench" / f"{name}.py").is_file(), name


def test_every_shell_script_parses() -> None:
    scripts = sorted((ROOT / "bench").glob("*.sh"))
    assert ROOT / "bench" / "gpu_run.sh" in scripts
    for script in scripts:
        subprocess.run(["bash", "-n", str(script)], check=True, timeout=30)


def test_a_tiny_index_run_writes_the_harness_json(tmp_path: Path) -> None:
    out = tmp_path / "index_ops.json"
    args = ("--slots", "4096", "--batch", "64", "--policy", "lru", "--seconds", "0.05")
    proc = _bench("index_ops", *args, "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(out.read_text())
    assert got["benchmark"] and got["machine"]["commit"] and got["rows"]
    assert all(r["block_ops_per_s"] > 0 for r in got["rows"])
