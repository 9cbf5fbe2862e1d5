"""A pod's client of the node agent's slot protocol, run as its own process by the node tests.

It does what the connector's CPU path does in node mode: Register over the pod's `pool.sock`,
take the tenant's memfd from `memory.sock` in the same directory (its own open file
description), hold its engine lock on that description, and copy block bytes in and out of its
own mapping at the offsets the agent handed out. Prints one JSON line per action.

    python slot_client.py DIR register
    python slot_client.py DIR store  --keys 1,2,3 --seed s   # reserve, write, commit
    python slot_client.py DIR load   --keys 1,2,3            # over session.sock: pin, read, check
    python slot_client.py DIR hold   --keys 1,2              # reserve, lock held until killed
    python slot_client.py DIR lookup --keys 1,2,3

DIR is the pod's volume as the pod sees it (a short link to the published directory: a real
pod mounts it at /var/run/kvoffload).
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import socket
import struct
import sys
import time

import grpc
from kvoffload.v1 import pool_pb2 as pb
from kvoffload.v1 import pool_pb2_grpc as pb_grpc
from kvoffload_connector.common.node_memory import open_tenant_memory
from kvoffload_connector.worker.engine_lock import lock_offset

KEY_SIZE = 32
SLOT_BYTES = 64 << 10
_FLOCK = struct.Struct("@hhqqi4x")
_F_OFD_SETLK = getattr(fcntl, "F_OFD_SETLK", 37)
NEW = 1


def key(i: int) -> bytes:
    return i.to_bytes(KEY_SIZE, "big")


def block(seed: str, i: int) -> bytes:
    """The bytes stored for key `i` (one slot): a digest repeated."""
    unit = hashlib.sha256(f"{seed}:{i}".encode()).digest()
    return (unit * (SLOT_BYTES // len(unit)))[:SLOT_BYTES]


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def block_hash(i: int) -> bytes:
    """The vLLM block hash key `i`'s announce blob carries."""
    return hashlib.sha256(f"block-hash:{i}".encode()).digest()


def announce(i: int) -> bytes:
    """Key `i`'s blob as the connector's `announce_blob` encodes it: version, group, block
    size, the chunk's block hashes, parent, tokens, LoRA id and name, extra keys, epoch."""
    import msgspec

    tokens = list(range(i * 16, i * 16 + 16))
    parent = block_hash(i - 1) if i > 1 else None
    return msgspec.msgpack.encode(
        [1, 0, 16, [block_hash(i)], parent, tokens, None, None, None, b""]
    )


def spec(model: str) -> pb.NamespaceSpec:
    return pb.NamespaceSpec(
        model=model,
        dtype="bfloat16",
        kv_layout="LBHNC/packed-kv",
        block_size=16,
        chunk_blocks=1,
        tp_size=1,
        hash_algo="sha256",
        key_size=KEY_SIZE,
    )


def u32s(raw: bytes) -> list[int]:
    return list(struct.unpack(f"<{len(raw) // 4}I", raw))


def u64s(raw: bytes) -> list[int]:
    return list(struct.unpack(f"<{len(raw) // 8}Q", raw))


class Pod:
    def __init__(self, directory: str, tenant: str, model: str, engine: int) -> None:
        self.dir = directory
        self.channel = grpc.insecure_channel(f"unix:{directory}/pool.sock")
        self.stub = pb_grpc.KVPoolStub(self.channel)
        self.engine = engine
        self.reg = self.stub.Register(
            pb.RegisterRequest(
                spec=spec(model),
                num_ranks=1,
                slot_bytes_per_rank=SLOT_BYTES,
                client_name="node-test/rank-0",
                engine=engine,
            ),
            timeout=10,
            wait_for_ready=True,
        )
        # the memory the answer names, from memory.sock beside the socket it came through
        self.memory = open_tenant_memory(f"{directory}/memory.sock", self.reg.tenant_memory)
        assert tenant == self.reg.tenant_memory, (tenant, self.reg.tenant_memory)

    def wait_ready(self, deadline_s: float = 30.0) -> None:
        """Until every slot is behind the pre-fault (stores before it would find none)."""
        end = time.monotonic() + deadline_s
        while not self.stub.Stats(pb.StatsRequest(), timeout=10).pool_ready:
            assert time.monotonic() < end, "the tenant's pool did not become ready"
            time.sleep(0.05)

    def lock(self) -> None:
        """This rank's engine lock, on this process's own description of the memfd."""
        at = lock_offset(self.reg.engine_lock_base, self.engine, 0)
        fcntl.fcntl(self.memory.fd, _F_OFD_SETLK, _FLOCK.pack(fcntl.F_RDLCK, 0, at, 1, 0))

    def slot_range(self, slot: int) -> tuple[int, int]:
        r = self.reg.regions[0]
        start = r.offset + slot * r.slot_bytes
        return start, start + r.slot_bytes

    def version(self, slot: int) -> int:
        at = self.reg.slot_table_offset + slot * self.reg.slot_record_bytes
        return struct.unpack_from("<Q", self.memory.buffer, at)[0]

    def packed(self, keys: list[int]) -> bytes:
        return b"".join(key(i) for i in keys)


def framed(directory: str, name: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(f"{directory}/{name}")
    return s


def call(s: socket.socket, request: pb.SessionRequest) -> pb.SessionResponse:
    body = request.SerializeToString()
    s.sendall(struct.pack("<I", len(body)) + body)
    head = b""
    while len(head) < 4:
        head += s.recv(4 - len(head))
    (size,) = struct.unpack("<I", head)
    data = b""
    while len(data) < size:
        data += s.recv(size - len(data))
    return pb.SessionResponse.FromString(data)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("dir")
    p.add_argument("action", choices=("register", "store", "load", "hold", "lookup"))
    p.add_argument("--tenant", required=True)
    p.add_argument("--keys", default="")
    p.add_argument("--seed", default="s")
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--engine", type=int, default=0)
    p.add_argument("--no-lock", action="store_true", help="store without the engine lock")
    p.add_argument(
        "--announce", action="store_true", help="send each key's KV-events blob (announce_blob's)"
    )
    ns = p.parse_args()
    keys = [int(k) for k in ns.keys.split(",") if k]
    engine = ns.engine or int.from_bytes(os.urandom(4), "little") + 1
    pod = Pod(ns.dir, ns.tenant, ns.model, engine)
    reg = pod.reg
    out: dict = {
        "tenant_memory": reg.tenant_memory,
        "paths": [r.path for r in reg.regions],
        "offsets": [r.offset for r in reg.regions],
        "slot_count": reg.regions[0].slot_count,
        "session_socket": reg.session_socket,
        "presence_map": reg.presence_map,
        "generation": reg.pool_generation,
        "namespace_id": reg.namespace_id,
        "memory_size": pod.memory.size,
        "memory_ino": os.fstat(pod.memory.fd).st_ino,
        "pid": os.getpid(),
    }
    if ns.action == "lookup":
        req = pb.LookupRequest(
            namespace_id=reg.namespace_id, queries=[pb.KeyList(keys=pod.packed(keys))]
        )
        out["hits"] = list(pod.stub.Lookup(req, timeout=10).hit_counts)[0]
    elif ns.action in ("store", "hold"):
        pod.wait_ready()
        if not ns.no_lock:
            pod.lock()
        res = pod.stub.ReserveStore(
            pb.ReserveStoreRequest(
                namespace_id=reg.namespace_id,
                client_id=reg.client_id,
                keys=pod.packed(keys),
                announce=[announce(k) for k in keys] if ns.announce else [],
            ),
            timeout=10,
        )
        decisions = list(res.decisions)
        slots = u32s(res.slots)
        out.update(decisions=decisions, slots=slots, store_id=res.store_id)
        if ns.action == "hold":
            print(json.dumps(out), flush=True)
            while True:  # the engine dies with its lock held (the test kills it)
                time.sleep(60)
        new = [k for k, d in zip(keys, decisions, strict=True) if d == NEW]
        for k, slot in zip(new, slots, strict=True):
            start, end = pod.slot_range(slot)
            pod.memory.buffer[start:end] = block(ns.seed, k)  # the copy into the pool
        if res.store_id:
            out["visible"] = pod.stub.CommitStore(
                pb.CommitStoreRequest(
                    namespace_id=reg.namespace_id,
                    store_id=res.store_id,
                    rank=0,
                    sidecar_epoch=reg.sidecar_epoch,
                    engine=engine,
                ),
                timeout=10,
            ).visible
    elif ns.action == "load":
        s = framed(ns.dir, reg.session_socket)
        attached = call(
            s, pb.SessionRequest(seq=1, attach=pb.AttachRequest(client_id=reg.client_id))
        )
        assert attached.WhichOneof("result") == "attach", attached
        pin = call(
            s,
            pb.SessionRequest(
                seq=2,
                reserve_load=pb.ReserveLoadRequest(
                    namespace_id=reg.namespace_id, keys=pod.packed(keys)
                ),
            ),
        )
        assert pin.WhichOneof("result") == "reserve_load", pin
        slots = u32s(pin.reserve_load.slots)
        versions = u64s(pin.reserve_load.versions)
        blocks = []
        for slot in slots:
            start, end = pod.slot_range(slot)
            blocks.append(digest(bytes(pod.memory.buffer[start:end])))  # the copy out
        out["versions_held"] = [pod.version(s) for s in slots] == versions
        out.update(slots=slots, digests=blocks, pin_id=pin.reserve_load.pin_id)
        if pin.reserve_load.pin_id:
            released = call(
                s,
                pb.SessionRequest(
                    seq=3,
                    release=pb.ReleaseRequest(
                        namespace_id=reg.namespace_id, pin_ids=[pin.reserve_load.pin_id]
                    ),
                ),
            )
            out["released"] = released.release.released_slots
        s.close()
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
