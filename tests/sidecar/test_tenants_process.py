"""Per-tenant quotas in a real `kvoffload sidecar --tenants` process, over its socket.

Tenant `a` (salt "a", 25% guaranteed) stores prefixes as large as its guarantee and keeps
pinning them (ReserveLoad with count_lookup, as the connector does) while tenant `b` (two salts)
floods the pool with distinct keys at 10x its capacity, in batches that also carry unsalted
keys. Every one of a's lookups must hit in full; b (and the default tenant) replace their own
blocks; Stats, `kvoffload stats` and /metrics show it per tenant; malformed salts are
INVALID_ARGUMENT; a bad `--tenants` stops the sidecar with one clear line.
"""

from __future__ import annotations

import json
import subprocess
import urllib.request
from pathlib import Path

import grpc
import pytest
from kvoffload.v1 import pool_pb2 as pb

from tests.sidecar.metrics_doc import check_text_format, documented, exposed, samples
from tests.sidecar.procs import (
    Client,
    keys,
    kvoffload_command,
    sidecar_process,
    socket_dir,
    wait_ready,
)
from tests.sidecar.test_metrics_exposition import free_port

pytestmark = [pytest.mark.process, pytest.mark.timeout(120)]

TENANTS = [
    {"name": "a", "cacheSalts": ["a"], "guaranteed": "25%", "max": "50%"},
    {"name": "b", "cacheSalts": ["b", "b-batch"], "guaranteed": "0%", "max": "100%"},
    {"name": "default", "guaranteed": "0%", "max": "10%"},
]


def store(client: Client, packed: bytes, salts: list[str], per_key: bytes):
    req = pb.ReserveStoreRequest(
        namespace_id=client.namespace_id,
        client_id=client.client_id,
        keys=packed,
        cache_salts=salts,
        key_salts=per_key,
    )
    res = client.stub.ReserveStore(req, timeout=client.timeout)
    if res.store_id:
        assert client.commit(res.store_id)
    return res


def pin_hits(client: Client, packed: bytes, salt: str) -> int:
    """A lookup and its pin in one call, as the connector makes it; the pin goes back."""
    req = pb.ReserveLoadRequest(
        namespace_id=client.namespace_id,
        client_id=client.client_id,
        keys=packed,
        count_lookup=True,
        cache_salt=salt,
    )
    res = client.stub.ReserveLoad(req, timeout=client.timeout)
    if res.pin_id:
        client.release(res.pin_id)
    return len(res.slots) // 4


def tenant_stats(client: Client) -> dict[str, pb.TenantStats]:
    return {t.name: t for t in client.namespace_stats().tenants}


def test_a_flood_at_ten_times_the_pool_leaves_the_guaranteed_tenant_hitting(
    tmp_path: Path,
) -> None:
    port = free_port()
    with (
        socket_dir() as sock_dir,
        sidecar_process(
            tmp_path,
            sock_dir,
            "--tenants",
            json.dumps(TENANTS),
            "--metrics-listen",
            f"127.0.0.1:{port}",
        ) as sc,
        Client(sc.target) as client,
    ):
        slots = client.register().regions[0].slot_count
        wait_ready(client)
        guaranteed = slots // 4
        prefixes = [keys(*range(10_000 * p, 10_000 * p + 8)) for p in range(1, guaranteed // 8 + 1)]
        a_blocks = 8 * len(prefixes)
        for prefix in prefixes:
            res = store(client, prefix, ["a"], b"\x01" * 8)
            assert res.decisions == bytes([pb.STORE_DECISION_NEW]) * 8
        flooded, batch = 0, 60
        next_key = 1_000_000
        while flooded < 10 * slots:
            # b's keys with either of its salts, plus 4 unsalted (default tenant) keys
            packed = keys(*range(next_key, next_key + batch))
            per_key = bytes([1, 2] * ((batch - 4) // 2) + [0] * 4)
            res = store(client, packed, ["b", "b-batch"], per_key)
            assert res.decisions.count(pb.STORE_DECISION_NEW) == batch  # b replaces its own
            next_key += batch
            flooded += batch
            for prefix in prefixes:  # a's prefixes keep hitting, whole
                assert pin_hits(client, prefix, "a") == 8
        t = tenant_stats(client)
        assert (t["a"].used_slots, t["a"].evicted_blocks, t["a"].stored_blocks) == (
            a_blocks,
            0,
            a_blocks,
        )
        assert t["a"].guaranteed_slots == guaranteed and t["a"].max_slots == slots // 2
        assert (t["a"].lookups, t["a"].miss_blocks) == (t["a"].hit_blocks // 8, 0)
        assert t["a"].queried_blocks == t["a"].hit_blocks > 0
        assert t["b"].stored_blocks == flooded - flooded // batch * 4
        assert t["b"].used_slots + t["default"].used_slots + a_blocks == slots  # the pool is full
        assert t["default"].used_slots <= t["default"].max_slots == slots // 10
        assert t["b"].evicted_blocks == t["b"].stored_blocks - t["b"].used_slots

        # per key, one byte too many for the batch: INVALID_ARGUMENT, nothing stored
        with pytest.raises(grpc.RpcError) as exc:
            store(client, keys(1, 2), ["a"], b"\x01\x01\x01")
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "key_salts has 3 bytes for 2 keys" in exc.value.details()

        table = subprocess.run(
            [*kvoffload_command(), "stats", "--socket", str(sc.socket)],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
        rows = {line.split()[1]: line.split() for line in table.splitlines() if "%" in line}
        assert set(rows) >= {"a", "b", "default"}, table
        assert rows["a"][2:4] == ["25%", f"({guaranteed})"], table

        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        final = tenant_stats(client)
        log = sc.stderr()
        assert "tenants a 25%..50%, b 0%..100%, default 0%..10%" in log  # shares, no salts
        assert "b-batch" not in log

    check_text_format(text)
    docs = documented("Per-tenant")
    seen = exposed(text)
    assert set(docs) <= set(seen)
    assert set(seen) <= set(docs) | set(documented("Sidecar"))  # nothing undocumented
    for name, doc in docs.items():
        assert (seen[name].type, seen[name].labels) == (doc.type, doc.labels), name
    ns = {"pool_namespace": client.namespace_id}
    used = samples(text, "kvoffload_tenant_used_blocks")
    assert {dict(k)["tenant"]: v for k, v in used.items()} == {
        name: float(s.used_slots) for name, s in final.items()
    }
    hit = samples(text, "kvoffload_tenant_lookup_blocks_total")
    assert (
        hit[tuple(sorted({**ns, "tenant": "a", "result": "hit"}.items()))] == final["a"].hit_blocks
    )
    assert hit[tuple(sorted({**ns, "tenant": "a", "result": "miss"}.items()))] == 0


def test_a_bad_tenants_flag_stops_the_sidecar_with_one_line(tmp_path: Path) -> None:
    with socket_dir() as sock_dir:
        bad = json.dumps([{"name": "a", "cacheSalts": ["a"], "guaranteed": "70%", "max": "60%"}])
        res = subprocess.run(
            [
                *kvoffload_command(),
                "sidecar",
                "--pool-size=4Mi",
                f"--pool-dir={tmp_path}",
                f"--socket={sock_dir / 'pool.sock'}",
                f"--tenants={bad}",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert res.returncode == 2, res.stderr
    assert "--tenants (env KVOFFLOAD_TENANTS" in res.stderr
    assert "guaranteed 70% is above max 60%" in res.stderr
