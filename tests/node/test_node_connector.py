"""The connector's worker side in node placement, without vLLM: a worker rank registers over a
pod's `pool.sock` of a real node agent, takes its tenant's memfd from `memory.sock` (its own
open file description), stores and loads KV blocks through its own mapping of it (the CPU
engine), and holds its engine lock on that description. What cannot be used (nothing at
`memory.sock`, a refusal, a closed connection, a memfd not sealed or of another size, regions
past its end, a placement that does not match the answer) leaves the rank without the pool
with the reason, and the registration is retried; an agent restarted beside the holder keeps
the rank's mapping (the same memfd and generation), a new memfd replaces it."""

from __future__ import annotations

import fcntl
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from kvoffload_connector.common.client import PoolClient
from kvoffload_connector.common.config import Placement, parse_extra_config
from kvoffload_connector.common.errors import PoolUnavailable
from kvoffload_connector.common.keys import build_spec
from kvoffload_connector.common.metadata import ConnectorMeta, GroupTransfer, LoadJob, StoreJob
from kvoffload_connector.common.node_memory import receive_tenant_memory
from kvoffload_connector.common.pool_replies import RankRegion, RegisterResult
from kvoffload_connector.worker.engine_lock import _FLOCK, lock_offset
from kvoffload_connector.worker.layout import canonicalize
from kvoffload_connector.worker.offload_worker import OffloadWorker
from kvoffload_connector.worker.pool_memory import TenantAttach, TenantMemory
from nodeharness import POD_A, POD_A2, POD_B, MiB, Node, standin

from tests.connector.kv_setup import expected_block, fill_random, make_kv_caches, write_block

pytestmark = pytest.mark.process


standin.kvoffload_script()  # the GPU host runs the checkout from PYTHONPATH: a shim of it

CHUNK_BLOCKS = 4
ENGINE = 4242
F_OFD_GETLK = getattr(fcntl, "F_OFD_GETLK", 36)


# -- the placement setting ------------------------------------------------------------------


def test_placement_is_pod_by_default_node_when_asked_and_a_bad_value_is_refused():
    assert parse_extra_config({}, 16).placement is Placement.POD
    assert parse_extra_config({"placement": "node"}, 16).placement is Placement.NODE
    with pytest.raises(ValueError, match=r"\['placement'\] must be 'pod' or 'node', got 'nodes'"):
        parse_extra_config({"placement": "nodes"}, 16)


# -- a node with a holder, pods published ---------------------------------------------------


@pytest.fixture
def node() -> Iterator[Node]:
    with Node(POD_A, POD_A2, POD_B) as n:
        yield n


# -- a worker rank over a pod's sockets -----------------------------------------------------


def make_worker(socket_path: str, device: str = "cpu", **extra) -> tuple[OffloadWorker, object]:
    """A rank as register_kv_caches leaves it before it registers: its layout (KV caches of
    24 blocks on `device`) and namespace spec."""
    setup = make_kv_caches("LBHNC", num_blocks=24, device=device)
    layout = canonicalize(setup.kv_caches, setup.layer_groups, CHUNK_BLOCKS, setup.kv_cache_config)
    fill_random(layout, seed=3)
    cfg = parse_extra_config({"socket": socket_path, "placement": "node", **extra}, block_size=4)
    vllm_config = SimpleNamespace(
        parallel_config=SimpleNamespace(
            tensor_parallel_size=1, pipeline_parallel_size=1, world_size=1
        ),
        cache_config=SimpleNamespace(block_size=4),
    )
    w = OffloadWorker(cfg, vllm_config=vllm_config, kv_cache_config=None, rank=0)
    w.layout, w.device = layout, torch.device(device)
    w.spec = build_spec(
        model="node-test",
        dtype="float32",
        kv_layout=layout.tag,
        block_size=4,
        chunk_blocks=CHUNK_BLOCKS,
        tp_size=1,
        hash_algo="sha256",
        group_specs=("full",),
    )
    return w, setup


def register(w: OffloadWorker) -> RegisterResult:
    """What register_kv_caches does once it has the layout: register, then map."""
    reg = w.client.register(w.spec, 1, w.layout.slot_bytes)
    w._apply(reg)
    return reg


def scheduler_client(w: OffloadWorker) -> PoolClient:
    """The engine's scheduler side: the same namespace, reservations for ENGINE."""
    c = PoolClient(w.cfg.socket, "node-test/scheduler", rpc_timeout_s=5, engine=ENGINE)
    c.register(w.spec, 1, w.layout.slot_bytes)
    return c


def wait_pool_ready(c: PoolClient, max_s: float = 30.0) -> None:
    end = time.monotonic() + max_s
    while not c.stats().pool_ready:
        assert time.monotonic() < end, "the tenant pool never became ready"
        time.sleep(0.05)


def key(i: int) -> bytes:
    return i.to_bytes(36, "big")  # the key size of a sha256 namespace (key_size_for)


def store(w: OffloadWorker, sched: PoolClient, keys: list[int], blocks: list[int]) -> None:
    """One chunk per key (CHUNK_BLOCKS GPU blocks each) stored as the scheduler plans it; waits
    for the commit."""
    reg = sched.registration
    w.start_load_kv(ConnectorMeta(engine=ENGINE))  # the rank holds its lock for ENGINE first
    res = sched.reserve_store([key(k) for k in keys])
    assert res.store_id and len(res.slots) == len(keys), res
    gpu, slots, pos = [], [], []
    for i, slot in enumerate(res.slots):
        chunk = blocks[i * CHUNK_BLOCKS : (i + 1) * CHUNK_BLOCKS]
        gpu += chunk
        slots += [slot] * len(chunk)
        pos += list(range(len(chunk)))
    job = StoreJob(
        1000 + res.store_id,
        res.store_id,
        reg.namespace_id,
        (GroupTransfer(0, tuple(gpu), tuple(slots), tuple(pos)),),
        reg.generation,
        reg.epoch,
        ENGINE,
    )
    w.wait_for_save(ConnectorMeta(stores=(job,), engine=ENGINE))
    end = time.monotonic() + 10
    while sched.lookup([[key(k) for k in keys]])[0] < len(keys):
        assert time.monotonic() < end, f"the store never committed: {w.report()}"
        w.transfer_results()
        time.sleep(0.02)
    w.report()


def load(w: OffloadWorker, sched: PoolClient, keys: list[int], blocks: list[int]) -> bool:
    """Pin `keys` and load them into `blocks`; True when the rank reported the load done."""
    pin = sched.reserve_load([key(k) for k in keys])
    assert len(pin.slots) == len(keys), pin
    gpu, slots, pos, versions = [], [], [], []
    for i, slot in enumerate(pin.slots):
        chunk = blocks[i * CHUNK_BLOCKS : (i + 1) * CHUNK_BLOCKS]
        gpu += chunk
        slots += [slot] * len(chunk)
        pos += list(range(len(chunk)))
        versions += [pin.versions[i]] * len(chunk)
    job = LoadJob(
        2000 + pin.pin_id,
        "req",
        (GroupTransfer(0, tuple(gpu), tuple(slots), tuple(pos)),),
        sched.registration.generation,
        versions=(tuple(versions),),
    )
    w.start_load_kv(ConnectorMeta(loads=(job,), engine=ENGINE))
    end = time.monotonic() + 10
    while True:
        recving, failed, _ = w.transfer_results()
        if "req" in recving or time.monotonic() > end:
            break
        time.sleep(0.02)
    sched.release([pin.pin_id])
    return "req" in recving and "req" not in failed


def blocks_equal(setup, layout, got: list[int], want: list[np.ndarray]) -> bool:
    return all(
        np.array_equal(expected_block(setup, layout, 0, b), w)
        for b, w in zip(got, want, strict=True)
    )


def other_lock_holder(memory_fd: int, offset: int) -> int:
    """F_OFD_GETLK from another description: the lock type someone holds at `offset`."""
    dup = os.open(f"/proc/self/fd/{memory_fd}", os.O_RDWR | os.O_CLOEXEC)
    try:
        probe = _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, offset, 1, 0)
        got = fcntl.fcntl(dup, F_OFD_GETLK, probe)
        return _FLOCK.unpack(got)[0]
    finally:
        os.close(dup)


def test_a_rank_stores_and_loads_through_its_own_description_of_the_tenant_memory(node):
    sock = f"{node.mount(POD_A)}/pool.sock"
    w, setup = make_worker(sock)
    try:
        reg = register(w)
        assert reg.tenant_memory == "alpha" and reg.regions[0].path == ""
        mem = w._memory
        assert isinstance(mem, TenantMemory) and mem.size == 4 * MiB
        # its own description: close-on-exec, the agent's memfd (the inode memory.sock sends)
        assert fcntl.fcntl(mem.fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
        fd, _ = receive_tenant_memory(f"{node.mount(POD_A)}/memory.sock", "alpha")
        assert (os.fstat(fd).st_dev, os.fstat(fd).st_ino) == mem.key
        os.close(fd)
        assert w.ready and w.pool.path == "memfd:alpha" and w.slot_versions is not None
        sched = scheduler_client(w)
        wait_pool_ready(sched)
        # the engine lock: on this rank's description, seen from another one
        assert w._hold_engine_lock(ENGINE)
        at = lock_offset(reg.engine_lock_base, ENGINE, 0)
        assert other_lock_holder(mem.fd, at) == fcntl.F_RDLCK
        want = [expected_block(setup, w.layout, 0, b) for b in range(8)]
        store(w, sched, [1, 2], list(range(8)))
        for b in range(8):  # the GPU blocks lose their bytes; the load brings them back
            write_block(setup, w.layout, 0, b, np.zeros_like(want[b]))
        assert load(w, sched, [1, 2], list(range(8, 16)))
        assert blocks_equal(setup, w.layout, list(range(8, 16)), want)
        # another pod of the tenant: the same bytes through its own mapping
        w2, setup2 = make_worker(f"{node.mount(POD_A2)}/pool.sock")
        try:
            register(w2)
            assert w2._memory.key == mem.key and w2._memory.fd != mem.fd
            sched2 = scheduler_client(w2)
            assert load(w2, sched2, [1, 2], list(range(4, 12)))
            assert blocks_equal(setup2, w2.layout, list(range(4, 12)), want)
            sched2.close()
        finally:
            w2.shutdown()
        # a pod of tenant beta: another memfd, none of alpha's keys
        w3, _ = make_worker(f"{node.mount(POD_B)}/pool.sock")
        try:
            register(w3)
            assert w3._memory.key != mem.key and w3._memory.size == 2 * MiB
            sched3 = scheduler_client(w3)
            assert sched3.lookup([[key(1), key(2)]]) == [0]
            sched3.close()
        finally:
            w3.shutdown()
        # released by unlocking, with the mapping still open (closing would not drop it)
        w._release_engine_lock()
        assert other_lock_holder(mem.fd, at) == fcntl.F_UNLCK
        sched.close()
    finally:
        w.shutdown()


def test_an_agent_restart_keeps_the_mapping_and_a_new_memfd_replaces_it(node):
    sock = f"{node.mount(POD_A)}/pool.sock"
    w, setup = make_worker(sock, reconnect_max_ms=200)
    sched = None
    try:
        reg = register(w)
        sched = scheduler_client(w)
        wait_pool_ready(sched)
        want = [expected_block(setup, w.layout, 0, b) for b in range(4)]
        store(w, sched, [7], list(range(4)))
        pool, memory = w.pool, w._memory
        # SIGKILL, the same agent again beside the same holder: the same memfd, its index
        # adopted under the same generation; the rank re-registers on its own and keeps its
        # mapping
        node.restart_agent()
        again = wait_registered(w, reg)
        assert again.generation == reg.generation and again.epoch != reg.epoch
        w._maybe_reconnect()
        assert w.pool is pool and w._memory is memory and w._applied is again
        sched.close()
        sched = scheduler_client(w)
        wait_pool_ready(sched)
        assert load(w, sched, [7], list(range(12, 16)))
        assert blocks_equal(setup, w.layout, list(range(12, 16)), want)
        # holder and agent replaced: a new memfd, a new pool under a new generation
        node.replace()
        fresh = wait_registered(w, again)
        assert fresh.generation != reg.generation
        w._maybe_reconnect()
        assert w.pool is not pool and w._memory.key != memory.key and memory.fd == -1
        assert w.generation == fresh.generation and w.ready
        sched.close()
        sched = scheduler_client(w)
        wait_pool_ready(sched)
        assert sched.lookup([[key(7)]]) == [0]  # the new pool holds nothing
        store(w, sched, [8], list(range(4, 8)))
        # the bytes are in the new memfd (read through another description of it)
        fd, size = receive_tenant_memory(f"{node.mount(POD_A)}/memory.sock", "alpha")
        assert (os.fstat(fd).st_dev, os.fstat(fd).st_ino) == w._memory.key
        region = fresh.regions[0]
        data = os.pread(fd, region.slot_count * region.slot_bytes, region.offset)
        os.close(fd)
        chunk = np.concatenate([expected_block(setup, w.layout, 0, b) for b in range(4, 8)])
        assert chunk.tobytes() in data
    finally:
        if sched is not None:
            sched.close()
        w.shutdown()


def wait_registered(w: OffloadWorker, old: RegisterResult, max_s: float = 30.0) -> RegisterResult:
    """The worker's client re-registered on its own (its keeper) after `old`."""
    end = time.monotonic() + max_s
    while True:
        reg = w.client.registration
        if reg is not None and reg is not old and w.client.connected:
            return reg
        assert time.monotonic() < end, f"never re-registered: {w.client.last_error}"
        time.sleep(0.05)


# -- what the rank cannot use ---------------------------------------------------------------


class FakeMemorySocket:
    """A `memory.sock` that answers each request as `answer` says: an agent's refusal, a
    connection closed unanswered, a memfd without seals or of another size than it says."""

    def __init__(self, directory: Path, answer: str) -> None:
        self.path = directory / "memory.sock"
        self.answer = answer
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.bind(str(self.path))
        self.sock.listen(4)
        self.served = threading.Event()  # a connection answered, and its fds closed here
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                self._answer(conn)
            self.served.set()

    def _answer(self, conn: socket.socket) -> None:
        conn.recv(4096)
        if self.answer == "close":
            return
        if self.answer in ("PERMISSION_DENIED", "UNAVAILABLE"):
            conn.send(json.dumps({"v": 1, "code": self.answer, "message": "no"}).encode())
            return
        fd = os.memfd_create("fake", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, 1 * MiB)
        size = 1 * MiB
        if self.answer != "unsealed":
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK)
        if self.answer == "wrong-size":
            size = 2 * MiB
        msg = json.dumps({"v": 1, "code": "OK", "size": size}).encode()
        socket.send_fds(conn, [msg], [fd])
        os.close(fd)

    def close(self) -> None:
        self.sock.close()


def answer(tenant: str = "alpha", offset: int = 0, slots: int = 8) -> RegisterResult:
    return RegisterResult(
        namespace_id="ns",
        client_id=1,
        regions=(RankRegion(0, "", offset, 64 << 10, slots),),
        pool_ready=True,
        committed_blocks=0,
        generation="g",
        engine_lock_base=1 << 40,
        slot_table_offset=(64 << 10) * slots,
        slot_record_bytes=64,
        tenant_memory=tenant,
    )


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize(
    ("served", "reason"),
    [
        ("missing", "no answer at"),
        ("PERMISSION_DENIED", "PERMISSION_DENIED: no"),
        ("UNAVAILABLE", "UNAVAILABLE: no"),
        ("close", "the agent closed the connection"),
        ("unsealed", "not sealed against resize"),
        ("wrong-size", "differs from the answer's"),
        ("past-the-end", "is not inside tenant alpha's memory"),
    ],
)
def test_memory_the_rank_cannot_use_fails_the_registration_with_the_reason(
    tmp_path, served, reason
):
    fake = None if served == "missing" else FakeMemorySocket(tmp_path, served)
    cfg = parse_extra_config({"socket": str(tmp_path / "pool.sock"), "placement": "node"}, 16)
    attach = TenantAttach(cfg, 0)
    before = open_fds()
    try:
        reg = answer(slots=64) if served == "past-the-end" else answer()
        with pytest.raises(PoolUnavailable, match=reason):
            attach.accept(reg)
        assert reason in attach.problem
        if fake is not None:
            assert fake.served.wait(5)  # the fake's own fds are closed
        with pytest.raises(ValueError, match="no memory of tenant alpha"):
            attach.take(reg)  # nothing to map: the step thread maps nothing
        assert open_fds() == before  # no fd kept from a refused answer
    finally:
        if fake is not None:
            fake.close()
        attach.close()


def test_a_placement_that_does_not_match_the_answer_fails_the_registration(tmp_path):
    node_cfg = parse_extra_config({"socket": str(tmp_path / "pool.sock"), "placement": "node"}, 16)
    pod_cfg = parse_extra_config({"socket": str(tmp_path / "pool.sock")}, 16)
    file_answer = RegisterResult("ns", 1, (RankRegion(0, "/pool/pool-0.shm", 0, 4096, 4),), True,
                                 0, "g")  # fmt: skip
    with pytest.raises(PoolUnavailable, match="answered a pool file"):
        TenantAttach(node_cfg, 0).accept(file_answer)
    with pytest.raises(PoolUnavailable, match="set it to 'node'"):
        TenantAttach(pod_cfg, 0).accept(answer())
    TenantAttach(pod_cfg, 0).accept(file_answer)  # pod mode: nothing to take
    assert TenantAttach(pod_cfg, 0).take(file_answer) is None


def test_a_rank_without_memory_serves_without_the_pool_and_attaches_once_it_is_there(node):
    """memory.sock moved away under a published pod: the registration fails (the rank says
    why, the client retries); once it is back the rank registers on its own and maps."""
    directory = Path(node.kubelet.target(POD_A))
    (directory / "memory.sock").rename(directory / "memory.sock.away")
    w, _ = make_worker(f"{node.mount(POD_A)}/pool.sock", reconnect_max_ms=200)
    try:
        with pytest.raises(PoolUnavailable, match="no answer at"):
            register(w)
        assert not w.client.connected and "memory.sock" in w.client.last_error
        assert w.pool is None and "memory.sock" in w.no_pool_reason()
        (directory / "memory.sock.away").rename(directory / "memory.sock")
        reg = wait_registered(w, None)
        w._maybe_reconnect()
        assert w.ready and w._applied is reg and w.no_pool_reason() == ""
    finally:
        w.shutdown()


def test_no_descriptor_reaches_a_child_process(node):
    """The memfd and every description of it the rank holds are close-on-exec: a process the
    engine starts holds neither the tenant's memory nor, after the engine died, its lock."""
    w, _ = make_worker(f"{node.mount(POD_A)}/pool.sock")
    try:
        register(w)
        assert w._hold_engine_lock(ENGINE)
        mine = subprocess.run(["ls", "-l", f"/proc/{os.getpid()}/fd/"], capture_output=True,
                              text=True, check=True)  # fmt: skip
        assert "memfd:kvoffload-tenant-alpha" in mine.stdout, mine.stdout  # held here
        child = subprocess.run(
            ["ls", "-l", "/proc/self/fd/"], capture_output=True, text=True, check=True
        )
        assert "memfd:" not in child.stdout, child.stdout
    finally:
        w.shutdown()


def test_stats_through_a_pods_pool_sock_relays_its_status_files_never_through_a_link(node):
    """`kvoffload stats` on a pod's pool.sock shows that pod's connector status files, as a
    sidecar's Stats does, written by a container of another uid than root's into the volume's
    `status/`; a link a pod planted there (to a file of the node) or a FIFO is not read."""
    d = Path(node.kubelet.target(POD_A)) / "status"
    entry = {"state": "active", "role": "worker", "rank": 0, "placement": "node",
             "no_pool": "no pool from the node agent"}  # fmt: skip
    write = "import sys; open(sys.argv[1], 'w').write(sys.argv[2])"
    subprocess.run(["setpriv", "--reuid=1000", "--regid=1000", "--clear-groups", sys.executable,
                    "-c", write, str(d / "connector-status-worker-0.json"), json.dumps(entry)],
                   check=True, timeout=60)  # fmt: skip
    assert os.stat(d / "connector-status-worker-0.json").st_uid == 1000
    secret = node.root / "node-secret.json"
    secret.write_text(json.dumps({"state": "secret", "role": "token"}))
    (d / "connector-status-link.json").symlink_to(secret)
    os.mkfifo(d / "connector-status-fifo.json")
    cli = [standin.kvoffload_script(), "stats", "--socket",
           f"{node.mount(POD_A)}/pool.sock"]  # fmt: skip
    table = subprocess.run(cli, capture_output=True, text=True, timeout=30)
    assert table.returncode == 0, table.stderr
    line = "connector worker rank 0 (placement node): active, without the pool: no pool from"
    assert line in table.stdout, table.stdout
    assert "secret" not in table.stdout and "token" not in table.stdout
    raw = subprocess.run([*cli, "--json"], capture_output=True, text=True, timeout=30)
    assert json.loads(json.loads(raw.stdout)["connector_status"]) == [entry]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_cuda_rank_registers_the_tenant_mapping_and_round_trips_through_it(node):
    """On a GPU: the rank's mapping of the tenant memfd is page-locked with CUDA in pieces
    (cudaHostRegister, as a pool file's is), and the CUDA engine's copies store into it and
    load from it: the blocks come back bit for bit, another pod of the tenant sees them."""
    w, setup = make_worker(f"{node.mount(POD_A)}/pool.sock", device="cuda")
    sched = None
    try:
        register(w)
        assert w.pool.wait_ready(60) and w.pool.registered, w.pool.error
        assert len(w.pool._registered) == len(w.pool.pieces())
        assert type(w.engine).__name__ != "CpuTorchEngine", type(w.engine)
        sched = scheduler_client(w)
        wait_pool_ready(sched)
        want = [expected_block(setup, w.layout, 0, b) for b in range(8)]
        store(w, sched, [21, 22], list(range(8)))
        for b in range(8):
            write_block(setup, w.layout, 0, b, np.zeros_like(want[b]))
        assert load(w, sched, [21, 22], list(range(8, 16)))
        torch.cuda.synchronize()
        assert blocks_equal(setup, w.layout, list(range(8, 16)), want)
        cpu, cpu_setup = make_worker(f"{node.mount(POD_A2)}/pool.sock")
        try:
            register(cpu)
            cpu_sched = scheduler_client(cpu)
            assert load(cpu, cpu_sched, [21, 22], list(range(4, 12)))
            assert blocks_equal(cpu_setup, cpu.layout, list(range(4, 12)), want)
            cpu_sched.close()
        finally:
            cpu.shutdown()
    finally:
        if sched is not None:
            sched.close()
        w.shutdown()


ATTACH_GIB = int(os.environ.get("KVO_ATTACH_GIB", "32"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("gib", [ATTACH_GIB], ids=lambda g: f"{g}GiB")
def test_a_cuda_rank_attaching_to_a_big_tenant_hits_within_seconds(gib):
    """On a GPU: a tenant of `gib` GiB (KVO_ATTACH_GIB, 32 by default) pre-faulted by the
    holder, two chunks stored in it by pod A's rank; pod A2's CUDA rank attaches and loads
    them as soon as the piece holding their slots is registered, long before its whole region
    is. Prints the time from attach to the first hit and the registration's cost per GiB."""
    alpha = {"name": "alpha", "shareBytes": gib << 30, "namespaces": ["team-a"]}
    pool = {"name": "node-pool", "tenants": [alpha]}
    with Node(POD_A, POD_A2, pool=pool) as node:
        writer, wsetup = big_worker(f"{node.mount(POD_A)}/pool.sock", "cpu")
        reader, rsetup = big_worker(f"{node.mount(POD_A2)}/pool.sock", "cuda")
        sched = None
        try:
            register(writer)
            sched = scheduler_client(writer)
            wait_pool_ready(sched, max_s=300)  # the holder's pre-fault of the whole tenant
            want = [expected_block(wsetup, writer.layout, 0, b) for b in range(8)]
            store(writer, sched, [31, 32], list(range(8)))
            t0 = time.monotonic()
            register(reader)  # maps its region and starts registering it with CUDA
            rsched = scheduler_client(reader)
            first_hit = None
            while first_hit is None:
                # a load the rank cannot run yet fails at once; one it runs is awaited
                if load(reader, rsched, [31, 32], list(range(8, 16))):
                    first_hit = time.monotonic() - t0
                assert time.monotonic() - t0 < 120, reader.pool.error
            torch.cuda.synchronize()
            view = reader.pool
            usable_then = view.usable_end
            assert view.wait_ready(300) and view.registered, view.error
            total_s = time.monotonic() - t0
            gib_mapped = view.slot_count * view.slot_bytes / (1 << 30)
            reg_s = view.progress[-1][0]
            print(
                f"\nattach {gib} GiB tenant: first hit {first_hit:.3f} s after attach "
                f"(usable then: {usable_then * view.slot_bytes / (1 << 30):.2f} GiB), first piece "
                f"{view.progress[0][0]:.3f} s, whole region {gib_mapped:.2f} GiB registered in "
                f"{reg_s:.2f} s ({1e3 * reg_s / gib_mapped:.1f} ms/GiB, "
                f"{gib_mapped * (1 << 30) / 1e9 / reg_s:.1f} GB/s), attach to ready {total_s:.2f} s"
            )
            assert first_hit < reg_s or len(view.pieces()) == 1  # hits before the whole region
            assert blocks_equal(rsetup, reader.layout, list(range(8, 16)), want)
            rsched.close()
        finally:
            if sched is not None:
                sched.close()
            reader.shutdown()
            writer.shutdown()


def big_worker(socket_path: str, device: str) -> tuple[OffloadWorker, object]:
    """A rank with slots of 2 MiB (8 layers, 8 heads of 128, 16-token blocks, 4 per chunk),
    so a big tenant has a modest slot table."""
    setup = make_kv_caches("LBHNC", num_layers=8, heads=8, block_size=16, head_size=128,
                           num_blocks=24, device=device)  # fmt: skip
    layout = canonicalize(setup.kv_caches, setup.layer_groups, CHUNK_BLOCKS, setup.kv_cache_config)
    fill_random(layout, seed=11)
    cfg = parse_extra_config({"socket": socket_path, "placement": "node", "chunk_size": 64}, 16)
    vllm_config = SimpleNamespace(
        parallel_config=SimpleNamespace(
            tensor_parallel_size=1, pipeline_parallel_size=1, world_size=1
        ),
        cache_config=SimpleNamespace(block_size=16),
    )
    w = OffloadWorker(cfg, vllm_config=vllm_config, kv_cache_config=None, rank=0)
    w.layout, w.device = layout, torch.device(device)
    w.spec = build_spec(model="node-attach-test", dtype="float16", kv_layout=layout.tag,
                        block_size=16, chunk_blocks=CHUNK_BLOCKS, tp_size=1, hash_algo="sha256",
                        group_specs=("full",))  # fmt: skip
    return w, setup
