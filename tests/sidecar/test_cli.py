"""`kvoffload sidecar` settings errors and `kvoffload stats` against a real sidecar process."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvoffload_sidecar.cli import main_stats
from procs import (
    Client,
    SidecarProc,
    health_status,
    keys,
    kvoffload_command,
    sidecar_process,
    socket_dir,
)

pytestmark = [pytest.mark.process, pytest.mark.timeout(120)]


def _kvoffload(
    *args: str, env: dict[str, str] | None = None, timeout: float = 30
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*kvoffload_command(), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={**os.environ, **(env or {})},
    )


@pytest.fixture(scope="module")
def busy_sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SidecarProc, str]]:
    """One sidecar with a namespace that has seen stores, lookups (hits and misses) and loads."""
    with (
        socket_dir() as sock_dir,
        sidecar_process(
            tmp_path_factory.mktemp("pool"),
            sock_dir,
            "--metrics-listen",
            "127.0.0.1:0",
            "--listen",
            "127.0.0.1:0",
        ) as proc,
        Client(proc.target) as client,
    ):
        client.register()
        client.store(keys(1, 2, 3))
        client.lookup(keys(1, 2, 3), keys(1, 9))
        client.release(client.reserve_load(keys(1, 2)).pin_id)
        yield proc, client.namespace_id


def test_stats_table(busy_sidecar: tuple[SidecarProc, str]) -> None:
    proc, namespace_id = busy_sidecar
    done = _kvoffload("stats", "--socket", str(proc.socket))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("pool: 16.0 MiB, pre-faulted 100% (ready), eviction lru")
    header = next(line for line in lines if line.startswith("namespace"))
    assert header.split() == [
        "namespace",
        "model",
        "ranks",
        "slots",
        "capacity",
        "used",
        "tokens",
        "pinned",
        "hit",
        "ratio",
        "lookups",
        "stores",
        "loads",
        "evictions",
        "stored",
        "loaded",
        "clients",
    ]
    row = next(line for line in lines if line.startswith(namespace_id[:12]))
    # 3 + 1 hit blocks, 1 miss block -> 80 %; 2 lookups, 3 stores, 2 loads, 0 evictions
    # 16 MiB of 64 KiB slots: 255, the last one's room holds the pool's index
    assert row.split()[1:4] == ["tiny-llama", "1", "255"]
    assert "80.0%" in row
    assert row.split()[-9:-5] == ["2", "3", "2", "0"]  # sizes after them are two tokens each
    # tokens used/capacity, after capacity and used (two words each): 3 of 255 slots
    used_tokens, capacity_tokens = map(int, row.split()[8].split("/"))
    assert capacity_tokens > 0 and capacity_tokens % 255 == 0
    assert used_tokens == 3 * capacity_tokens // 255
    assert not any(line.startswith("placement node") for line in lines)  # a pod's own pool
    methods = {line.split()[0] for line in lines if line.split() and line.split()[0][:1].isupper()}
    assert {
        "Register",
        "ReserveStore",
        "CommitStore",
        "Lookup",
        "ReserveLoad",
        "Release",
    } <= methods


def test_stats_json(
    busy_sidecar: tuple[SidecarProc, str], capsys: pytest.CaptureFixture[str]
) -> None:
    proc, namespace_id = busy_sidecar
    assert main_stats(["--socket", str(proc.socket), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["pool_bytes"] == 16 << 20 and data["pool_ready"] is True
    assert data["placement"] == "pod" and data["shared"]["pool_id"] == ""  # not shared
    (ns,) = data["namespaces"]
    assert ns["namespace_id"] == namespace_id
    assert ns["spec"]["model"] == "tiny-llama" and ns["spec"]["extra"] == {}
    assert (ns["stored_blocks"], ns["hit_blocks"], ns["miss_blocks"], ns["loaded_blocks"]) == (
        3,
        4,
        1,
        2,
    )
    latency = {entry["method"]: entry for entry in data["rpc_latency"]}
    assert latency["Lookup"]["count"] == 1
    assert 0 < latency["Lookup"]["p50_seconds"] <= latency["Lookup"]["p99_seconds"]


def test_metrics_and_tcp_listeners_of_the_process(busy_sidecar: tuple[SidecarProc, str]) -> None:
    proc, namespace_id = busy_sidecar
    log = proc.stderr()
    metrics_port = re.search(r"metrics on http://127\.0\.0\.1:(\d+)/metrics", log)
    tcp_port = re.search(r"health\+Stats on TCP port (\d+)", log)
    assert metrics_port and tcp_port, log
    url = f"http://127.0.0.1:{metrics_port.group(1)}/metrics"
    with urllib.request.urlopen(url, timeout=5) as resp:
        body = resp.read().decode()
    assert f'kvoffload_stored_blocks_total{{pool_namespace="{namespace_id}"}} 3.0' in body
    assert 'kvoffload_rpc_duration_seconds_bucket{le="0.001",method="ReserveStore"}' in body
    assert health_status(f"127.0.0.1:{tcp_port.group(1)}") == 1  # SERVING
    assert main_stats(["--address", f"127.0.0.1:{tcp_port.group(1)}", "--json"]) == 0


def test_stats_without_a_socket_fails_clearly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main_stats(["--socket", str(tmp_path / "absent.sock")]) == 1
    assert "no sidecar socket at" in capsys.readouterr().err


def test_stats_on_a_dead_socket_fails_within_the_deadline(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with socket_dir() as sock_dir:
        path = sock_dir / "dead.sock"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(path))
        listener.close()  # the file exists, nobody serves
        start = time.monotonic()
        assert main_stats(["--socket", str(path), "--timeout", "1"]) == 1
        assert time.monotonic() - start < 3.0
    err = capsys.readouterr().err
    assert "is not serving (UNAVAILABLE" in err
    assert err.count("\n") == 1


@pytest.mark.parametrize(
    ("args", "env", "expected"),
    [
        (
            ["--pool-size", "lots"],
            {},
            "--pool-size (env KVOFFLOAD_POOL_SIZE, here from --pool-size): 'lots' is not a size",
        ),
        (
            [],
            {"KVOFFLOAD_POOL_SIZE": "0"},
            "here from KVOFFLOAD_POOL_SIZE): '0' must be greater than zero",
        ),
        (["--pool-size", "1Mi", "--numa-node", "x"], {}, "--numa-node"),
    ],
)
def test_bad_setting_exits_2_with_one_line(
    tmp_path: Path, args: list[str], env: dict[str, str], expected: str
) -> None:
    base = ["sidecar", "--pool-dir", str(tmp_path), "--socket", str(tmp_path / "s.sock")]
    done = _kvoffload(*base, *args, env={"KVOFFLOAD_POOL_SIZE": "", **env})
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.count("\n") == 1, done.stderr
    assert expected in done.stderr
    assert not (tmp_path / "s.sock").exists()


def test_stats_says_what_the_start_did_with_the_pool_file() -> None:
    from kvoffload.v1 import pool_pb2 as pb
    from kvoffload_sidecar.cli import format_stats

    resp = pb.StatsResponse(pool_bytes=1 << 30, prefaulted_bytes=1 << 30, pool_ready=True)
    assert "adoption" not in format_stats(resp)  # a new pool: nothing to say
    resp.adoption.outcome = "adopted"
    resp.adoption.adopted_blocks = 1234
    resp.adoption.adopted_namespaces = 1
    resp.adoption.adopt_seconds = 0.012
    resp.adoption.boots = 3
    resp.adoption.discarded_blocks["reserved"] = 2
    resp.adoption.discarded_blocks["torn"] = 1
    line = format_stats(resp).splitlines()[1]
    assert line == (
        "adoption: adopted 1234 blocks in 1 namespace(s) in 0.012s "
        "(boot 3; not adopted: 2 reserved, 1 torn)"
    )
    resp.adoption.outcome = "discarded"
    resp.adoption.reason = "pool format v2 is newer than this sidecar reads (v1)"
    assert format_stats(resp).splitlines()[1] == (
        "adoption: discarded the pool file's contents: "
        "pool format v2 is newer than this sidecar reads (v1)"
    )
