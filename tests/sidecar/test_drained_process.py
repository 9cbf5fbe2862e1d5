"""A real sidecar SIGKILLed with stores reserved and started again withholds those slots while
their engine lives, and frees them once every rank of that engine reported `Drained` over its
own registration with the new instance (docs/POOL.md, the invariant); a report naming another
instance, or only some of the ranks, frees nothing.

Real sidecar processes on one pool file, the gRPC API and a Session stream; this process holds
the engine's lock bytes as its two ranks' workers would.
"""

from __future__ import annotations

import grpc
import pytest
from kvoffload.v1 import pool_pb2 as pb
from kvoffload_connector.worker.engine_lock import EngineLock
from procs import Client, Session, keys, sidecar_process, socket_dir, spec

pytestmark = [pytest.mark.process, pytest.mark.timeout(120)]

RANKS = 2
SLOT_BYTES = 64 << 10
RESERVED = list(range(1, 4))  # reserved under the first instance, never written
NEW, NO_SPACE = pb.STORE_DECISION_NEW, pb.STORE_DECISION_NO_SPACE


def drained(session: Session, client: Client, rank: int, epoch: int | None = None):
    return session.send(
        drained=pb.DrainedRequest(
            namespace_id=client.namespace_id,
            sidecar_epoch=client.epoch if epoch is None else epoch,
            engine=client.engine,
            rank=rank,
        )
    )


def test_withheld_slots_come_back_once_every_rank_reported_drained(tmp_path):
    pool_dir = tmp_path / "pool"
    pool_dir.mkdir()
    the_spec = spec(tp_size=RANKS)
    with socket_dir() as sock_dir:
        with sidecar_process(pool_dir, sock_dir) as first:
            engine = Client(first.target)
            engine.register(the_spec, num_ranks=RANKS, slot_bytes=SLOT_BYTES)
            res = engine.reserve_store(keys(*RESERVED))
            assert list(res.decisions) == [NEW] * len(RESERVED), res
            slot_count = engine.namespace_stats().slot_count
            # the workers keep their locks across the sidecar's death (they are alive)
            workers = [EngineLock(lock.path, lock.offset) for lock in engine.locks]
            old_epoch = engine.epoch
            first.proc.kill()
            first.proc.wait(timeout=10)
        with sidecar_process(pool_dir, sock_dir) as second:
            engine.channel.close()
            engine.__init__(second.target, engine=engine.engine)
            engine.register(the_spec, num_ranks=RANKS, slot_bytes=SLOT_BYTES)
            assert engine.epoch != old_epoch
            ns = engine.namespace_stats()
            assert (ns.withheld_slots, ns.reserved_slots) == (len(RESERVED), 0), ns
            session = Session(engine)
            try:
                assert session.send(attach=pb.AttachRequest(client_id=engine.client_id))
                stale = drained(session, engine, 0, epoch=old_epoch)
                assert stale.WhichOneof("result") == "error", stale
                assert stale.error.code == grpc.StatusCode.FAILED_PRECONDITION.value[0], stale
                assert drained(session, engine, 0).drained.freed_slots == 0
                assert engine.namespace_stats().withheld_slots == len(RESERVED)
                # every slot but the withheld ones takes a store while they are out
                fill = list(range(100, 100 + slot_count))
                got = list(engine.reserve_store(keys(*fill)).decisions)
                assert got.count(NEW) == slot_count - len(RESERVED), got
                assert drained(session, engine, 1).drained.freed_slots == len(RESERVED)
                assert drained(session, engine, 1).drained.freed_slots == 0  # once
            finally:
                session.close()
            ns = engine.namespace_stats()
            assert ns.withheld_slots == 0, ns
            more = list(engine.reserve_store(keys(*range(1000, 1000 + len(RESERVED)))).decisions)
            assert more == [NEW] * len(RESERVED), more
            engine.close()
            for lock in workers:
                lock.release()
