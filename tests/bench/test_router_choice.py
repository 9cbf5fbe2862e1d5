"""bench/router.py's choice: the replica holding the longest prefix through its host tier, as
Dynamo's indexer answers it; round-robin among ties and when nobody holds any of it."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from router import RoundRobin, TierMatch, choose, tier_matches  # noqa: E402

# An answer of `python -m dynamo.indexer`'s /query (v1.6): tokens per tier, cumulative.
ANSWER = {
    "scores": {"1": {"0": 64}, "2": {"0": 256}},
    "frequencies": [],
    "instances": {
        "1": {"longest_matched": 256, "gpu": 64, "dp": {"0": 64}, "cpu": 256, "disk": 256},
        "2": {"longest_matched": 128, "gpu": 128, "dp": {"0": 128}, "cpu": 128, "disk": 128},
    },
}


def test_the_host_tier_counts_a_gpu_only_match_does_not_win():
    m = tier_matches(ANSWER)
    assert m == {1: TierMatch(device=64, host=256), 2: TierMatch(device=128, host=128)}
    # worker 2 holds more on its GPU, worker 1 more through its pool: the pool's match wins
    assert choose(m, [1, 2], RoundRobin([1, 2])) == 1


def test_no_match_and_ties_go_round_robin():
    rr = RoundRobin([1, 2, 3])
    assert [choose({}, [1, 2, 3], rr) for _ in range(4)] == [1, 2, 3, 1]
    tie = {1: TierMatch(0, 128), 3: TierMatch(128, 128), 2: TierMatch(0, 64)}
    rr2 = RoundRobin([1, 2, 3])
    picks = [choose(tie, [1, 2, 3], rr2) for _ in range(4)]
    assert set(picks) == {1, 3}, picks  # never the shorter match
    assert tier_matches({"scores": {}, "frequencies": [], "instances": {}}) == {}


def test_the_workload_does_not_make_round_robin_a_router():
    """Every pass asks each prefix once, in its own order: round-robin over 2 replicas sends
    some prefix to both (in one fixed order of 8 groups it kept each group on one replica)."""
    from argparse import Namespace

    from router import workload

    a = Namespace(groups=8, per_group=4, prefix_tokens=16, suffix_tokens=2)
    prompts = workload(a, 0)
    passes = [prompts[i : i + 8] for i in range(0, 32, 8)]
    assert all(len({tuple(p[:16]) for p in one}) == 8 for one in passes)
    rr = RoundRobin([1, 2])
    seen: dict[tuple, set] = {}
    for p in prompts:
        seen.setdefault(tuple(p[:16]), set()).add(rr.pick())
    assert any(len(w) == 2 for w in seen.values()), seen
    # the warm-up's prefixes are none of a segment's (seeds 1000 * round + policy)
    warm = {tuple(p[:16]) for p in workload(a, "warm-up")}
    for seed in (0, 1, 1000, 1001, 2000, 2001, 3000, 3001):
        assert not warm & {tuple(p[:16]) for p in workload(a, seed)}
