"""Per-tenant quotas (`--tenants`, tenants.py) through the Pool domain API (no gRPC).

Geometry: an 8 MiB pool of 256 KiB slots (tp 1): 32 slots in one namespace. Tenants are named
by the cache salts their keys carry (`KeySalts`); keys of tenant X here are ints X*1000 + i.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from fractions import Fraction

import pytest
from kvoffload_sidecar.errors import InvalidArgument
from kvoffload_sidecar.pool import Pool, Registration, StoreDecision
from kvoffload_sidecar.tenants import (
    DEFAULT_TENANT,
    KeySalts,
    TenantConfig,
    TenantsConfig,
    parse_share,
    parse_tenants,
)
from pool_invariants import check_invariants

from tests.sidecar.conftest import INDEX_ROOM

KiB, MiB = 1 << 10, 1 << 20
SLOT = 256 * KiB
SLOTS = 32
NEW, PRESENT, NO_SPACE = StoreDecision.NEW, StoreDecision.PRESENT, StoreDecision.NO_SPACE


def pack(ints: Sequence[int]) -> bytes:
    return b"".join(i.to_bytes(8, "big") for i in ints)


def tenants(*entries: dict) -> TenantsConfig:
    import json

    return parse_tenants(json.dumps(list(entries)))


def salted(salt: str | None, n: int) -> KeySalts | None:
    return None if salt is None else KeySalts((salt,), b"\x01" * n)


class Tenancy:
    """A started pool with tenants and one registered client, plus the calls the tests make."""

    def __init__(self, pool: Pool, reg: Registration) -> None:
        self.pool, self.reg = pool, reg
        self.ns = reg.namespace_id

    def reserve(self, salt: str | None, ints: Sequence[int]):
        return self.pool.reserve_store(
            self.ns, self.reg.client_id, pack(ints), salts=salted(salt, len(ints))
        )

    def store(self, salt: str | None, ints: Sequence[int]) -> tuple[StoreDecision, ...]:
        res = self.reserve(salt, ints)
        if res.store_id:
            assert self.pool.commit_store(self.ns, res.store_id, 0)
        return res.decisions

    def present(self, ints: Sequence[int]) -> list[int]:
        """The keys still in the pool (one lookup per key, counted as the default tenant's)."""
        found = self.pool.lookup(self.ns, [pack([i]) for i in ints])
        return [i for i, hit in zip(ints, found, strict=True) if hit]

    def tenant(self, name: str):
        (ns,) = self.pool.stats().namespaces
        (t,) = [t for t in ns.tenants if t.name == name]
        return t

    def used(self) -> dict[str, int]:
        (ns,) = self.pool.stats().namespaces
        return {t.name: t.used_slots for t in ns.tenants}


@pytest.fixture(params=["lru", "arc"])
def eviction(request) -> str:
    return request.param


@pytest.fixture
def make_tenancy(make_pool, small_spec, eviction):
    def make(config: TenantsConfig, **settings) -> Tenancy:
        pool = make_pool(
            pool_size=SLOTS * SLOT + INDEX_ROOM,
            eviction=eviction,
            tenants=config,
            detach_grace_s=0.0,
            **settings,
        )
        reg = pool.register(small_spec(), 1, SLOT, "engine-0/scheduler")
        assert reg.regions[0].slot_count == SLOTS
        return Tenancy(pool, reg)

    return make


A_AND_B = [
    {"name": "a", "cacheSalts": ["a"], "guaranteed": "25%", "max": "50%"},
    {"name": "b", "cacheSalts": ["b", "b2"], "guaranteed": "0%", "max": "100%"},
]


# -- the flag ------------------------------------------------------------------------------------


def test_parse_reads_shares_salts_and_a_default_entry() -> None:
    config = tenants(*A_AND_B, {"name": "default", "guaranteed": 0.1, "max": "12.5%"})
    assert config.names == ("a", "b", DEFAULT_TENANT)
    a, b, default = config.tenants
    assert a == TenantConfig("a", ("a",), Fraction(1, 4), Fraction(1, 2))
    assert b.cache_salts == ("b", "b2") and b.max == 1
    assert (default.guaranteed, default.max) == (Fraction(1, 10), Fraction(1, 8))
    assert a.slots(SLOTS) == (8, 16) and default.slots(SLOTS) == (3, 4)
    assert parse_tenants(config.to_json()) == config  # what the log line prints parses back
    assert tenants(*A_AND_B).tenants[-1] == TenantConfig(DEFAULT_TENANT)  # 0%..100%


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{", "not JSON"),
        ('{"name": "a"}', "expected a JSON list"),
        ('[{"name": "A", "cacheSalts": ["x"]}]', "must be 1-63 lowercase"),
        ('[{"name": "a", "cacheSalts": ["x"]}, {"name": "a", "cacheSalts": ["y"]}]', "repeats"),
        (
            '[{"name": "a", "cacheSalts": ["x"]}, {"name": "b", "cacheSalts": ["x"]}]',
            "cache salt 'x' already names tenant 'a'",
        ),
        ('[{"name": "default", "cacheSalts": ["x"]}]', "the default tenant has no cacheSalts"),
        ('[{"name": "a"}]', "cacheSalts is required"),
        ('[{"name": "a", "cacheSalts": [""]}]', "non-empty strings"),
        ('[{"name": "a", "cacheSalts": ["x"], "guaranteed": "60%", "max": "50%"}]', "above max"),
        (
            '[{"name": "a", "cacheSalts": ["x"], "guaranteed": "60%"}, '
            '{"name": "default", "guaranteed": "50%"}]',
            "the guarantees add up to 110%",
        ),
        ('[{"name": "a", "cacheSalts": ["x"], "max": "50"}]', "is not a percentage"),
        ('[{"name": "a", "cacheSalts": ["x"], "max": "150%"}]', "outside 0%..100%"),
        ('[{"name": "a", "cacheSalts": ["x"], "max": true}]', "is not a percentage"),
        ('[{"name": "a", "cacheSalts": ["x"], "share": "5%"}]', "unknown field(s) ['share']"),
    ],
)
def test_parse_rejects_bad_input_naming_the_problem(text: str, message: str) -> None:
    with pytest.raises(ValueError) as exc:
        parse_tenants(text)
    assert message in str(exc.value)


def test_parse_share_is_exact() -> None:
    assert parse_share("33.3333%", "x") == Fraction(333333, 1000000)
    assert parse_share(0.29, "x") * 100 == 29  # no float rounding: 29% of 100 slots is 29


# -- the rules -----------------------------------------------------------------------------------


def test_a_flood_never_pushes_a_tenant_below_its_guarantee(make_tenancy) -> None:
    t = make_tenancy(tenants(*A_AND_B))
    a_keys = list(range(1000, 1008))  # exactly a's guarantee (25% of 32)
    assert t.store("a", a_keys) == (NEW,) * 8
    for round_ in range(10):  # b stores 10x the pool, distinct keys, in batches
        decisions = t.store("b", [2000 + round_ * 32 + i for i in range(32)])
        assert decisions.count(NEW) == 24  # b fills all but a's guarantee, replacing its own
    assert t.present(a_keys) == a_keys
    assert t.used() == {"a": 8, "b": 24, DEFAULT_TENANT: 0}
    assert t.tenant("a").evicted_blocks == 0 and t.tenant("b").evicted_blocks == 10 * 24 - 24
    check_invariants(t.pool)


def test_above_its_guarantee_a_tenant_loses_its_oldest_blocks_first(make_tenancy) -> None:
    t = make_tenancy(tenants(*A_AND_B))
    a_keys = list(range(1000, 1016))  # a at its max (16), 8 above its guarantee
    t.store("a", a_keys)
    t.present(a_keys[:4])  # a's first four are hit again: now a's newest
    t.store("b", list(range(2000, 2032)))  # b wants the whole pool
    assert t.used()["a"] == 8  # pushed down to its guarantee, not below
    assert t.present(a_keys) == a_keys[:4] + a_keys[12:]  # the hit ones and the newest kept
    check_invariants(t.pool)


def test_at_its_max_a_tenant_replaces_only_its_own_blocks(make_tenancy) -> None:
    t = make_tenancy(tenants(*A_AND_B))
    t.store("b", list(range(2000, 2008)))
    first = list(range(1000, 1016))
    assert t.store("a", first) == (NEW,) * 16  # up to its max (50%)
    later = list(range(1100, 1104))
    assert t.store("a", later) == (NEW,) * 4  # free slots remain, yet a replaces its own
    assert t.used() == {"a": 16, "b": 8, DEFAULT_TENANT: 0}
    assert t.present(first) == first[4:]  # its four oldest went
    assert t.present(list(range(2000, 2008))) == list(range(2000, 2008))
    assert t.pool.stats().namespaces[0].used_bytes == 24 * SLOT  # 8 slots still free
    check_invariants(t.pool)


def test_victims_come_oldest_first_across_tenants_above_their_guarantee(make_tenancy) -> None:
    config = tenants(
        {"name": "a", "cacheSalts": ["a"]},
        {"name": "b", "cacheSalts": ["b"]},
        {"name": "c", "cacheSalts": ["c"]},
    )
    t = make_tenancy(config)
    a_keys, b_keys = list(range(1000, 1016)), list(range(2000, 2016))
    t.store("a", a_keys)
    t.store("b", b_keys)  # the pool is full: a's blocks are the oldest
    assert t.store("c", [3000, 3001, 3002, 3003]) == (NEW,) * 4
    assert t.present(a_keys) == a_keys[4:]  # a lost its 4 oldest, b nothing
    t.present(a_keys[4:])  # a's blocks are hit: b's are the oldest now
    t.store("c", [3004, 3005])
    assert t.present(b_keys) == b_keys[2:]
    check_invariants(t.pool)


def test_no_space_when_every_other_tenant_is_at_its_guarantee(make_tenancy) -> None:
    config = tenants(
        {"name": "a", "cacheSalts": ["a"], "guaranteed": "50%"},
        {"name": "b", "cacheSalts": ["b"], "guaranteed": "50%"},
    )
    t = make_tenancy(config)
    t.store("a", list(range(1000, 1016)))
    t.store("b", list(range(2000, 2016)))
    assert t.store(None, [5, 6]) == (NO_SPACE, NO_SPACE)  # the default tenant: nothing to take
    assert t.store("zzz", [7]) == (NO_SPACE,)  # an unknown salt is the default tenant
    assert t.store("a", [1100, 1101]) == (NEW, NEW)  # a may replace its own
    assert t.used() == {"a": 16, "b": 16, DEFAULT_TENANT: 0}
    check_invariants(t.pool)


def test_pinned_blocks_are_never_victims(make_tenancy) -> None:
    config = tenants({"name": "a", "cacheSalts": ["a"], "max": "25%"})
    t = make_tenancy(config)
    a_keys = list(range(1000, 1008))
    t.store("a", a_keys)
    pin = t.pool.reserve_load(t.ns, t.reg.client_id, pack(a_keys))
    assert len(pin.slots) == 8
    assert t.store("a", [1100]) == (NO_SPACE,)  # at its max, and every block of its is pinned
    t.pool.release(t.ns, t.reg.client_id, [pin.pin_id])
    assert t.store("a", [1100]) == (NEW,)
    check_invariants(t.pool)


def test_one_batch_carries_keys_of_several_tenants(make_tenancy) -> None:
    t = make_tenancy(tenants(*A_AND_B))
    t.store("a", list(range(1000, 1014)))  # a: 14 of its 16
    keys = [1100, 1101, 1102, 2000, 5, 2001, 1000]  # 3 a, 2 b, 1 default, 1 present
    salts = KeySalts(("a", "b2"), bytes([1, 1, 1, 2, 0, 2, 1]))
    res = t.pool.reserve_store(t.ns, t.reg.client_id, pack(keys), salts=salts)
    # a has room for 2 more under its max: for the third it replaces its oldest block that
    # the batch does not name (1000 is named, so 1001 goes)
    assert res.decisions == (NEW, NEW, NEW, NEW, NEW, NEW, PRESENT)
    assert t.used() == {"a": 16, "b": 2, DEFAULT_TENANT: 1}
    assert t.tenant("a").evicted_blocks == 1  # a replaced one of its own (not 1000: requested)
    assert t.present([1000, 1001]) == [1000]
    t.pool.commit_store(t.ns, res.store_id, 0)
    assert t.used() == {"a": 16, "b": 2, DEFAULT_TENANT: 1}
    assert (t.tenant("a").stored_blocks, t.tenant("b").stored_blocks) == (17, 2)
    check_invariants(t.pool)


def test_two_bytes_per_key_when_a_batch_names_many_salts(make_tenancy) -> None:
    t = make_tenancy(tenants(*A_AND_B))
    names = tuple(f"s{i}" for i in range(299)) + ("b",)  # "b" is salt 300
    per_key = (300).to_bytes(2, "little") + (0).to_bytes(2, "little")
    res = t.pool.reserve_store(
        t.ns, t.reg.client_id, pack([2000, 7]), salts=KeySalts(names, per_key)
    )
    assert res.decisions == (NEW, NEW)
    assert t.used() == {"a": 0, "b": 1, DEFAULT_TENANT: 1}


@pytest.mark.parametrize(
    ("salts", "message"),
    [
        (KeySalts(("a",), b"\x01"), "key_salts has 1 bytes for 2 keys"),
        (KeySalts(("a",), b"\x01\x02"), "names salt 2 but the batch has 1 cache_salts"),
    ],
)
def test_malformed_key_salts_are_invalid_arguments(make_tenancy, salts, message) -> None:
    t = make_tenancy(tenants(*A_AND_B))
    with pytest.raises(InvalidArgument) as exc:
        t.pool.reserve_store(t.ns, t.reg.client_id, pack([1, 2]), salts=salts)
    assert message in str(exc.value)
    assert t.used() == {"a": 0, "b": 0, DEFAULT_TENANT: 0}


def test_aborted_and_abandoned_reservations_give_their_quota_back(make_tenancy) -> None:
    t = make_tenancy(tenants(*A_AND_B))
    res = t.reserve("a", list(range(1000, 1010)))
    assert t.used()["a"] == 10  # reserved counts against the max at once
    t.pool.abort_store(t.ns, res.store_id)
    assert t.used()["a"] == 0
    other = t.pool.register(t.pool.stats().namespaces[0].spec, 1, SLOT, "engine-1/scheduler")
    t.pool.reserve_store(t.ns, other.client_id, pack([1100, 1101]), salts=salted("a", 2))
    assert t.used()["a"] == 2
    t.pool.attach(other.client_id)
    t.pool.detach(other.client_id)  # its session ended: the engine's reservations stay
    assert t.used()["a"] == 2
    t.pool.locks.kill(other.engine)  # every rank of the engine exited
    t.pool.reclaim_dead_engines()
    assert t.used()["a"] == 0
    check_invariants(t.pool)


def test_lookups_count_for_the_tenant_of_their_salt(make_tenancy) -> None:
    t = make_tenancy(tenants(*A_AND_B))
    t.store("a", [1000, 1001])
    assert t.pool.lookup(t.ns, [pack([1000, 1001, 1002]), pack([9])], ["a", "b2"]) == [2, 0]
    pin = t.pool.reserve_load(
        t.ns, t.reg.client_id, pack([1000, 1001]), count_lookup=True, cache_salt="a"
    )
    t.pool.release(t.ns, t.reg.client_id, [pin.pin_id])
    t.pool.lookup(t.ns, [pack([1000])])  # no salt: the default tenant
    a, b, d = (t.tenant(n) for n in ("a", "b", DEFAULT_TENANT))
    assert (a.lookups, a.hit_blocks, a.miss_blocks, a.queried_blocks) == (2, 4, 1, 5)
    assert (b.lookups, b.hit_blocks, b.miss_blocks, b.queried_blocks) == (1, 0, 1, 1)
    assert (d.lookups, d.hit_blocks) == (1, 1)


def test_adopted_blocks_go_back_to_the_tenant_that_stored_them(
    make_tenancy, make_pool, small_spec
) -> None:
    """The commit record keeps the tenant (persist.py): after a restart under the same
    --tenants, a's blocks are a's again, its guarantee protects them, and hits keep them."""
    t = make_tenancy(tenants(*A_AND_B))
    t.store("a", list(range(1000, 1008)))
    t.store("b2", list(range(2000, 2004)))
    t.store(None, list(range(3000, 3002)))
    t.present([1000, 1001])  # hits rewrite the last-use word: the tenant must stay
    t.pool.close()  # the file stays: the next pool adopts its blocks
    again = make_pool(
        pool_size=SLOTS * SLOT + INDEX_ROOM, tenants=tenants(*A_AND_B), detach_grace_s=0.0
    )
    assert again.adoption.outcome == "adopted"
    reg = again.register(small_spec(), 1, SLOT, "engine-0/scheduler")
    u = Tenancy(again, reg)
    assert u.used() == {"a": 8, "b": 4, DEFAULT_TENANT: 2}
    assert u.present(list(range(1000, 1008))) == list(range(1000, 1008))
    u.store("b", list(range(4000, 4032)))  # b may take all but a's guarantee (8 of 32)
    assert u.used() == {"a": 8, "b": 24, DEFAULT_TENANT: 0}
    check_invariants(again)


def test_adopted_blocks_under_other_tenant_names_or_none_are_the_defaults(
    make_pool, small_spec
) -> None:
    """The header records which tenant names the codes index: a file written without
    --tenants, or under other names, adopts as the default tenant's (never another tenant's),
    and a changed share alone keeps them."""

    def boot(config: TenantsConfig | None) -> Tenancy:
        pool = make_pool(pool_size=SLOTS * SLOT + INDEX_ROOM, tenants=config, detach_grace_s=0.0)
        return Tenancy(pool, pool.register(small_spec(), 1, SLOT, "engine-0/scheduler"))

    plain = boot(None)
    plain.store(None, list(range(5000, 5003)))
    plain.pool.close()
    t = boot(tenants(*A_AND_B))
    assert t.used() == {"a": 0, "b": 0, DEFAULT_TENANT: 3}
    t.store("b2", list(range(6000, 6002)))
    t.pool.close()
    wider = [dict(A_AND_B[0], max="75%"), A_AND_B[1]]  # shares changed, names the same
    u = boot(tenants(*wider))
    assert u.used() == {"a": 0, "b": 2, DEFAULT_TENANT: 3}
    u.pool.close()
    renamed = [A_AND_B[0], dict(A_AND_B[1], name="c")]  # b's index now names c: not guessed
    v = boot(tenants(*renamed))
    assert v.used() == {"a": 0, "c": 0, DEFAULT_TENANT: 5}
    check_invariants(v.pool)
    v.pool.close()
    w = boot(tenants(*A_AND_B))  # the codes were cleared: b does not get them back either
    assert w.used() == {"a": 0, "b": 0, DEFAULT_TENANT: 5}


def test_without_tenants_salts_change_nothing(make_pool, small_spec) -> None:
    pool = make_pool(pool_size=SLOTS * SLOT + INDEX_ROOM)
    reg = pool.register(small_spec(), 1, SLOT, "engine-0/scheduler")
    res = pool.reserve_store(
        reg.namespace_id, reg.client_id, pack(range(40)), salts=KeySalts(("a",), b"\x09" * 40)
    )  # not even checked: a sidecar without --tenants ignores salts
    assert res.decisions.count(NEW) == SLOTS
    assert pool.stats().namespaces[0].tenants == ()


def test_random_traffic_keeps_every_guarantee_and_max(make_tenancy) -> None:
    """Property: a store by one tenant never takes another below min(its use, its guarantee),
    and never takes the storing tenant above max(its max, its use); invariants hold."""
    config = tenants(
        {"name": "a", "cacheSalts": ["a"], "guaranteed": "25%", "max": "40%"},
        {"name": "b", "cacheSalts": ["b"], "guaranteed": "10%", "max": "100%"},
        {"name": "default", "guaranteed": "5%", "max": "30%"},
    )
    t = make_tenancy(config)
    limits = {
        s.name: (s.guaranteed_slots, s.max_slots) for s in t.pool.stats().namespaces[0].tenants
    }
    names = {"a": "a", "b": "b", None: DEFAULT_TENANT}
    rng = random.Random(19)
    open_stores: list[int] = []
    pins: list[int] = []
    for step in range(400):
        salt = rng.choice(["a", "b", None])
        before = t.used()
        op = rng.random()
        if op < 0.6:
            ints = [
                rng.randrange(200) + 1000 * (1 + ["a", "b", None].index(salt))
                for _ in range(rng.randint(1, 12))
            ]
            res = t.reserve(salt, ints)
            if res.store_id:
                if rng.random() < 0.8:
                    t.pool.commit_store(t.ns, res.store_id, 0)
                else:
                    open_stores.append(res.store_id)
            after = t.used()
            me = names[salt]
            for name, (guaranteed, _) in limits.items():
                if name != me:
                    assert after[name] >= min(before[name], guaranteed), (step, name)
            assert after[me] <= max(limits[me][1], before[me]), step
        elif op < 0.7 and open_stores:
            t.pool.abort_store(t.ns, open_stores.pop(rng.randrange(len(open_stores))))
        elif op < 0.8:
            pin = t.pool.reserve_load(t.ns, t.reg.client_id, pack([rng.randrange(3000)]))
            if pin.pin_id:
                pins.append(pin.pin_id)
        elif pins:
            t.pool.release(t.ns, t.reg.client_id, [pins.pop()])
        else:
            t.pool.lookup(t.ns, [pack([rng.randrange(4000)])], [salt or ""])
        if step % 25 == 0:
            check_invariants(t.pool)
    check_invariants(t.pool)
