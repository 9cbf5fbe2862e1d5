"""Pure core: quantities, policy parsing/defaults/hash, selectors and precedence, sizing."""

from __future__ import annotations

import dataclasses

import pytest
from kvoffload_operator.policy import (
    MIB,
    Delivery,
    Eviction,
    Mode,
    PolicyError,
    SecurityProfile,
    parse_quantity,
    policy_from_resource,
)
from kvoffload_operator.selection import select_policy, selector_from_spec
from kvoffload_operator.sizing import headroom, size_pool

GI = 1 << 30


def make(name: str = "p", **spec: object) -> dict:
    base = {"selector": {"matchLabels": {"app": "vllm"}}, "pool": {"size": "16Gi"}}
    return {
        "kind": "KVOffloadPolicy",
        "metadata": {"name": name, "namespace": "ns"},
        "spec": {**base, **spec},
    }


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("64Gi", 64 * GI),
        ("1.5Gi", 3 * GI // 2),
        ("20G", 20 * 10**9),
        ("512", 512),
        ("2Ti", 2 << 40),
        ("3e3", 3000),
        ("1500m", None),
        ("lots", None),
        ("1.5", None),
    ],
)
def test_parse_quantity(text: str, expected: int | None) -> None:
    if expected is None:
        with pytest.raises(PolicyError):
            parse_quantity(text)
    else:
        assert parse_quantity(text) == expected


def test_defaults_match_the_crd() -> None:
    p = policy_from_resource(make())
    assert (p.pool.eviction, p.pool.hugepages, p.pool.numa_node) == (Eviction.LRU, False, None)
    assert (p.offload.mode, p.offload.chunk_size) == (Mode.EAGER, None)
    assert p.sidecar.security_profile is SecurityProfile.MINIMAL
    assert p.sidecar.startup_timeout_seconds == 5
    assert p.connector.delivery is Delivery.INIT_CONTAINER
    assert (p.rollout_enabled, p.priority, p.vllm_container) == (True, 0, None)


def test_hash_ignores_defaults_priority_and_rollout_but_not_the_pool() -> None:
    plain = policy_from_resource(make())
    explicit = policy_from_resource(
        make(
            offload={"mode": "eager"},
            sidecar={"startupTimeoutSeconds": 5},
            connector={"delivery": "initContainer"},
            priority=7,
            rollout={"enabled": False},
        )
    )
    bigger = policy_from_resource(make(pool={"size": "32Gi"}))
    assert plain.spec_hash == explicit.spec_hash != bigger.spec_hash
    assert len(plain.spec_hash) == 16


def test_selector_operators() -> None:
    sel = selector_from_spec(
        {
            "matchLabels": {"app": "vllm"},
            "matchExpressions": [
                {"key": "tier", "operator": "In", "values": ["a", "b"]},
                {"key": "env", "operator": "NotIn", "values": ["dev"]},
                {"key": "gpu", "operator": "Exists"},
                {"key": "skip", "operator": "DoesNotExist"},
            ],
        },
        "s",
    )
    ok = {"app": "vllm", "tier": "a", "gpu": "h100"}
    assert sel.matches(ok)
    assert not sel.matches({**ok, "tier": "c"})
    assert not sel.matches({**ok, "env": "dev"})
    assert not sel.matches({k: v for k, v in ok.items() if k != "gpu"})
    assert not sel.matches({**ok, "skip": "1"})
    assert selector_from_spec({}, "s").matches({})  # empty selects everything
    assert sel.to_query() == "app=vllm,tier in (a,b),env notin (dev),gpu,!skip"


def test_precedence_priority_then_name() -> None:
    a = policy_from_resource(make("a"))
    b = policy_from_resource(make("b"))
    hi = policy_from_resource(make("z", priority=3))
    other = policy_from_resource(make("o", selector={"matchLabels": {"app": "web"}}))
    sel = select_policy({"app": "vllm"}, [b, other, hi, a])
    assert sel.winner == hi and [p.name for p in sel.losers] == ["a", "b"] and not sel.tie
    tie = select_policy({"app": "vllm"}, [b, a])
    assert tie.winner == a and tie.tie
    assert select_policy({"app": "none"}, [a, b]).winner is None


def test_sizing_charges_the_pool_to_the_sidecar() -> None:
    pool = policy_from_resource(make(pool={"size": "64Gi"})).pool
    s = size_pool(pool)
    assert headroom(64 * GI) == 256 * MIB + 256 * MIB  # base + 1/256 of 64Gi
    assert s.sidecar_requests == {"cpu": "250m", "memory": f"{64 * 1024 + 512}Mi"}
    assert s.sidecar_limits == {"memory": f"{64 * 1024 + 512}Mi"}  # request == limit
    assert (s.pool_medium, s.pool_size_limit) == ("Memory", f"{64 * 1024 + 16}Mi")
    huge = size_pool(dataclasses.replace(pool, hugepages=True))
    assert huge.sidecar_limits == {"memory": "512Mi", "hugepages-2Mi": "65536Mi"}
    assert huge.pool_medium == "HugePages-2Mi"


def test_size_below_a_mebibyte_rounds_up() -> None:
    pool = policy_from_resource(make(pool={"size": "1000"})).pool
    assert size_pool(pool).pool_size_limit == "17Mi"
