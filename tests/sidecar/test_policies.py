"""Eviction policies on their own: ordering, protection, atomic eviction, ARC's adaptation."""

from __future__ import annotations

import random
import sys
import textwrap

import pytest
from kvoffload_sidecar.policies import CachePolicy, make_policy
from kvoffload_sidecar.policies.arc import ARCPolicy
from kvoffload_sidecar.policies.factory import resolve_policy


def k(i: int) -> bytes:
    return i.to_bytes(8, "big")


def fill(policy: CachePolicy, ints) -> None:
    for i in ints:
        policy.insert(k(i))


@pytest.mark.parametrize("name", ["lru", "arc"])
def test_untouched_keys_leave_oldest_first(name):
    policy = make_policy(name, 8)
    fill(policy, range(4))
    assert policy.evict(2, set()) == [k(0), k(1)]
    assert sorted(policy.keys()) == [k(2), k(3)] and len(policy) == 2


@pytest.mark.parametrize("name", ["lru", "arc"])
def test_touched_key_outlives_untouched_ones(name):
    policy = make_policy(name, 8)
    fill(policy, range(4))
    policy.touch([k(0)])  # 0 is now the most valuable
    victims = policy.evict(3, set())
    assert victims is not None and k(0) not in victims
    assert list(policy.keys()) == [k(0)]


@pytest.mark.parametrize("name", ["lru", "arc"])
def test_protected_keys_are_skipped(name):
    policy = make_policy(name, 8)
    fill(policy, range(4))
    assert policy.evict(2, {k(0), k(2)}) == [k(1), k(3)]
    assert k(0) in policy and k(2) in policy


@pytest.mark.parametrize("name", ["lru", "arc"])
def test_evict_is_atomic_when_it_cannot_free_n(name):
    policy = make_policy(name, 8)
    fill(policy, range(4))
    before = sorted(policy.keys())
    assert policy.evict(3, {k(0), k(1)}) is None  # only 2 unprotected
    assert policy.evict(5, set()) is None  # only 4 held
    assert sorted(policy.keys()) == before
    assert policy.evict(0, set()) == []


@pytest.mark.parametrize("name", ["lru", "arc"])
def test_remove_and_touch_ignore_unknown_keys(name):
    policy = make_policy(name, 8)
    fill(policy, [1, 2])
    policy.remove(k(1))
    policy.remove(k(99))
    policy.touch([k(98)])
    assert list(policy.keys()) == [k(2)] and k(1) not in policy


@pytest.mark.parametrize("name", ["lru", "arc"])
def test_randomized_policy_holds_exactly_what_was_inserted(name):
    rng = random.Random(7)
    cap = 32
    policy = make_policy(name, cap)
    held: set[bytes] = set()
    for _ in range(3000):
        op = rng.random()
        if op < 0.45 and len(held) < cap:
            key = k(rng.randrange(200))
            if key not in held:
                policy.insert(key)
                held.add(key)
        elif op < 0.7:
            policy.touch([k(rng.randrange(200)) for _ in range(3)])
        elif op < 0.8 and held:
            key = rng.choice(sorted(held))
            policy.remove(key)
            held.discard(key)
        else:
            protected = {key for key in held if rng.random() < 0.3}
            n = rng.randrange(0, 5)
            victims = policy.evict(n, protected)
            if victims is None:
                assert n > len(held - protected)
            else:
                assert len(victims) == n == len(set(victims))
                assert not set(victims) & protected and set(victims) <= held
                held -= set(victims)
        assert set(policy.keys()) == held and len(policy) == len(held)
        if isinstance(policy, ARCPolicy):
            assert policy.ghost_count() <= cap
            assert 0 <= policy.p <= cap


def test_arc_second_hit_promotes_to_frequent_list():
    # T1 = {0, 1, 2, 3}; touching 0 and 1 moves them to T2. With p = 0, ARC evicts from T1 while
    # |T1| > p, so the once-used keys 2 and 3 go first, then T2's LRU (0).
    arc = ARCPolicy(8)
    fill(arc, range(4))
    arc.touch([k(0), k(1)])
    assert arc.evict(3, set()) == [k(2), k(3), k(0)]


def test_arc_ghost_hit_in_b1_grows_recency_target():
    arc = ARCPolicy(4)
    fill(arc, range(4))
    assert arc.evict(1, set()) == [k(0)]  # 0 -> ghost list B1
    assert arc.p == 0
    arc.insert(k(0))  # stored again while remembered: T1 was too small
    assert arc.p == 1
    # 0 returned to T2; T1 = {1, 2, 3} shrinks to its target p = 1 first, then T2 pays.
    assert arc.evict(2, set()) == [k(1), k(2)]
    assert arc.evict(1, set()) == [k(0)]
    assert list(arc.keys()) == [k(3)]


def test_arc_ghost_hit_in_b2_shrinks_recency_target():
    arc = ARCPolicy(4)
    fill(arc, range(4))
    assert arc.evict(1, set()) == [k(0)]
    arc.insert(k(0))  # B1 hit: p = 1, key 0 in T2
    assert arc.evict(3, set()) == [k(1), k(2), k(0)]  # T1 down to p, then T2's 0 -> B2
    p_before = arc.p
    arc.insert(k(0))  # B2 hit: T2 was too small
    assert arc.p < p_before
    assert list(arc.keys()) == [k(3), k(0)]


def test_arc_ghosts_stay_bounded_by_capacity():
    arc = ARCPolicy(4)
    for i in range(100):
        arc.insert(k(i))
        if len(arc) == 4:
            assert arc.evict(2, set()) is not None
        assert arc.ghost_count() <= 4
    assert len(arc) <= 4


def test_arc_falls_back_to_the_other_list_when_one_is_all_protected():
    arc = ARCPolicy(8)
    fill(arc, range(4))
    arc.touch([k(2), k(3)])  # T1 = {0, 1}, T2 = {2, 3}
    assert arc.evict(2, {k(0), k(1)}) == [k(2), k(3)]


def test_factory_rejects_unknown_names_and_loads_out_of_tree_classes(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="unknown eviction policy 'fifo'"):
        make_policy("fifo", 4)
    with pytest.raises(ValueError, match="cannot load"):
        resolve_policy("no_such_module_xyz:Policy")
    (tmp_path / "my_policy_mod.py").write_text(
        textwrap.dedent(
            """
            from kvoffload_sidecar.policies.lru import LRUPolicy
            class Mru(LRUPolicy):
                name = "mru"
            class NotAPolicy:
                def __init__(self, capacity): pass
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    policy = make_policy("my_policy_mod:Mru", 4)
    assert policy.name == "mru"
    with pytest.raises(ValueError, match="does not implement CachePolicy"):
        make_policy("my_policy_mod:NotAPolicy", 4)
    sys.modules.pop("my_policy_mod", None)


def test_arc_needs_a_positive_capacity():
    with pytest.raises(ValueError, match="capacity"):
        ARCPolicy(0)
