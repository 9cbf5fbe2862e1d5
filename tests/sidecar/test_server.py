"""The KVPool server over a real Unix socket with real gRPC clients (server in-process).

The server runs on its own event loop thread (`procs.ServerThread`) so every test can check the
live Pool's invariants after the clients are done.
"""

from __future__ import annotations

import re
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2
from kvoffload.v1 import pool_pb2 as pb
from pool_invariants import check_invariants
from procs import (
    SLOT_BYTES,
    Client,
    ServerThread,
    Session,
    health_status,
    keys,
    server_config,
    socket_dir,
    spec,
    wait_ready,
    wire_slots,
)

pytestmark = [pytest.mark.process, pytest.mark.timeout(120)]

NEW, PRESENT, NO_SPACE = (
    pb.STORE_DECISION_NEW,
    pb.STORE_DECISION_PRESENT,
    pb.STORE_DECISION_NO_SPACE,
)
BIG_SLOT = 1 << 20  # 16 MiB pool / 1 MiB slots: a pool that fills after a handful of stores


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerThread]:
    with socket_dir() as sock_dir, ServerThread(server_config(tmp_path, sock_dir)) as srv:
        yield srv
        check_invariants(srv.pool)


@pytest.fixture
def client(server: ServerThread) -> Iterator[Client]:
    with Client(server.target) as c:
        wait_ready(c)
        yield c


def test_round_trip_register_lookup_store_commit_load_release(client: Client) -> None:
    reg = client.register()
    assert len(reg.namespace_id) == 32
    assert reg.client_id > 0
    assert [(r.rank, r.slot_bytes) for r in reg.regions] == [(0, SLOT_BYTES)]
    assert reg.regions[0].slot_count > 8
    assert Path(reg.regions[0].path).exists()

    assert client.lookup(keys(1, 2, 3)) == [0]
    res = client.reserve_store(keys(1, 2, 3))
    assert list(res.decisions) == [NEW, NEW, NEW]
    assert len(set(wire_slots(res.slots))) == 3
    assert client.lookup(keys(1, 2, 3)) == [0]  # reserved, not visible before commit
    assert client.commit(res.store_id) is True
    assert client.lookup(keys(1, 2, 3), keys(1, 2, 9), keys(9)) == [3, 2, 0]

    pin = client.reserve_load(keys(1, 2, 9))
    assert pin.pin_id > 0
    assert wire_slots(pin.slots) == wire_slots(res.slots)[:2]
    assert client.namespace_stats().pinned_slots == 2
    assert client.release(pin.pin_id) == 2
    ns = client.namespace_stats()
    assert (ns.pinned_slots, ns.committed_slots, ns.stored_blocks, ns.loaded_blocks) == (0, 3, 3, 2)

    again = client.reserve_store(keys(3, 4))
    assert list(again.decisions) == [PRESENT, NEW]
    assert client.abort(again.store_id) == 1


def test_two_ranks_commit_before_keys_are_visible(client: Client) -> None:
    reg = client.register(spec(tp_size=2), num_ranks=2)
    assert [r.rank for r in reg.regions] == [0, 1]
    assert reg.regions[1].offset >= reg.regions[0].offset + reg.regions[0].slot_count * SLOT_BYTES
    res = client.reserve_store(keys(7, 8))
    assert client.commit(res.store_id, rank=1) is False
    assert client.commit(res.store_id, rank=1) is False  # idempotent per rank
    assert client.lookup(keys(7, 8)) == [0]
    assert client.commit(res.store_id, rank=0) is True
    assert client.lookup(keys(7, 8)) == [2]
    with pytest.raises(grpc.RpcError) as info:
        client.commit(res.store_id, rank=2)
    assert info.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND)


def test_racing_clients_never_share_a_slot(server: ServerThread, client: Client) -> None:
    client.register()
    n_threads, n_keys = 6, 48
    all_keys = list(range(1000, 1000 + n_keys))
    results: list[tuple[int, list[int], list[int], list[int]]] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(n_threads)

    def racer(i: int) -> None:
        try:
            with Client(server.target) as c:
                c.register(name=f"racer-{i}")
                order = all_keys if i % 2 == 0 else all_keys[::-1]
                barrier.wait(timeout=10)
                for start in range(0, n_keys, 8):
                    chunk = order[start : start + 8]
                    res = c.reserve_store(keys(*chunk))
                    new = [k for k, d in zip(chunk, res.decisions, strict=True) if d == NEW]
                    if res.store_id:
                        assert c.commit(res.store_id) is True
                    results.append((i, new, wire_slots(res.slots), list(res.decisions)))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=racer, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    stored = [k for _, new, _, _ in results for k in new]
    slots = [s for _, _, sl, _ in results for s in sl]
    assert sorted(stored) == all_keys  # every key NEW for exactly one client
    assert len(set(slots)) == len(slots) == n_keys  # no slot handed out twice
    assert all(d in (NEW, PRESENT) for *_, ds in results for d in ds)
    assert client.lookup(keys(*all_keys)) == [n_keys]
    ns = client.namespace_stats()
    assert (ns.committed_slots, ns.stored_blocks, ns.reserved_slots) == (n_keys, n_keys, 0)
    check_invariants(server.pool)


def test_eviction_under_a_full_pool(client: Client) -> None:
    reg = client.register(slot_bytes=BIG_SLOT)
    capacity = reg.regions[0].slot_count
    assert 4 <= capacity <= 16
    client.store(keys(*range(capacity)))
    assert client.lookup(keys(*range(capacity))) == [capacity]
    client.lookup(keys(0))  # touch key 0: the LRU victim is key 1 then
    res = client.store(keys(100, 101))
    assert list(res.decisions) == [NEW, NEW]
    ns = client.namespace_stats()
    assert ns.evicted_blocks == 2
    assert ns.committed_slots == capacity
    assert client.lookup(keys(0), keys(1), keys(2), keys(3), keys(100, 101)) == [1, 0, 0, 1, 2]


def test_pins_survive_eviction_pressure(client: Client) -> None:
    reg = client.register(slot_bytes=BIG_SLOT)
    capacity = reg.regions[0].slot_count
    client.store(keys(*range(capacity)))
    pinned = keys(*range(capacity // 2))
    pin = client.reserve_load(pinned)
    assert len(wire_slots(pin.slots)) == capacity // 2
    for round_ in range(3):  # far more new keys than the unpinned half can hold
        first = 1000 + round_ * capacity
        client.store(keys(*range(first, first + capacity - capacity // 2)))
    assert client.lookup(pinned) == [capacity // 2]
    assert client.namespace_stats().pinned_slots == capacity // 2
    # all unpinned slots hold reserved keys now: nothing evictable -> NO_SPACE from there on
    res = client.reserve_store(keys(*range(5000, 5000 + capacity)))
    blocked = client.reserve_store(keys(*range(6000, 6000 + capacity)))
    assert NO_SPACE in blocked.decisions or NO_SPACE in res.decisions
    assert client.lookup(pinned) == [capacity // 2]
    for store_id in (res.store_id, blocked.store_id):
        if store_id:
            client.abort(store_id)
    assert client.release(pin.pin_id) == capacity // 2


BAD_CALLS = [
    (
        "missing namespace",
        "Lookup",
        pb.LookupRequest(queries=[pb.KeyList(keys=keys(1))]),
        "INVALID_ARGUMENT",
    ),
    ("unknown namespace", "Lookup", pb.LookupRequest(namespace_id="ab" * 16), "NOT_FOUND"),
    ("ragged keys", "ReserveStore", "ragged", "INVALID_ARGUMENT"),
    ("missing client", "ReserveLoad", "no-client", "INVALID_ARGUMENT"),
    ("unknown client", "ReserveLoad", "unknown-client", "NOT_FOUND"),
    ("unknown pin", "Release", "unknown-pin", "NOT_FOUND"),
    ("unknown store", "CommitStore", "unknown-store", "NOT_FOUND"),
    ("another instance's commit", "CommitStore", "other-epoch", "FAILED_PRECONDITION"),
    ("missing store id", "AbortStore", "no-store", "INVALID_ARGUMENT"),
    (
        "empty spec",
        "Register",
        pb.RegisterRequest(num_ranks=1, slot_bytes_per_rank=SLOT_BYTES),
        "INVALID_ARGUMENT",
    ),
    (
        "bad spec",
        "Register",
        pb.RegisterRequest(spec=spec(key_size=0), num_ranks=1, slot_bytes_per_rank=16),
        "INVALID_ARGUMENT",
    ),
    (
        "zero ranks",
        "Register",
        pb.RegisterRequest(spec=spec(), num_ranks=0, slot_bytes_per_rank=SLOT_BYTES),
        "INVALID_ARGUMENT",
    ),
    (
        "slot size mismatch",
        "Register",
        pb.RegisterRequest(spec=spec(), num_ranks=1, slot_bytes_per_rank=2 * SLOT_BYTES),
        "FAILED_PRECONDITION",
    ),
    (
        "second namespace",
        "Register",
        pb.RegisterRequest(spec=spec("other"), num_ranks=1, slot_bytes_per_rank=SLOT_BYTES),
        "RESOURCE_EXHAUSTED",
    ),
]


@pytest.mark.parametrize(
    ("what", "method", "request_", "code"), BAD_CALLS, ids=[c[0] for c in BAD_CALLS]
)
def test_bad_requests_get_precise_codes(
    client: Client, what: str, method: str, request_: object, code: str
) -> None:
    client.register()
    ns, cid = client.namespace_id, client.client_id
    built = {
        "ragged": pb.ReserveStoreRequest(namespace_id=ns, client_id=cid, keys=b"x" * 33),
        "no-client": pb.ReserveLoadRequest(namespace_id=ns, keys=keys(1)),
        "unknown-client": pb.ReserveLoadRequest(namespace_id=ns, client_id=999_999, keys=keys(1)),
        "unknown-pin": pb.ReleaseRequest(namespace_id=ns, client_id=cid, pin_ids=[424242]),
        "unknown-store": pb.CommitStoreRequest(
            namespace_id=ns, store_id=424242, sidecar_epoch=client.epoch, engine=client.engine
        ),
        "no-store": pb.AbortStoreRequest(namespace_id=ns),
        "other-epoch": pb.CommitStoreRequest(
            namespace_id=ns, store_id=424242, sidecar_epoch=client.epoch ^ 1, engine=client.engine
        ),
    }
    request = built.get(request_, request_) if isinstance(request_, str) else request_
    with pytest.raises(grpc.RpcError) as info:
        getattr(client.stub, method)(request, timeout=5)
    assert info.value.code().name == code, (what, info.value.details())
    assert info.value.details()  # a message, not just a code


def test_stats_carries_pool_namespaces_and_rpc_latency(client: Client) -> None:
    client.register()
    client.store(keys(1, 2))
    client.lookup(keys(1, 2, 3))
    stats = client.stats()
    assert stats.pool_bytes == 16 << 20
    assert stats.pool_ready and stats.prefaulted_bytes == stats.pool_bytes
    assert stats.eviction_policy == "lru"
    assert stats.version
    ns = stats.namespaces[0]
    assert (ns.spec.model, ns.lookups, ns.hit_blocks, ns.miss_blocks, ns.stored_blocks) == (
        "tiny-llama",
        1,
        2,
        1,
        2,
    )
    assert ns.stored_bytes == 2 * SLOT_BYTES
    latency = {lat.method: lat for lat in stats.rpc_latency}
    assert {"Register", "ReserveStore", "CommitStore", "Lookup"} <= set(latency)
    assert latency["Lookup"].count == 1
    assert 0 < latency["Lookup"].p50_seconds <= latency["Lookup"].p99_seconds < 1


def test_session_attach_order_errors_and_detach(server: ServerThread, client: Client) -> None:
    reg = client.register()
    ns = reg.namespace_id
    client.store(keys(1, 2, 3))

    unattached = Session(client)
    first = unattached.send(
        lookup=pb.LookupRequest(namespace_id=ns, queries=[pb.KeyList(keys=keys(1))])
    )
    assert first.WhichOneof("result") == "error"
    assert first.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "attach" in first.error.message
    unattached.close()  # the server ended that stream

    session = Session(client)
    assert (
        session.send(attach=pb.AttachRequest(client_id=reg.client_id)).WhichOneof("result")
        == "attach"
    )
    hit = session.send(
        lookup=pb.LookupRequest(namespace_id=ns, queries=[pb.KeyList(keys=keys(1, 2, 3))])
    )
    assert list(hit.lookup.hit_counts) == [3]
    bad = session.send(reserve_store=pb.ReserveStoreRequest(namespace_id=ns, keys=b"short"))
    assert bad.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    other = session.send(
        reserve_load=pb.ReserveLoadRequest(namespace_id=ns, client_id=77, keys=keys(1))
    )
    assert other.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    again = session.send(attach=pb.AttachRequest(client_id=reg.client_id))
    assert again.error.code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
    empty = session.send()
    assert empty.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    pin = session.send(
        reserve_load=pb.ReserveLoadRequest(namespace_id=ns, keys=keys(1, 2))
    )  # stream still open
    assert len(wire_slots(pin.reserve_load.slots)) == 2
    store = session.send(reserve_store=pb.ReserveStoreRequest(namespace_id=ns, keys=keys(50)))
    assert list(store.reserve_store.decisions) == [NEW]
    assert client.namespace_stats().pinned_slots == 2
    assert client.namespace_stats().reserved_slots == 1

    session.close()  # client ends the stream: pins released, the reservation is the engine's
    _wait_for(lambda: client.namespace_stats().pinned_slots == 0)
    ns_stats = client.namespace_stats()
    assert (ns_stats.pinned_slots, ns_stats.reserved_slots, ns_stats.committed_slots) == (0, 1, 3)
    client.release_locks()  # every rank of the engine exited: the kernel dropped the locks
    server.pool.reclaim_dead_engines()
    assert client.namespace_stats().reserved_slots == 0
    check_invariants(server.pool)


def test_an_ended_session_keeps_its_pins_for_the_detach_grace(tmp_path: Path) -> None:
    """The engine may still be copying from its pinned slots when its stream ends."""
    grace = 1.5
    with (
        socket_dir() as sock_dir,
        ServerThread(server_config(tmp_path, sock_dir, detach_grace_s=grace)) as srv,
        Client(srv.target) as c,
    ):
        wait_ready(c)
        reg = c.register()
        c.store(keys(1, 2))
        session = Session(c)
        session.send(attach=pb.AttachRequest(client_id=reg.client_id))
        load = pb.ReserveLoadRequest(namespace_id=reg.namespace_id, keys=keys(1, 2))
        session.send(reserve_load=load)
        session.cancel()
        ended = time.monotonic()
        time.sleep(grace / 3)
        assert c.namespace_stats().pinned_slots == 2  # within the grace: still held
        _wait_for(lambda: c.namespace_stats().pinned_slots == 0, timeout=grace + 5)
        assert time.monotonic() - ended >= grace - 0.05


def test_session_cancelled_by_client_releases_pins(client: Client) -> None:
    reg = client.register()
    client.store(keys(1, 2))
    session = Session(client)
    session.send(attach=pb.AttachRequest(client_id=reg.client_id))
    session.send(reserve_load=pb.ReserveLoadRequest(namespace_id=reg.namespace_id, keys=keys(1, 2)))
    assert client.namespace_stats().pinned_slots == 2
    session.cancel()
    _wait_for(lambda: client.namespace_stats().pinned_slots == 0)


def test_session_attach_unknown_client_ends_stream(client: Client) -> None:
    session = Session(client)
    resp = session.send(attach=pb.AttachRequest(client_id=123456))
    assert resp.error.code == grpc.StatusCode.NOT_FOUND.value[0]
    session.close()


def test_health_and_drain(server: ServerThread, client: Client) -> None:
    assert health_status(server.target) == health_pb2.HealthCheckResponse.SERVING
    assert (
        health_status(server.target, "kvoffload.v1.KVPool")
        == health_pb2.HealthCheckResponse.SERVING
    )
    client.register()
    server.pool.begin_drain()  # the state the server is in during its grace period
    with pytest.raises(grpc.RpcError) as info:
        client.reserve_store(keys(1))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert client.lookup(keys(1)) == [0]  # reads keep working while draining
    server.drain(grace=0.5)
    assert health_status(server.target) is None  # refused once stopped


def test_tcp_listener_serves_health_and_stats_only(tmp_path: Path) -> None:
    with (
        socket_dir() as sock_dir,
        ServerThread(server_config(tmp_path, sock_dir, listen="127.0.0.1:0")) as srv,
    ):
        target = f"127.0.0.1:{srv.sidecar.tcp_port}"
        assert health_status(target) == health_pb2.HealthCheckResponse.SERVING
        with Client(target) as tcp:
            assert tcp.stats().pool_bytes == 16 << 20
            with pytest.raises(grpc.RpcError) as info:
                tcp.register()
            assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_metrics_endpoint_has_the_table(server: ServerThread, client: Client) -> None:
    client.register()
    client.store(keys(1, 2))
    client.lookup(keys(1, 2, 3))
    pin = client.reserve_load(keys(1))
    http = server.sidecar.metrics.serve_http("127.0.0.1:0")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{http.port}/metrics", timeout=5) as resp:
            body = resp.read().decode()
    finally:
        http.close()
    client.release(pin.pin_id)
    ns = client.namespace_id
    expected = [
        f'kvoffload_pool_capacity_bytes{{pool_namespace="{ns}"}}',
        f'kvoffload_pool_used_bytes{{pool_namespace="{ns}"}} {float(2 * SLOT_BYTES)}',
        f'kvoffload_pool_pinned_bytes{{pool_namespace="{ns}"}} {float(SLOT_BYTES)}',
        "kvoffload_pool_prefaulted_bytes 1.6777216e+07",
        f'kvoffload_lookups_total{{pool_namespace="{ns}"}} 1.0',
        f'kvoffload_lookup_blocks_total{{pool_namespace="{ns}",result="hit"}} 2.0',
        f'kvoffload_lookup_blocks_total{{pool_namespace="{ns}",result="miss"}} 1.0',
        f'kvoffload_stored_blocks_total{{pool_namespace="{ns}"}} 2.0',
        f'kvoffload_loaded_blocks_total{{pool_namespace="{ns}"}} 1.0',
        f'kvoffload_evicted_blocks_total{{policy="lru",pool_namespace="{ns}"}} 0.0',
        f'kvoffload_stored_bytes_total{{pool_namespace="{ns}"}} {float(2 * SLOT_BYTES)}',
        f'kvoffload_loaded_bytes_total{{pool_namespace="{ns}"}} {float(SLOT_BYTES)}',
        'kvoffload_rpc_duration_seconds_count{method="Lookup"} 1.0',
        'kvoffload_build_info{version="',
    ]
    missing = [line for line in expected if line not in body]
    assert not missing, f"missing {missing} in:\n{body}"
    # No series uses Kubernetes' `namespace` target label (a scrape would rename it).
    assert re.search(rf'^kvoffload_namespace_info{{.*pool_namespace="{ns}".*}} 1.0$', body, re.M)
    assert not re.search(r'[{,]namespace="', body), body


def _wait_for(cond, timeout: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    import time

    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not met in time"
        time.sleep(0.02)
