"""In-process wiring of the real sidecar and the real connector halves, without gRPC or a GPU.

What runs for real: `Pool` on a real pool file (tmpfs), the sidecar's `PoolServicer` (its
session protocol: attach, in-session calls, `end_session` when a transport ends), the
connector's `PoolClient` (every call's encoding and decoding, `ensure`), `OffloadScheduler`,
`PoolLookup`, and `OffloadWorker` with a real `PoolView` mapping of the pool file.

What is replaced, and how:
- the transport: `InProcessSession` hands each `SessionRequest` to the servicer in-process;
  ending it is what the server sees when a stream ends (`end_session`: the client detaches).
- the RPC threads: `ManualRpc` queues calls until the model checker runs them.
- the transfer engine: `StepEngine` copies bytes between a dict of GPU blocks and the pool
  file only when the checker says so (`copy`), and reports completion at the next poll.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvoffload.v1 import pool_pb2 as pb
from kvoffload_connector.client import Backoff, PoolClient, RankRegion, RegisterResult
from kvoffload_connector.errors import PoolUnavailable
from kvoffload_connector.session import OrderedSession
from kvoffload_connector.transfer import Direction, JobResult
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


class Sidecar:
    """One sidecar process at a time on one pool directory: `kill` then `start` is a restart
    that adopts the pool file (a new `Pool` on the same file)."""

    def __init__(self, settings: PoolSettings, clock: FakeClock) -> None:
        self.settings = settings
        self.clock = clock
        self.pool: Pool | None = None
        self.servicer: PoolServicer | None = None
        self.sessions: list[InProcessSession] = []
        self.boots = 0

    def start(self) -> None:
        self.pool = Pool(self.settings, clock=self.clock)
        self.pool.start()
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
            self.servicer.end_session(self.client_id)
            self.servicer.session_closed()

    def die(self) -> None:
        """The sidecar process died under the session."""
        self._mark_ended()

    def close(self) -> None:
        self.end()


class InProcessClient(PoolClient):
    """The real `PoolClient` with registration and the session in-process."""

    def __init__(self, sidecar: Sidecar, client_name: str) -> None:
        super().__init__(f"inproc:{client_name}", client_name, keep_attached=False)
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
        spec, num_ranks, slot_bytes = self._register_args
        self._close_channel()
        servicer = self.sidecar.servicer
        try:
            if servicer is None:
                raise PoolUnavailable("register: the sidecar is down")
            resp = pb.RegisterResponse()
            request = pb.RegisterRequest(
                spec=spec.to_proto(),
                num_ranks=num_ranks,
                slot_bytes_per_rank=slot_bytes,
                client_name=self.client_name,
            )
            try:
                servicer._register(request, 0, resp)
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
        self.registration = RegisterResult(
            namespace_id=resp.namespace_id,
            client_id=resp.client_id,
            regions=tuple(
                RankRegion(r.rank, r.path, r.offset, r.slot_bytes, r.slot_count)
                for r in resp.regions
            ),
            pool_ready=resp.pool_ready,
            committed_blocks=resp.committed_blocks,
            generation=resp.pool_generation,
        )
        return self.registration

    def lose_session(self) -> None:
        """A call outlived its deadline: the client dropped the session."""
        if self._session is not None:
            self._session.close()

    def lose_next_answer(self) -> None:
        if self._session is not None and self._session.alive:
            self._session.lose_next_answer = True  # type: ignore[union-attr]


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
