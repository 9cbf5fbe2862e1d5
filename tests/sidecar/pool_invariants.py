"""`check_invariants(pool)`: the pool's bookkeeping checked whole (tests and fuzzing; O(slots)).

Every namespace's index, free list, withheld slots, policy, tenants, pins, engines and slot
table agree with one another; an AssertionError names the first that does not. Reads the
pool's private state under its lock.
"""

from __future__ import annotations

from kvoffload_sidecar import persist
from kvoffload_sidecar.index import SlotState
from kvoffload_sidecar.keys import PoolKey, split_keys
from kvoffload_sidecar.pool import Pool
from kvoffload_sidecar.pool_state import NamespaceState, slot_list

__all__ = ["check_invariants"]


def check_invariants(pool: Pool) -> None:
    """AssertionError naming the first violated invariant (tests, fuzzing; O(slots))."""
    with pool._lock:
        for i, owner in enumerate(pool._partitions):
            if owner is not None:
                assert pool._namespaces[owner].partition == i, f"partition {i} owner mismatch"
        assert len({ns.partition for ns in pool._namespaces.values()}) == len(pool._namespaces), (
            "two namespaces share a partition"
        )
        for ns in pool._namespaces.values():
            _check_namespace(pool, ns)
        for cid, client in pool._clients.items():
            ns = pool._namespaces.get(client.namespace_id)
            assert ns is not None and cid in ns.clients, f"client {cid} has no namespace"


def _check_namespace(pool: Pool, ns: NamespaceState) -> None:
    nid, index = ns.namespace_id, ns.index
    withheld = set(ns.withheld.tolist())
    assert len(ns.withheld) == len(ns.withheld_owners), f"{nid}: withheld slots' owners"
    try:
        index.check(ns.free.free_slots() | withheld)
    except AssertionError as e:
        raise AssertionError(f"namespace {nid}: {e}") from None
    assert not (withheld & ns.free.free_slots()), f"{nid}: a withheld slot is free"
    for slot in range(max(ns.free.ready, ns.free.fresh), ns.slot_count):
        assert index.state(slot) == SlotState.FREE, f"{nid}: slot {slot} used before ready"
    committed = index.committed_keys()
    if pool._region.intact():
        _check_table(ns, committed)
    pool._apply_touches(ns)
    held = set(ns.policy.keys())
    assert len(held) == len(ns.policy), f"{nid}: policy holds a key twice"
    assert held == committed, (
        f"{nid}: policy holds {len(held)} keys, {len(committed)} are committed"
    )
    if ns.tenants is not None:
        reserved = {k for r in index.stores.values() for k in index._keys_of(r)}
        try:
            ns.tenants.check(reserved)
        except AssertionError as e:
            raise AssertionError(f"namespace {nid}: {e}") from None
    client_pins: set[int] = set()
    for cid in ns.clients:
        client = pool._clients.get(cid)
        assert client is not None and client.namespace_id == nid, f"{nid}: stray client {cid}"
        assert not (client_pins & client.pins), f"{nid}: a pin belongs to two clients"
        client_pins |= client.pins
        for pin_id in client.pins:
            assert index.pin_records[pin_id].client_id == cid, f"{nid}: pin {pin_id} owner"
    assert client_pins == set(index.pin_records), f"{nid}: pins of no live client"
    engine_stores: set[int] = set()
    for key, engine in ns.engines.items():
        assert engine.engine == key, f"{nid}: engine record {key} names {engine.engine}"
        assert not (engine_stores & engine.stores), f"{nid}: a store belongs to two engines"
        engine_stores |= engine.stores
        for store_id in engine.stores:
            assert index.stores[store_id].owner == key, f"{nid}: store {store_id} owner"
    assert engine_stores == set(index.stores), f"{nid}: reserved slots of no known engine"


def _check_table(ns: NamespaceState, committed: set[PoolKey]) -> None:
    """The file's records agree with the index: every committed key has a valid record in
    its slot (more valid records may remain in free slots: evicted, intact blocks); every
    reserved slot is marked reserved."""
    scan = ns.table.scan()
    recorded = dict(
        zip(
            scan.slots.tolist(),
            split_keys(scan.packed, ns.spec.key_size, max_keys=max(1, len(scan.slots))),
            strict=True,
        )
    )
    for key in committed:
        slot = ns.index.find(key)
        assert recorded.get(slot) == key, f"{ns.namespace_id}: slot {slot} has no record"
    for record in ns.index.stores.values():
        for slot in slot_list(record.slots):
            assert ns.table.state[slot] == persist.RESERVED, (
                f"{ns.namespace_id}: reserved slot {slot} is not marked in the file"
            )
