"""Stats relays the connectors' status files (connector-status-*.json beside the socket), so
`kvoffload stats` shows in one place why a vLLM process serves without the pool."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from procs import Client, kvoffload_command, sidecar_process, socket_dir

pytestmark = [pytest.mark.process, pytest.mark.timeout(60)]

SCHEDULER = {
    "state": "disabled",
    "reason": "vLLM 0.99.0 is outside the supported range",
    "role": "scheduler",
    "rank": 0,
    "vllm_version": "0.99.0",
    "pid": 41,
    "time": 1764100000.0,
}
WORKER = {
    "state": "active",
    "reason": "",
    "role": "worker",
    "rank": 1,
    "vllm_version": "0.32.0",
    "pid": 42,
    "time": 1764100001.0,
}


def _stats_lines(socket: Path) -> list[str]:
    """`kvoffload stats` as an operator runs it, line by line (it must succeed)."""
    shown = subprocess.run(
        [*kvoffload_command(), "stats", "--socket", str(socket)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert shown.returncode == 0, shown.stderr
    return shown.stdout.splitlines()


def test_stats_carries_the_parsed_status_files_and_skips_garbage(tmp_path: Path) -> None:
    with socket_dir() as run, sidecar_process(tmp_path, run) as proc, Client(proc.target) as c:
        assert json.loads(c.stats().connector_status) == []
        (run / "connector-status-41.json").write_text(json.dumps(SCHEDULER))
        (run / "connector-status-42.json").write_text(json.dumps(WORKER))
        (run / "connector-status-43.json").write_text('{"state": "act')  # mid-write
        (run / "connector-status-44.json").write_text("[1, 2]")  # not an object
        (run / "connector-status-45.json").mkdir()  # unreadable
        (run / "other.json").write_text(json.dumps(WORKER))  # not a status file
        assert json.loads(c.stats().connector_status) == [SCHEDULER, WORKER]
        lines = _stats_lines(proc.socket)
    assert lines[0].startswith("pool: "), lines
    assert lines[1:3] == [
        "connector scheduler rank 0: disabled: vLLM 0.99.0 is outside the supported range",
        "connector worker rank 1: active",
    ]


def test_stats_shows_the_notes_of_an_active_connector(tmp_path: Path) -> None:
    """An active scheduler that serves under a limit (a restarted engine will not find what it
    stored) says so beside its state; a notes field of the wrong type shows nothing."""
    note = "PYTHONHASHSEED is unset and this vLLM seeds its sha256 block hashes per process"
    active = {**SCHEDULER, "state": "active", "reason": "", "notes": [note, 7]}
    odd = {**WORKER, "notes": "not a list"}
    with socket_dir() as run, sidecar_process(tmp_path, run) as proc:
        (run / "connector-status-41.json").write_text(json.dumps(active))
        (run / "connector-status-42.json").write_text(json.dumps(odd))
        lines = _stats_lines(proc.socket)
    assert lines[1:3] == [
        f"connector scheduler rank 0: active (note: {note})",
        "connector worker rank 1: active",
    ]
