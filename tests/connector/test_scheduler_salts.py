"""The connector passes each request's vLLM `cache_salt` to the sidecar (per-tenant quotas).

Lookups carry one salt per query (the lookup-and-pin round, hybrid lookups too); a store batch
mixes requests, so it carries one salt per key; lazy stores keep the salt of the finished
request. Requests without a salt send none (old sidecars and unsalted traffic look the same).
The same scheduler stand-ins as test_scheduler.py; `kvoffload_connector.common.client.key_salts`
is the wire packing, checked against the sidecar's decoder.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvoffload_connector.common.client import key_salts
from kvoffload_sidecar.tenants import KeySalts, TenantPolicy, parse_tenants

from tests.connector.test_scheduler import Request, SchedOut, ask, make, settle


@dataclass
class SaltedRequest(Request):
    cache_salt: str | None = None


def test_lookups_carry_each_requests_salt() -> None:
    s, fake, *_ = make()
    reqs = [
        SaltedRequest("r0", list(range(0, 300)), cache_salt="a"),
        SaltedRequest("r1", list(range(1, 301))),
        SaltedRequest("r2", list(range(2, 302)), cache_salt="b"),
    ]
    for r in reqs:
        assert s.get_num_new_matched_tokens(r, 0) == (None, False)
    s.build_connector_meta(SchedOut({}))
    settle(s)
    assert fake.salts == [("lookup_pin", ["a", None, "b"])]  # one per query (one group)


def test_unsalted_lookups_send_no_salts() -> None:
    s, fake, *_ = make()
    ask(s, SaltedRequest("r0", list(range(300))))
    assert fake.salts == [("lookup_pin", None)]


def test_hybrid_lookups_carry_the_salt_of_every_query() -> None:
    s, fake, *_ = make(groups=2, windows=[0, 64])
    s.get_num_new_matched_tokens(SaltedRequest("r0", list(range(300)), cache_salt="a"), 0)
    s.get_num_new_matched_tokens(SaltedRequest("r1", list(range(1, 301))), 0)
    s.build_connector_meta(SchedOut({}))
    settle(s)
    ((call, salts),) = [c for c in fake.salts if c[0] == "lookup"]
    # per request: the full group's prefix, then each chunk of the sliding group's window
    n = len(salts) // 2
    assert n >= 2 and salts == ["a"] * n + [None] * n


def test_a_store_batch_carries_one_salt_per_key() -> None:
    s, fake, bp, mgr = make()
    a = SaltedRequest("a", list(range(200)), cache_salt="tenant-a")
    b = SaltedRequest("b", list(range(1000, 1130)))
    for r in (a, b):
        ask(s, r)
    mgr.req_blocks["a"], mgr.req_blocks["b"] = [bp.allocate(7)], [bp.allocate(5)]
    s.build_connector_meta(SchedOut({"a": 200, "b": 130}))  # 3 chunks of a, 2 of b
    settle(s)
    assert [c for c in fake.salts if c[0] == "reserve_store"] == [
        ("reserve_store", ["tenant-a"] * 3 + [None] * 2)
    ]


def test_lazy_stores_keep_the_salt_of_the_finished_request() -> None:
    s, fake, bp, mgr = make(mode="lazy", nblocks=40)
    s._stores.lazy_watermark = 4
    req = SaltedRequest("r", list(range(130)), cache_salt="a")
    ask(s, req)
    blocks = bp.allocate(5)
    mgr.req_blocks["r"] = [blocks]
    for b, h in zip(blocks, req.block_hashes, strict=False):
        b.block_hash = h
    s.build_connector_meta(SchedOut({"r": 130}))
    s.request_finished(req, ([b.block_id for b in blocks],))
    for b in blocks:
        bp.free_blocks([b])
    bp.allocate(len(bp.free_block_queue.items) - 5)  # they are next to be evicted
    s.build_connector_meta(SchedOut({}))
    settle(s)
    assert [c for c in fake.salts if c[0] == "reserve_store"] == [("reserve_store", ["a", "a"])]


def test_the_wire_packing_is_what_the_sidecar_decodes() -> None:
    policy = TenantPolicy(
        parse_tenants('[{"name": "t", "cacheSalts": ["s7"]}]'), "lru", slot_count=10
    )
    names, per_key = key_salts(["s1", None, "s1", "s7"])
    assert (names, per_key) == (["s1", "s7"], bytes([1, 0, 1, 2]))
    t, default = 0, policy.default
    assert policy.key_tenants(KeySalts(tuple(names), per_key), 4) == [default] * 3 + [t]
    many = [f"s{i}" for i in range(300)]  # past 255 salts: two bytes per key
    names, per_key = key_salts([*many, None])
    assert len(per_key) == 2 * 301 and per_key[-2:] == b"\x00\x00"
    owners = policy.key_tenants(KeySalts(tuple(names), per_key), 301)
    assert owners[7] == t and owners.count(default) == 300
