"""In-process wiring of the real sidecar and the real connector halves, without gRPC or a GPU.

What runs for real: `Pool` on a real pool file (tmpfs), the sidecar's `PoolServicer` (its
session protocol: attach, in-session calls, `end_session` when a transport ends), the
connector's `PoolClient` (every call's encoding and decoding, `ensure`), `OffloadScheduler`,
`PoolLookup`, and `OffloadWorker` with a real `PoolView` mapping of the pool file.

What is replaced, and how:
- the transport: `InProcessSession` hands each `SessionRequest` to the servicer in-process;
  ending it is what the server sees when a stream ends (`end_session`: the client detaches).
- registration: `InProcessClient._register` sends `PoolClient`'s own `RegisterRequest` (the
  engine key) and reads the answer with `RegisterResult.from_response` (epoch, engine, lock
  base, slot table), calling the servicer's handler instead of the gRPC stub.
- engine liveness: the worker and the other engine take real OFD locks on the pool file
  (`EngineLock`), and the pool probes them with its real `FileLocks` through `ModelLiveness`
  (the injectable `liveness` hook), which a `Broken` switch can override.
- the RPC threads: `ManualRpc` queues calls until the model checker runs them.
- the transfer engine: `StepEngine` copies bytes between a dict of GPU blocks and the pool
  file only when the checker says so (`copy`), and reports completion at the next poll.
"""

from __future__ import annotations

import collections
import contextlib
import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvoffload.v1 import pool_pb2 as pb
from kvoffload_connector.common.client import Backoff, PoolClient, RegisterResult
from kvoffload_connector.common.errors import PoolUnavailable
from kvoffload_connector.common.session import OrderedSession
from kvoffload_connector.worker.engine_lock import EngineLock, lock_offset
from kvoffload_connector.worker.transfer import Direction, JobResult
from kvoffload_sidecar.engine_locks import ENGINE_SHIFT, MAX_ENGINE, FileLocks
from kvoffload_sidecar.metrics import SidecarMetrics
from kvoffload_sidecar.pool import Pool, PoolSettings
from kvoffload_sidecar.server import PoolServicer


class FakeClock:
    """The sidecar's and the scheduler's clock: time moves only when the checker says."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class ManualRpc:
    """Stands in for `RpcThread`: calls wait in order until `run_one`/`run_all`."""

    def __init__(self) -> None:
        self.queue: collections.deque[Callable[[], object]] = collections.deque()

    def submit(self, fn: Callable[[], object]) -> None:
        self.queue.append(fn)

    def run_one(self) -> None:
        fn = self.queue.popleft()
        with contextlib.suppress(Exception):  # RpcThread logs and drops a call that raises
            fn()

    def run_all(self) -> None:
        while self.queue:
            self.run_one()

    def drain(self, timeout_s: float = 0.0) -> bool:
        self.run_all()
        return True

    def close(self, timeout_s: float = 0.0) -> None:
        self.queue.clear()


class Broken(enum.Flag):
    """Protocol guarantees a negative control switches off (the checker must then fail).

    NO_VERSION_CHECK: the worker does not re-read its load's slot versions after the copy.
    TIMER_RECLAIM: an engine counts as dead once the grace has passed since one of its
    sessions ended (reservations reclaimed by a timer, as if they rested on the session).
    EARLY_DRAINED: the worker reports drained as soon as it registers with a new sidecar
    instance, with a store copy into the dead instance's reservation still in flight."""

    NONE = 0
    NO_VERSION_CHECK = enum.auto()
    TIMER_RECLAIM = enum.auto()
    EARLY_DRAINED = enum.auto()


def break_worker(worker, broken: Broken) -> None:
    """Apply the worker-side switches to an `OffloadWorker` (NO_VERSION_CHECK: every load's
    versions "still hold" after its copy; EARLY_DRAINED: the drained report skips its wait for
    the copies in flight)."""
    if Broken.NO_VERSION_CHECK in broken:
        worker._versions_held = lambda job_id: True
    if Broken.EARLY_DRAINED in broken:

        def report_at_once() -> None:
            reg, engine = worker._applied, worker._engine_key
            if reg is None or not reg.epoch or not engine or worker._drained_epoch == reg.epoch:
                return
            worker._drained_epoch = epoch = reg.epoch
            ns, rank = reg.namespace_id, worker.rank
            worker._rpc.submit(lambda: worker._send_drained(ns, epoch, engine, rank))

        worker._report_drained = report_at_once


class ModelLiveness:
    """The pool's `liveness` hook: the real `F_OFD_GETLK` probe of the pool file, unless the
    `TIMER_RECLAIM` switch declares an engine dead by the clock."""

    def __init__(self, sidecar: Sidecar) -> None:
        self.sidecar = sidecar
        self.real = FileLocks(lambda: sidecar.pool._region._fd if sidecar.pool else -1)

    def __call__(self, start: int, length: int) -> bool:
        sc = self.sidecar
        pool = sc.pool
        if Broken.TIMER_RECLAIM in sc.broken and pool is not None and length <= 256:
            engine = (start - pool.lock_base) >> ENGINE_SHIFT
            lost = sc.engine_detached_at.get(engine)
            expired = lost is not None and sc.clock() - lost >= pool.settings.detach_grace_s
            if 0 < engine < MAX_ENGINE and expired:
                return False
        return self.real(start, length)


class Sidecar:
    """One sidecar process at a time on one pool directory: `kill` then `start` is a restart
    that adopts the pool file (a new `Pool` on the same file)."""

    def __init__(self, settings: PoolSettings, clock: FakeClock, broken: Broken = Broken.NONE):
        self.settings = settings
        self.clock = clock
        self.broken = broken
        self.pool: Pool | None = None
        self.servicer: PoolServicer | None = None
        self.sessions: list[InProcessSession] = []
        self.boots = 0
        self.epochs: list[int] = []  # every instance's epoch, in boot order
        # TIMER_RECLAIM: per engine key, when a session of one of its clients last ended
        self.engine_detached_at: dict[int, float] = {}
        self.liveness = ModelLiveness(self)

    def start(self) -> None:
        self.pool = Pool(self.settings, clock=self.clock, liveness=self.liveness)
        self.pool.start()
        self.epochs.append(self.pool.epoch)
        self.servicer = PoolServicer(self.pool, SidecarMetrics(self.pool))
        self.boots += 1

    def kill(self) -> None:
        """The process dies: every session ends with it (nobody detaches anything)."""
        for s in self.sessions:
            s.die()
        self.sessions.clear()
        if self.pool is not None:
            self.pool.close()
        self.pool = self.servicer = None

    def reap(self) -> None:
        """The reaper's tick (runtime.reap_forever)."""
        if self.pool is not None:
            self.pool.reap_idle_clients()
            if Broken.TIMER_RECLAIM in self.broken:  # the timer fired once: forget it
                grace, now = self.settings.detach_grace_s, self.clock()
                for engine, t in list(self.engine_detached_at.items()):
                    if now - t >= grace:
                        del self.engine_detached_at[engine]

    @property
    def path(self) -> Path:
        return self.settings.pool_dir / "pool-0.shm"


class InProcessSession(OrderedSession):
    """A session whose requests the servicer answers in the calling thread."""

    def __init__(self, sidecar: Sidecar, client_id: int) -> None:
        super().__init__()
        assert sidecar.servicer is not None
        self.sidecar = sidecar
        self.servicer = sidecar.servicer
        self.client_id = client_id
        self._answers: dict[int, pb.SessionResponse] = {}
        self.lose_next_answer = False  # the next exchange outlives its deadline
        self.servicer.session_opened()
        first = pb.SessionRequest(seq=0, attach=pb.AttachRequest(client_id=client_id))
        cid, reply = self.servicer.attach_session(first)
        if not cid:
            self.servicer.session_closed()
            self._mark_ended()
            raise PoolUnavailable(f"attach refused: {reply.error.message}")
        sidecar.sessions.append(self)

    def _send(self, requests, deadline, timeout_s):
        if not self.alive:
            raise PoolUnavailable("session closed")
        for r in requests:
            self._answers[r.seq] = self.servicer.session_call(r, self.client_id)
        self.servicer.flush_deferred()
        if self.lose_next_answer:
            # The sidecar did the work, the answer came too late: the client drops the session
            # (client.py's watchdog) and the caller sees a miss.
            self.lose_next_answer = False
            self.end()
            raise PoolUnavailable(f"no answer within {timeout_s * 1e3:.0f} ms")

    def _answer(self, seq, deadline, timeout_s):
        if not self.alive:
            raise PoolUnavailable("session closed")
        return self._answers.pop(seq)

    def end(self) -> None:
        """The transport ends (deadline, close): the server detaches the client."""
        if not self.alive:
            return
        self._mark_ended()
        if self in self.sidecar.sessions:
            self.sidecar.sessions.remove(self)
            pool = self.sidecar.pool
            client = pool._clients.get(self.client_id) if pool is not None else None
            if client is not None:  # Broken.TIMER_RECLAIM's clock starts here
                self.sidecar.engine_detached_at[client.engine] = self.sidecar.clock()
            self.servicer.end_session(self.client_id)
            self.servicer.session_closed()

    def die(self) -> None:
        """The sidecar process died under the session."""
        self._mark_ended()

    def close(self) -> None:
        self.end()


class InProcessClient(PoolClient):
    """The real `PoolClient` with registration and the session in-process."""

    def __init__(self, sidecar: Sidecar, client_name: str, engine: int = 0) -> None:
        super().__init__(f"inproc:{client_name}", client_name, keep_attached=False, engine=engine)
        self.sidecar = sidecar
        self.backoff = Backoff(0.0, 0.0)  # the checker decides when a reconnect happens

    def _open(self):
        self._close_channel()
        return None

    def _close_channel(self) -> None:
        if self._session is not None:
            self._session.close()
            self._session = None

    def _register(self) -> RegisterResult:
        assert self._register_args is not None
        spec = self._register_args[0]
        self._close_channel()
        servicer = self.sidecar.servicer
        try:
            if servicer is None:
                raise PoolUnavailable("register: the sidecar is down")
            resp = pb.RegisterResponse()
            try:
                servicer._register(self._register_request(), 0, resp)
            except Exception as e:  # noqa: BLE001 - the servicer's error table: a status code
                raise PoolUnavailable(f"register: {e}") from None
            self._session = InProcessSession(self.sidecar, resp.client_id)
        except PoolUnavailable:
            self.registration = None
            self.backoff.failed()
            raise
        self.backoff.reset()
        self.key_size = spec.key_size
        self.registrations += 1
        self.registration = RegisterResult.from_response(resp)
        return self.registration

    def lose_session(self) -> None:
        """A call outlived its deadline: the client dropped the session."""
        if self._session is not None:
            self._session.close()

    def lose_next_answer(self) -> None:
        if self._session is not None and self._session.alive:
            self._session.lose_next_answer = True  # type: ignore[union-attr]


class OtherEngine:
    """Another engine of the same model, one rank, in this process: its client, and the rank's
    real engine lock, taken for each registration's lock range before it stores (the sidecar
    grants reservations only then). `die` is its process exiting: the kernel drops the lock."""

    def __init__(self, sidecar: Sidecar, engine: int, spec, slot_bytes: int) -> None:
        self.client = InProcessClient(sidecar, f"other-{engine:x}/rank-0", engine=engine)
        self.client.remember(spec, 1, slot_bytes)  # what ensure() registers with
        self.lock: EngineLock | None = None
        self._locked_for: tuple[str, int] | None = None

    def ready(self) -> bool:
        """Registered, with its lock held for the registration's range."""
        if not self.client.ensure():
            return False
        reg = self.client.registration
        key = (reg.regions[0].path, reg.engine_lock_base)
        if self._locked_for != key:
            self.release()
            self.lock = EngineLock(key[0], lock_offset(key[1], reg.engine, 0))
            self._locked_for = key
        return True

    def commit(self, store_id: int) -> bool:
        reg = self.client.registration
        return self.client.commit_store(
            reg.namespace_id, store_id, 0, epoch=reg.epoch, engine=reg.engine
        )

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()
        self.lock, self._locked_for = None, None

    def die(self) -> None:
        """The process exits mid-store: its sessions end, its lock goes, nothing commits."""
        self.release()
        self.client.lose_session()


@dataclass
class PendingCopy:
    job_id: int
    direction: Direction
    batches: list
    copied: bool = False
    # (gpu block, slot, block index in slot) per block
    blocks: list[tuple[int, int, int]] = field(default_factory=list)


class StepEngine:
    """A transfer engine whose copies run when the checker says (`copy`), on the real mapping.

    GPU memory is `gpu`: block id -> bytes. A STORE copies GPU blocks into their slots of the
    pool file, a LOAD copies the slots' bytes into the GPU blocks; a job is reported done at
    the first `poll` after its copy ran.
    """

    def __init__(self, view, gpu: dict[int, bytes], block_bytes: int) -> None:
        self.view = view
        self.gpu = gpu
        self.block_bytes = block_bytes
        self.pending: dict[int, PendingCopy] = {}
        self.on_copy: Callable[[PendingCopy], bool] | None = None  # False: skip the bytes

    def submit(self, job_id: int, direction: Direction, batches) -> None:
        blocks = [
            (int(g), int(s), int(i))
            for b in batches
            for g, s, i in zip(b.gpu_blocks, b.slots, b.slot_block_index, strict=True)
        ]
        self.pending[job_id] = PendingCopy(job_id, direction, list(batches), blocks=blocks)

    def submit_layered(self, job_id: int, batches) -> None:
        self.submit(job_id, Direction.LOAD, batches)

    def start_layered(self) -> None:
        pass

    def wait_layer(self, layer_name: str) -> None:
        pass

    def wait_all_layers(self) -> None:
        pass

    def new_step(self) -> None:
        pass

    def copy(self, job_id: int) -> None:
        job = self.pending[job_id]
        if job.copied:
            return
        job.copied = True
        if self.on_copy is not None and not self.on_copy(job):
            return
        bb = self.block_bytes
        flat = self.view.tensor
        for gpu, slot, idx in job.blocks:
            lo = idx * bb
            if job.direction is Direction.STORE:
                data = self.gpu.get(gpu, bytes(bb))
                flat[slot, lo : lo + bb] = _tensor(data)
            else:
                self.gpu[gpu] = bytes(flat[slot, lo : lo + bb].numpy().tobytes())

    def _results(self, ids) -> list[JobResult]:
        out = []
        for job_id in ids:
            job = self.pending.pop(job_id)
            out.append(JobResult(job_id, True, len(job.blocks) * self.block_bytes, 0.0))
        return out

    def poll(self) -> list[JobResult]:
        return self._results([j for j, p in self.pending.items() if p.copied])

    def wait(self, job_ids) -> list[JobResult]:
        ids = [j for j in job_ids if j in self.pending]
        for j in ids:
            self.copy(j)
        return self._results(ids)

    def shutdown(self) -> None:
        self.pending.clear()


def _tensor(data: bytes):
    import torch

    return torch.frombuffer(bytearray(data), dtype=torch.uint8)
