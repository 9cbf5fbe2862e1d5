"""The slot protocol inside a tenant's memory, end to end: a real node agent (its memfds from a
real holder), the kubelet stand-in publishing pods, and each pod's client a process of its own
over the pod's `pool.sock`, `session.sock` and `memory.sock` (tests/node/slot_client.py, which
copies bytes in and out of its own mapping of the memfd as the connector's CPU path does)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import nodeharness
import pytest
from kvoffload.v1 import pool_pb2 as pb
from kvoffload.v1 import pool_pb2_grpc as pb_grpc
from kvoffload_sidecar.memory_room import MemoryRoom
from kvoffload_sidecar.node.bindings import Binding
from kvoffload_sidecar.node.holder import Holder
from kvoffload_sidecar.node.identity import PodIdentity
from kvoffload_sidecar.node.pools import PoolOptions, TenantPools
from kvoffload_sidecar.node.tenant_memory import TenantRegion, create_memfd
from nodeharness import (
    AGENT,
    BETA_GROUP,
    CLIENT,
    POD_A,
    POD_A2,
    POD_B,
    MiB,
    Node,
    make_root,
    pool_call,
)

pytestmark = pytest.mark.process

SLOT_BYTES = 64 << 10


def block_digest(seed: str, i: int) -> str:
    """What slot_client.py stores for key `i` under `seed`, as a digest of the slot's bytes."""
    unit = hashlib.sha256(f"{seed}:{i}".encode()).digest()
    return hashlib.sha256((unit * (SLOT_BYTES // len(unit)))[:SLOT_BYTES]).hexdigest()


@pytest.fixture
def node() -> Iterator[Node]:
    with Node(POD_A, POD_A2, POD_B) as n:
        yield n


def test_register_names_the_tenant_memory_and_no_path(node: Node) -> None:
    for pod, size in ((POD_A, 4 * MiB), (POD_B, 2 * MiB)):
        reg = node.client(pod, "register")
        assert reg["tenant_memory"] == pod.tenant
        assert reg["paths"] == [""]  # offsets are into the memfd from memory.sock
        assert reg["memory_size"] == size
        assert reg["slot_count"] > 0 and reg["offsets"][0] + reg["slot_count"] * SLOT_BYTES <= size
        assert reg["session_socket"] == "session.sock"
        assert reg["presence_map"] == ""  # not offered in node mode
    # the pod's sockets follow memory.sock's rules: 0666, or 0660 and the pod's fsGroup
    for pod, mode, group in ((POD_A, 0o666, 0), (POD_B, 0o660, BETA_GROUP)):
        for name in ("memory.sock", "pool.sock", "session.sock"):
            st = os.lstat(node.kubelet.target(pod) / name)
            assert stat.S_ISSOCK(st.st_mode), name
            assert (stat.S_IMODE(st.st_mode), st.st_gid) == (mode, group), (pod.name, name)


def test_a_block_stored_by_one_pod_loads_byte_for_byte_in_another(node: Node) -> None:
    keys = "1,2,3"
    stored = node.client(POD_A, "store", "--keys", keys, "--seed", "alpha")
    assert stored["decisions"] == [1, 1, 1] and stored["visible"], stored
    loaded = node.client(POD_A2, "load", "--keys", keys)
    assert loaded["namespace_id"] == stored["namespace_id"]  # one namespace: one model
    assert loaded["memory_ino"] == stored["memory_ino"]  # one memfd, its own description each
    assert sorted(loaded["slots"]) == sorted(stored["slots"])
    assert loaded["digests"] == [block_digest("alpha", k) for k in (1, 2, 3)]
    assert loaded["versions_held"] and loaded["released"] == 3
    # the second pod's store of the same keys finds them present: stored once per tenant
    again = node.client(POD_A2, "store", "--keys", keys, "--seed", "other")
    assert again["decisions"] == [2, 2, 2] and again["store_id"] == 0
    ns = node.stats(POD_A2).namespaces[0]
    assert ns.committed_slots == 3 and ns.stored_blocks == 3


def test_another_tenant_sees_none_of_its_keys_and_its_own_memory(node: Node) -> None:
    stored = node.client(POD_A, "store", "--keys", "7,8", "--seed", "alpha")
    assert stored["decisions"] == [1, 1]
    # the same model in tenant beta: the same namespace id, another pool in another memfd
    other = node.client(POD_B, "lookup", "--keys", "7,8")
    assert other["tenant_memory"] == "beta" and other["namespace_id"] == stored["namespace_id"]
    assert other["hits"] == 0
    assert other["memory_ino"] != stored["memory_ino"]
    pinned = node.client(POD_B, "load", "--keys", "7,8")
    assert pinned["pin_id"] == 0 and pinned["slots"] == []
    assert all(ns.committed_slots == 0 for ns in node.stats(POD_B).namespaces)


def test_the_agents_lock_check_sees_a_pods_lock_on_its_own_description(node: Node) -> None:
    """The engine lock a pod takes on the description memory.sock gave it is what the agent's
    F_OFD_GETLK sees: without it no slot is reserved, with it the store is granted."""
    unlocked = node.client(POD_A, "store", "--keys", "20", "--no-lock")
    assert unlocked["decisions"] == [3] and unlocked["store_id"] == 0  # NO_SPACE: unarmed
    assert node.stats(POD_A).namespaces[0].unlocked_reservations == 1
    locked = node.client(POD_A, "store", "--keys", "20")
    assert locked["decisions"] == [1] and locked["visible"]


def test_a_dead_engines_lock_frees_its_reservations(node: Node) -> None:
    mount = node.mount(POD_A)
    hold = subprocess.Popen(
        [sys.executable, CLIENT, mount, "hold", "--tenant", "alpha", "--keys", "30,31"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert hold.stdout is not None
        held = json.loads(hold.stdout.readline() or "{}")
        assert held.get("decisions") == [1, 1], hold.stderr.read() if hold.stderr else ""
        # alive (its lock held): its reservations stay over several reaper ticks
        time.sleep(3)
        assert node.stats(POD_A).namespaces[0].reserved_slots == 2
    finally:
        hold.send_signal(signal.SIGKILL)  # the engine dies; the kernel drops its lock
        hold.wait(10)
    deadline = time.monotonic() + 15
    while node.stats(POD_A).namespaces[0].reserved_slots:
        assert time.monotonic() < deadline, node.agent.log.read_text()
        time.sleep(0.1)
    # the keys are free to be stored again, by another engine
    assert node.client(POD_A2, "store", "--keys", "30,31")["decisions"] == [1, 1]


def test_committed_blocks_survive_an_agent_sigkill(node: Node) -> None:
    stored = node.client(POD_A, "store", "--keys", "40,41,42", "--seed", "before")
    assert stored["visible"]
    node.agent.kill()
    node.agent.start()  # the holder lends the same memfds; the bindings are restored
    stats = node.stats(POD_A2)
    assert stats.adoption.outcome == "adopted", node.agent.log.read_text()
    assert stats.adoption.adopted_blocks == 3 and stats.pool_generation == stored["generation"]
    loaded = node.client(POD_A2, "load", "--keys", "40,41,42")
    assert loaded["generation"] == stored["generation"]
    assert loaded["digests"] == [block_digest("before", k) for k in (40, 41, 42)]
    # tenant beta's pool came back too, empty as it was
    assert node.stats(POD_B).adoption.outcome == "adopted"


def test_unpublish_stops_the_pods_servers_and_removes_its_sockets(node: Node) -> None:
    target = node.kubelet.target(POD_A2)
    assert (target / "pool.sock").exists()
    node.kubelet.unpublish(POD_A2)
    assert not target.exists()
    # the other pods of the tenant are still served
    assert node.client(POD_A, "lookup", "--keys", "1")["tenant_memory"] == "alpha"
    node.kubelet.publish(POD_A2)  # published again: served again
    assert node.client(POD_A2, "register")["tenant_memory"] == "alpha"


def test_the_holder_answers_prefault_requests_for_what_it_holds() -> None:
    h = Holder()
    code, _, fd = h.lend("t", 4 * MiB)
    assert code == "OK" and fd is not None
    try:

        def ask(**doc: object) -> tuple[str, str]:
            raw = json.dumps({"v": 1, "op": "prefault", "tenant": "t", **doc}).encode()
            answer, sent = h.handle(raw, [], os.getuid())
            assert sent is None
            return answer["code"], answer["message"]

        assert os.fstat(fd).st_blocks == 0
        assert ask(offset=MiB, length=MiB) == ("OK", "")
        assert os.fstat(fd).st_blocks * 512 == MiB  # that range, and only it
        assert ask(offset=3 * MiB, length=2 * MiB)[0] == "INVALID_ARGUMENT"  # past the memfd
        assert ask(offset=-1, length=MiB)[0] == "INVALID_ARGUMENT"
        assert ask(offset=0, length=True)[0] == "INVALID_ARGUMENT"
        assert ask(offset=0, length=MiB, extra=1)[0] == "INVALID_ARGUMENT"
        raw = json.dumps({"v": 1, "op": "prefault", "tenant": "u", "offset": 0, "length": 1})
        assert h.handle(raw.encode(), [], os.getuid())[0]["code"] == "FAILED_PRECONDITION"
        assert h.handle(raw.encode(), [], os.getuid() + 1)[0]["code"] == "PERMISSION_DENIED"
        assert os.fstat(fd).st_blocks * 512 == MiB
    finally:
        os.close(fd)


def _memory_cgroup(name: str) -> Path:
    """A cgroup v1 memory cgroup (the development VM's kernel has that hierarchy, and tests run
    as root there: without either this test cannot prove where pages are charged)."""
    root = Path("/sys/fs/cgroup/memory")
    if os.geteuid() != 0 or not (root / "cgroup.procs").exists():
        pytest.fail("needs root and a cgroup v1 memory hierarchy (/sys/fs/cgroup/memory)")
    d = root / f"kvo-{name}-{uuid.uuid4().hex[:8]}"
    d.mkdir()
    return d


def _shmem(cgroup: Path) -> int:
    for line in (cgroup / "memory.stat").read_text().splitlines():
        key, _, value = line.partition(" ")
        if key == "shmem":
            return int(value)
    raise AssertionError(f"no shmem in {cgroup}/memory.stat")


def _remove_cgroup(d: Path) -> None:
    deadline = time.monotonic() + 10
    while d.exists():
        try:
            d.rmdir()
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def test_the_agents_prefault_is_charged_to_the_holder(monkeypatch: pytest.MonkeyPatch) -> None:
    """The agent's pool pre-faults a tenant's memory in its own order, but each range is
    allocated by the holder (`prefault` over the holder socket): the holder's cgroup, whose
    limit is the node pool, is charged, never the agent's."""
    tenant = 64 * MiB
    root = make_root()
    holder_cg, agent_cg = _memory_cgroup("holder"), _memory_cgroup("agent")
    join = 'echo $$ > {}/cgroup.procs && exec "$@"'
    holder_dir = root / "holder"
    holder_dir.mkdir(mode=0o700)
    path = str(holder_dir / "holder.sock")
    log = root / "holder.log"
    with log.open("w") as out:  # no --prefault: nothing allocates but the agent's requests
        holder = subprocess.Popen(
            ["sh", "-c", join.format(holder_cg), "sh", AGENT[0], "node-holder", "--socket", path],
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    monkeypatch.setattr(nodeharness, "AGENT", ["sh", "-c", join.format(agent_cg), "sh", *AGENT])
    pool = {
        "name": "p",
        "tenants": [{"name": "alpha", "shareBytes": tenant, "namespaces": ["team-a"]}],
    }
    node = None
    try:
        deadline = time.monotonic() + 20
        while "node holder serving" not in log.read_text():
            assert holder.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.02)
        node = Node(POD_A, holder=False, pool=pool, agent_args=("--holder-socket", path))
        agent_log = node.agent.log
        stored = node.client(POD_A, "store", "--keys", "1")  # waits until the pool is ready
        assert stored["visible"]
        holder_bytes, agent_bytes = _shmem(holder_cg), _shmem(agent_cg)
        assert holder_bytes + agent_bytes >= tenant, agent_log.read_text()  # every page, once
        # the agent's share: pages its pool wrote before the pre-fault reached them (the pool
        # header, a namespace's header and slot table), never the tenant's slots
        assert agent_bytes < MiB and holder_bytes > tenant - MiB, (holder_bytes, agent_bytes)
        assert "the holder allocates its pages" in agent_log.read_text()
    finally:
        if node is not None:
            node.close()
        holder.send_signal(signal.SIGTERM)
        holder.wait(10)
        shutil.rmtree(root, ignore_errors=True)
        for cg in (holder_cg, agent_cg):
            with contextlib.suppress(OSError):
                (cg / "memory.force_empty").write_text("0")
            _remove_cgroup(cg)


def test_a_pod_bound_before_its_tenant_has_a_pool_gets_its_sockets_once_it_has_one() -> None:
    """An agent that follows the pool object restores its bindings before it has read the
    grants: those pods' pool.sock answers UNAVAILABLE with the reason until their tenant has a
    pool, then their servers serve."""
    root = make_root()
    pools = TenantPools(PoolOptions(prefault=False))
    fd = create_memfd("alpha", 2 * MiB)
    try:
        target = root / "pod"
        target.mkdir()
        b = Binding(
            volume_id="v1",
            target_path=str(target),
            pod=PodIdentity("team-a", "p", str(uuid.uuid4()), "vllm"),
            tenant="alpha",
            mount_group=None,
            granted=True,
        )
        assert not pools.attach(b)
        assert pools.knows("v1", str(target)) and not pools.serving("v1", str(target))
        code, details = pool_call(str(target), "Stats")
        assert code == grpc.StatusCode.UNAVAILABLE
        assert details.startswith("tenant 'alpha' has no pool on this node: its memory is not")
        assert not (target / "session.sock").exists()
        pools.add(TenantRegion("alpha", fd, 2 * MiB))
        assert pools.serving("v1", str(target))
        with grpc.insecure_channel(f"unix:{target}/pool.sock") as channel:
            stats = pb_grpc.KVPoolStub(channel).Stats(pb.StatsRequest(), timeout=10)
        assert stats.pool_bytes == 2 * MiB and stats.adoption.outcome == "new"
        assert pools.detach("v1", str(target))
        assert not (target / "pool.sock").exists() and not (target / "session.sock").exists()
        assert not pools.knows("v1", str(target))
    finally:
        pools.close()
        os.close(fd)
        shutil.rmtree(root, ignore_errors=True)


def test_without_the_holder_a_tenant_past_the_agents_memory_limit_gets_no_pool() -> None:
    """The agent allocating its tenants' pages itself is charged for them: a tenant that does
    not fit its container's limit (counting the other tenants' pre-faults still to come) gets no
    pool, and says why, rather than getting the agent OOM-killed part-way."""
    room = MemoryRoom(limit=160 * MiB, usage=40 * MiB)  # 120 MiB free
    pools = TenantPools(PoolOptions(), room=lambda: room)
    fds = [create_memfd(name, 64 * MiB) for name in ("alpha", "beta")]
    try:
        # the first tenant fits (64 MiB + its index + the agent's reserve)
        pools.add(TenantRegion("alpha", fds[0], 64 * MiB))
        alpha = pools.pool("alpha")
        assert alpha is not None and alpha.wait_ready(30)
        room = MemoryRoom(limit=160 * MiB, usage=40 * MiB + 64 * MiB)  # alpha is charged now
        pools.add(TenantRegion("beta", fds[1], 64 * MiB))
        assert pools.pool("beta") is None
        assert "does not fit the node agent container's memory limit" in pools.problems["beta"]
    finally:
        pools.close()
        for fd in fds:
            os.close(fd)
