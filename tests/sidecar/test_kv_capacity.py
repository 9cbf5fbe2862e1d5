"""The pod's KV capacity per model (pure: `kvoffload_sidecar.capacity`) and the store/load
timer's bookkeeping (`kvoffload_sidecar.transfer_timing`, a manual clock)."""

from __future__ import annotations

from kvoffload_sidecar.capacity import host_tokens, kv_groups, model_capacities
from kvoffload_sidecar.keys import NamespaceSpec
from kvoffload_sidecar.pool import NamespaceStats
from kvoffload_sidecar.transfer_timing import LOAD_METRIC, STORE_METRIC, TransferTimer
from prometheus_client import CollectorRegistry


def _spec(model: str, chunk_blocks: int = 4, groups: str = "full") -> NamespaceSpec:
    return NamespaceSpec(
        model=model,
        dtype="bfloat16",
        kv_layout="LBHNC/packed-kv",
        block_size=16,
        chunk_blocks=chunk_blocks,
        tp_size=1,
        hash_algo="sha256",
        key_size=32,
        extra={"kv_groups": groups} if groups else {},
    )


def _ns(ns_id: str, spec: NamespaceSpec, slots: int, live: int) -> NamespaceStats:
    zero = dict.fromkeys(
        ("committed_slots", "reserved_slots", "pinned_slots", "capacity_bytes", "used_bytes",
         "pinned_bytes", "lookups", "hit_blocks", "miss_blocks", "stored_blocks",
         "loaded_blocks", "evicted_blocks", "stored_bytes", "loaded_bytes"),
        0,
    )  # fmt: skip
    return NamespaceStats(
        namespace_id=ns_id,
        spec=spec,
        num_ranks=1,
        slot_bytes=1,
        slot_count=slots,
        live_clients=live,
        **zero,
    )


def test_host_tokens_count_every_kv_group() -> None:
    assert kv_groups(_spec("m", groups="")) == 1
    assert kv_groups(_spec("m", groups="full:a;sliding:b;")) == 2
    assert host_tokens(_ns("a", _spec("m"), 100, 1)) == 100 * 4 * 16
    assert host_tokens(_ns("a", _spec("m", groups="f;s"), 100, 1)) == 100 * 4 * 16 // 2


def test_capacity_per_model_joins_gpu_entries_and_served_namespaces() -> None:
    namespaces = [
        _ns("new", _spec("llama", chunk_blocks=4), 100, live=1),
        _ns("old", _spec("llama", chunk_blocks=8), 50, live=0),  # left behind: not served
        _ns("idle", _spec("qwen"), 10, live=0),  # between restarts: still counts
    ]
    entries = [
        {"role": "scheduler", "model": "llama", "gpu_kv_tokens": 1000},
        {"role": "worker", "model": "llama", "gpu_kv_tokens": 999},  # workers do not say
        {"role": "scheduler", "model": "gemma", "gpu_kv_tokens": 300},  # no pool namespace yet
        {"role": "scheduler", "model": "qwen"},  # an older connector: no capacity fields
        {"role": "scheduler", "model": "x", "gpu_kv_tokens": True},  # garbage
    ]
    got = {c.model: (c.gpu_tokens, c.host_tokens, c.total_tokens) for c in model_capacities(
        namespaces, entries
    )}  # fmt: skip
    assert got == {
        "gemma": (300, 0, 300),
        "llama": (1000, 100 * 64, 1000 + 6400),
        "qwen": (0, 10 * 64, 640),
    }


def test_transfer_timer_observes_each_store_and_pin_once_and_stays_bounded() -> None:
    now = [0.0]
    registry = CollectorRegistry()
    timer = TransferTimer(registry, "pool_namespace", clock=lambda: now[0], limit=4)

    def count(metric: str, ns: str = "a") -> float:
        value = registry.get_sample_value(f"{metric}_count", {"pool_namespace": ns})
        return value or 0.0

    timer.store_reserved("a", 1)
    timer.store_reserved("a", 0)  # no store id: nothing was reserved
    now[0] = 0.004
    timer.store_visible("a", 1)
    timer.store_visible("a", 1)  # a repeated commit of a visible store
    assert count(STORE_METRIC) == 1
    assert registry.get_sample_value(
        f"{STORE_METRIC}_bucket", {"pool_namespace": "a", "le": "0.005"}
    ) == 1  # fmt: skip
    timer.store_reserved("a", 2)
    timer.store_aborted("a", 2)
    timer.store_visible("a", 2)  # aborted first: never observed
    timer.store_visible("b", 1)  # another namespace's id: unknown
    assert count(STORE_METRIC) == 1 and count(STORE_METRIC, "b") == 0

    timer.pinned("a", 7)
    timer.pinned("a", 8)
    now[0] = 1.0
    timer.released("a", [7, 8, 9])  # 9 was never pinned here
    assert count(LOAD_METRIC) == 2
    # clients that vanish leave entries behind: at most `limit` of each, oldest dropped first
    for i in range(10, 20):
        timer.pinned("a", i)
        timer.store_reserved("a", i)
    assert timer.open_counts() == (4, 4)
    timer.released("a", [10, 19])  # 10 was dropped, 19 is kept
    assert count(LOAD_METRIC) == 3
