"""A sidecar SIGKILLed (or SIGTERMed) and started again with the same command line adopts its
pool file (restarts lose nothing).

Real sidecar processes, a real gRPC client, and the pool file mapped by this test the way the
connector's workers map it: the test writes a byte pattern into every slot it stores (at the
region offset Register returned) before committing, so after the restart it can prove the
adopted index points at the same slots and that the bytes there are the ones written. What the
dead sidecar had only reserved (a copy mid-flight) must not come back as visible, and its slots
are handed out again only once the engine that reserved them is dead (no process holds its
lock byte of the pool file: a late copy of it may still land in them), however long that takes
(`--reserved-hold` is still accepted, and ends nothing); every other free slot takes stores at
once.
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import signal
import socket
import struct
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvoffload.v1 import pool_pb2 as pb
from procs import (
    Client,
    keys,
    kvoffload_command,
    socket_dir,
    stop_process,
    wait_ready,
    wait_serving,
)
from procs import wire_slots as slots_of

pytestmark = [pytest.mark.process, pytest.mark.timeout(240)]

POOL_SIZE = "16Mi"
SLOT_BYTES = 64 << 10
HOLD_S = 1.0  # --reserved-hold: accepted for deployed pod specs; frees nothing by itself
GRACE_S = 1.0  # --detach-grace: pins only
NEW, NO_SPACE = pb.STORE_DECISION_NEW, pb.STORE_DECISION_NO_SPACE
COMMITTED = list(range(1, 41))  # stored in 4 batches, each its own store id
PINNED = COMMITTED[:10]  # pinned when the sidecar dies
RESERVED = list(range(1001, 1006))  # reserved, half written, never committed


def pattern(key: int) -> bytes:
    """A slot's bytes for `key`: its hash repeated (every slot distinct, every byte checked)."""
    digest = hashlib.sha256(key.to_bytes(8, "big")).digest()
    return digest * (SLOT_BYTES // len(digest))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class Sidecar:
    """`kvoffload sidecar` with one fixed command line: `start()` after a kill runs the very
    same argv (same pool dir, pool size, socket), as the kubelet restarts a container."""

    def __init__(self, pool_dir: Path, run_dir: Path, *extra: str) -> None:
        self.sock = run_dir / "pool.sock"
        self.log = run_dir / "sidecar.log"
        self.metrics_port = free_port()
        self.argv = [
            *kvoffload_command(),
            "sidecar",
            f"--pool-size={POOL_SIZE}",
            f"--pool-dir={pool_dir}",
            f"--socket={self.sock}",
            f"--detach-grace={GRACE_S:g}",
            f"--reserved-hold={HOLD_S:g}",
            f"--metrics-listen=127.0.0.1:{self.metrics_port}",
            *extra,
        ]
        self.proc: subprocess.Popen[bytes] | None = None
        self.serving_at = 0.0  # monotonic time the current process first answered SERVING

    @property
    def target(self) -> str:
        return f"unix:{self.sock}"

    def start(self) -> Sidecar:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=out)
        proc = self.proc
        wait_serving(self.target, 20, alive=lambda: proc.poll() is None)
        self.serving_at = time.monotonic()
        return self

    def signal(self, sig: int) -> int:
        """Send `sig` and wait for the exit; the exit code."""
        assert self.proc is not None and self.proc.poll() is None
        self.proc.send_signal(sig)
        return self.proc.wait(timeout=20)

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)

    def client(self) -> Client:
        return Client(self.target)

    def metrics(self) -> str:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.read().decode()


@pytest.fixture
def sidecar(pool_dir: Path) -> Iterator[Sidecar]:
    with socket_dir() as run:
        sc = Sidecar(pool_dir, run)
        try:
            yield sc.start()
        finally:
            sc.stop()
            print(f"--- sidecar log ---\n{sc.log.read_text()[-6000:]}")  # shown on failure


class PoolFile:
    """This test's view of rank 0's region of the pool file, mapped shared as a worker maps it."""

    def __init__(self, reg: pb.RegisterResponse, pool_dir: Path) -> None:
        (region,) = reg.regions
        path = Path(region.path)
        self.path = path if path.is_absolute() else pool_dir / path
        self.offset, self.slot_bytes = region.offset, region.slot_bytes
        assert self.slot_bytes == SLOT_BYTES, region

    @contextlib.contextmanager
    def mapped(self) -> Iterator[mmap.mmap]:
        with open(self.path, "r+b") as f, mmap.mmap(f.fileno(), 0) as mm:
            yield mm

    def write(self, slot: int, data: bytes) -> None:
        at = self.offset + slot * self.slot_bytes
        with self.mapped() as mm:
            mm[at : at + len(data)] = data

    def read(self, slot: int) -> bytes:
        at = self.offset + slot * self.slot_bytes
        with self.mapped() as mm:
            return bytes(mm[at : at + self.slot_bytes])


def store_written(client: Client, view: PoolFile, ks: list[int]) -> list[int]:
    """Reserve `ks`, write each key's pattern into its slot, commit: their slots."""
    res = client.reserve_store(keys(*ks))
    assert list(res.decisions) == [NEW] * len(ks), list(res.decisions)
    slots = slots_of(res.slots)
    for k, slot in zip(ks, slots, strict=True):
        view.write(slot, pattern(k))
    assert client.commit(res.store_id), "one rank: the commit makes the keys visible"
    return slots


def fill(client: Client, view: PoolFile) -> dict[int, int]:
    """The state a dead sidecar leaves: COMMITTED stored (with their bytes), PINNED pinned,
    RESERVED reserved and half written. Returns key -> slot for every key it touched."""
    slot_of: dict[int, int] = {}
    for i in range(0, len(COMMITTED), 10):
        batch = COMMITTED[i : i + 10]
        slot_of.update(zip(batch, store_written(client, view, batch), strict=True))
    pin = client.reserve_load(keys(*PINNED))
    assert pin.pin_id and slots_of(pin.slots) == [slot_of[k] for k in PINNED]
    res = client.reserve_store(keys(*RESERVED))
    assert list(res.decisions) == [NEW] * len(RESERVED)
    for k, slot in zip(RESERVED, slots_of(res.slots), strict=True):
        view.write(slot, pattern(k)[: SLOT_BYTES // 2])  # the copy was cut off mid-slot
        slot_of[k] = slot
    ns = client.namespace_stats()
    assert (ns.committed_slots, ns.reserved_slots, ns.pinned_slots) == (40, 5, 10), ns
    return slot_of


def assert_adopted(
    client: Client, view: PoolFile, slot_of: dict[int, int], committed: list[int]
) -> None:
    """Every key of `committed` hits in its old slot with its bytes; no RESERVED key is visible.
    Pins the committed keys (their pin is left to the caller's client)."""
    assert client.lookup(keys(*committed)) == [len(committed)]
    assert client.lookup(*(keys(k) for k in RESERVED)) == [0] * len(RESERVED)
    pin = client.reserve_load(keys(*committed))
    assert pin.pin_id
    assert slots_of(pin.slots) == [slot_of[k] for k in committed], "adopted into other slots"
    changed = [k for k in committed if view.read(slot_of[k]) != pattern(k)]
    assert not changed, f"bytes of keys {changed} changed across the restart"


def nonzero(discarded: object) -> dict[str, int]:
    return {k: int(v) for k, v in dict(discarded).items() if v}  # type: ignore[call-overload]


def metric(text: str, name: str, **labels: str) -> float:
    """The value of sample `name{labels}` in a Prometheus text exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    raise AssertionError(f"no sample {name}{labels or ''} in /metrics:\n{text[-3000:]}")


def test_sigkill_restart_adopts_committed_blocks_only(sidecar: Sidecar, pool_dir: Path) -> None:
    with sidecar.client() as client:
        wait_ready(client)
        reg = client.register()
        view = PoolFile(reg, pool_dir)
        slot_of = fill(client, view)
        before = client.stats()
        assert before.adoption.outcome == "new", before.adoption  # a fresh pool dir
        owner = client.locks  # its engine's workers live on: they may still copy
        client.locks = []
    inode = view.path.stat().st_ino
    assert sidecar.signal(signal.SIGKILL) == -signal.SIGKILL

    sidecar.start()
    with sidecar.client() as client:
        stats = client.stats()
        a = stats.adoption
        assert a.outcome == "adopted", f"{a}\n{sidecar.log.read_text()[-3000:]}"
        assert a.reason == "" and a.format_version > 0, a
        assert (a.adopted_blocks, a.adopted_namespaces, a.boots) == (len(COMMITTED), 1, 2), a
        assert nonzero(a.discarded_blocks) == {"reserved": len(RESERVED)}, a
        assert 0 <= a.adopt_seconds < 5, a
        assert stats.pool_generation == before.pool_generation
        assert view.path.stat().st_ino == inode, "the pool file was replaced"
        # the adopted namespace is there before anyone registers: no pin, no reservation
        (ns,) = stats.namespaces
        assert ns.namespace_id == reg.namespace_id
        assert (ns.committed_slots, ns.reserved_slots, ns.pinned_slots) == (40, 0, 0), ns
        assert (ns.stored_blocks, ns.live_clients) == (0, 0), ns

        again = client.register()
        assert again.namespace_id == reg.namespace_id
        assert again.committed_blocks == len(COMMITTED)
        assert again.pool_generation == reg.pool_generation
        assert list(again.regions) == list(reg.regions), "the regions moved"
        wait_ready(client)
        assert_adopted(client, view, slot_of, COMMITTED)  # every committed key is pinned now

        # Stores: every slot that was free at death takes one at once ...
        (region,) = again.regions
        at_death = {slot_of[k] for k in RESERVED}
        free_now = region.slot_count - len(COMMITTED) - len(RESERVED)
        fresh = list(range(2000, 2000 + free_now))
        res = client.reserve_store(keys(*fresh))
        assert list(res.decisions) == [NEW] * free_now, bytes(res.decisions).count(NEW)
        got = set(slots_of(res.slots))
        assert not got & (at_death | set(slot_of.values())), sorted(got & set(slot_of.values()))
        # ... the slots reserved at death not while their engine lives (nothing else is free:
        # every committed key is pinned, every other slot reserved), past the hold and the
        # grace and several reaper ticks
        until = time.monotonic() + HOLD_S + GRACE_S + 2
        while time.monotonic() < until:
            held = client.reserve_store(keys(3000))
            assert list(held.decisions) == [NO_SPACE], list(held.decisions)
            time.sleep(0.2)
        for lock in owner:  # every worker of that engine exited: the kernel drops its locks
            lock.release()
        end = time.monotonic() + 10
        while list((late := client.reserve_store(keys(3000))).decisions) != [NEW]:
            assert time.monotonic() < end, "never handed out once its engine was gone"
            time.sleep(0.1)
        assert set(slots_of(late.slots)) <= at_death
        assert client.commit(late.store_id) and client.commit(res.store_id)
        assert client.lookup(keys(3000), keys(*fresh)) == [1, free_now]

    text = sidecar.metrics()
    assert metric(text, "kvoffload_pool_adopted_blocks") == len(COMMITTED)
    assert metric(text, "kvoffload_pool_discarded_blocks", reason="reserved") == len(RESERVED)
    assert metric(text, "kvoffload_pool_adoption_seconds") == pytest.approx(a.adopt_seconds)
    assert metric(text, "kvoffload_pool_boots") == 2
    info = {"generation": before.pool_generation, "outcome": "adopted"}
    assert metric(text, "kvoffload_pool_info", **info) == 1


def test_sigterm_keeps_the_pool_for_the_next_sidecar(sidecar: Sidecar, pool_dir: Path) -> None:
    """A graceful stop (an upgrade, a node drain that restarts the container) keeps the file."""
    with sidecar.client() as client:
        wait_ready(client)
        reg = client.register()
        view = PoolFile(reg, pool_dir)
        slot_of = dict(zip(COMMITTED, store_written(client, view, COMMITTED), strict=True))
        generation = client.stats().pool_generation
    assert sidecar.signal(signal.SIGTERM) == 0
    assert view.path.exists(), "SIGTERM removed the pool file"

    sidecar.start()
    with sidecar.client() as client:
        a = client.stats().adoption
        assert (a.outcome, a.adopted_blocks, a.boots) == ("adopted", len(COMMITTED), 2), a
        assert nonzero(a.discarded_blocks) == {}, a
        assert client.register().pool_generation == generation
        wait_ready(client)
        assert_adopted(client, view, slot_of, COMMITTED)


def test_five_kills_in_a_row_keep_every_block(sidecar: Sidecar, pool_dir: Path) -> None:
    """Each round stores 8 more keys, then the sidecar is SIGKILLed: the next one adopts all of
    them (the earlier rounds' too), in the same slots with the same bytes."""
    slot_of: dict[int, int] = {}
    stored: list[int] = []
    generation = ""
    for boot in range(1, 7):
        with sidecar.client() as client:
            stats = client.stats()
            a = stats.adoption
            if boot == 1:
                assert a.outcome == "new", a
                generation = stats.pool_generation
            else:
                assert (a.outcome, a.adopted_blocks, a.boots) == ("adopted", len(stored), boot), (
                    f"boot {boot}: {a}"
                )
                assert stats.pool_generation == generation
            reg = client.register()
            view = PoolFile(reg, pool_dir)
            wait_ready(client)
            if stored:
                assert_adopted(client, view, slot_of, stored)
            batch = list(range(100 * boot, 100 * boot + 8))
            slot_of.update(zip(batch, store_written(client, view, batch), strict=True))
            stored += batch
        if boot < 6:
            sidecar.signal(signal.SIGKILL)
            sidecar.start()


# The pool header as persist.py documents it: the file's last 4 KiB; magic, u32 format version,
# ... (48 bytes of fields, little-endian), then at +64 an 8-byte blake2b of those fields.
HEADER_BYTES = 4096
POOL_MAGIC = b"KVOFFPL\x00"
HEADER_FIELDS = 48
CHECK_AT = 64


def claim_format_version(pool_file: Path, version: int) -> None:
    """Rewrite the header as a newer sidecar would have written it: its version, a valid check."""
    with open(pool_file, "r+b") as f, mmap.mmap(f.fileno(), 0) as mm:
        at = len(mm) - HEADER_BYTES
        assert mm[at : at + 8] == POOL_MAGIC, "no pool header where persist.py documents it"
        fields = bytearray(mm[at : at + HEADER_FIELDS])
        struct.pack_into("<I", fields, 8, version)
        mm[at : at + HEADER_FIELDS] = bytes(fields)
        check = hashlib.blake2b(bytes(fields), digest_size=8).digest()
        mm[at + CHECK_AT : at + CHECK_AT + 8] = check


def test_a_future_format_version_is_discarded_with_its_reason(
    sidecar: Sidecar, pool_dir: Path
) -> None:
    """A pool file written by a newer sidecar (a rollback after an upgrade) is not read: the
    start says why, serves an empty pool at once, and writes its own format from then on."""
    with sidecar.client() as client:
        wait_ready(client)
        reg = client.register()
        view = PoolFile(reg, pool_dir)
        store_written(client, view, COMMITTED)
        generation = client.stats().pool_generation
    inode = view.path.stat().st_ino
    sidecar.signal(signal.SIGKILL)
    claim_format_version(view.path, 99)

    sidecar.start()
    with sidecar.client() as client:
        stats = client.stats()
        a = stats.adoption
        assert (a.outcome, a.format_version, a.adopted_blocks) == ("discarded", 99, 0), a
        assert "v99" in a.reason and "newer" in a.reason, a.reason
        assert stats.pool_generation != generation, "a discarded pool keeps its generation"
        assert stats.degraded_reason == "" and not stats.namespaces, stats
        again = client.register()
        assert again.namespace_id == reg.namespace_id and again.committed_blocks == 0
        assert client.lookup(keys(*COMMITTED)) == [0]
        wait_ready(client)
        end = time.monotonic() + 10  # the dead instance's engine left (its client closed)
        while list((res := client.reserve_store(keys(500))).decisions) != [NEW]:
            assert time.monotonic() < end, list(res.decisions)
            time.sleep(0.1)
        assert client.commit(res.store_id)
    assert view.path.stat().st_ino == inode, "the pool file was replaced"
    assert "v99" in sidecar.log.read_text()

    # the discarded file now carries this sidecar's format: the next restart adopts it
    sidecar.signal(signal.SIGKILL)
    sidecar.start()
    with sidecar.client() as client:
        a = client.stats().adoption
        assert (a.outcome, a.format_version, a.adopted_blocks) == ("adopted", 2, 1), a
        client.register()
        assert client.lookup(keys(500)) == [1] and client.lookup(keys(*COMMITTED)) == [0]
