"""A worker rank's pool memory in node placement: its own description of its tenant's memfd.

In node placement the node agent's Register answer names `tenant_memory` instead of a pool
file: every region's path is empty and its offsets are into that tenant's memfd. Each worker
rank asks `memory.sock`, in the directory of the socket the answer came through, for that
memfd (`common.node_memory`: sealed against resize, of the size the agent says) and gets an
open file description of its own (the agent makes one per answer). Through it the rank maps
its region (`PoolView.open_fd`, registered with CUDA in pieces as a pool file's mapping is),
reads its namespace's slot table (`SlotVersions` over the fd) and holds its engine lock: an OFD
read lock on that description, which the agent's `F_OFD_GETLK` on its own description of the
same memfd sees, and which the kernel drops when the process dies.

The memory is taken on the thread that registers (the client's `accept` hook), never on an
engine step. A registration whose memory cannot be had (nothing at `memory.sock`, a refusal:
PERMISSION_DENIED, UNAVAILABLE; a closed connection; a memfd not sealed or of another size;
regions past its end) fails whole: the client retries it with its backoff, as it retries a
sidecar that is away, and the rank serves without the pool meanwhile. A placement that does
not match the answer (node configured, a pool file answered, or the reverse) fails the same way.

Every registration takes the memfd again. The worker keeps its mapping only when the new answer
names the same pool generation and the memfd is the same one (device and inode), as pod mode
keeps a pool file's mapping only for the same path and generation: an agent restarted beside
the holder gets the same memfd back and adopts its index (same generation), so the mapping
stays; a new memfd holds a new pool under a new generation, and the worker drops the old
mapping (every copy into it finished first) and maps the new one.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvoffload_connector.common.config import ConnectorConfig, Placement
from kvoffload_connector.common.errors import PoolUnavailable
from kvoffload_connector.common.node_memory import NodeMemoryError, receive_tenant_memory
from kvoffload_connector.worker.engine_lock import EngineLock
from kvoffload_connector.worker.pool_view import PoolView
from kvoffload_connector.worker.slot_versions import SlotVersions

if TYPE_CHECKING:
    from kvoffload_connector.common.pool_replies import RankRegion, RegisterResult

__all__ = ["MEMORY_SOCKET", "TenantAttach", "TenantMemory"]

log = logging.getLogger(__name__)

MEMORY_SOCKET = "memory.sock"  # beside the agent's pool.sock in the pod's volume
_KEEP_FETCHED = 2  # memories taken for registrations the step thread has not applied yet


@dataclass
class TenantMemory:
    """This process's description of a tenant's sealed memfd (`fd`, close-on-exec)."""

    tenant: str
    fd: int
    size: int
    key: tuple[int, int]  # (st_dev, st_ino): which memfd, whatever the description

    @classmethod
    def receive(cls, memory_socket: str, tenant: str, timeout_s: float) -> TenantMemory:
        """Ask the agent at `memory_socket`; NodeMemoryError (refused, unsealed, another
        size) or OSError (nothing answers there)."""
        fd, size = receive_tenant_memory(memory_socket, tenant, timeout=timeout_s)
        st = os.fstat(fd)
        return cls(tenant, fd, size, (st.st_dev, st.st_ino))

    @property
    def name(self) -> str:
        """What messages call it (it has no path)."""
        return f"memfd:{self.tenant}"

    def check(self, reg: RegisterResult, rank: int) -> None:
        """ValueError unless `rank`'s region and the slot table lie inside the memory."""
        if rank >= len(reg.regions):
            raise ValueError(f"the answer has no region for rank {rank}")
        r = reg.regions[rank]
        end = r.offset + r.slot_bytes * r.slot_count
        if r.path or end > self.size:
            raise ValueError(
                f"rank {rank}'s region [{r.offset}, {end}) path {r.path!r} is not inside "
                f"tenant {self.tenant}'s memory of {self.size} bytes"
            )
        table_end = reg.slot_table_offset + reg.slot_record_bytes * r.slot_count
        if reg.slot_table_offset and table_end > self.size:
            raise ValueError(
                f"the slot table ends at {table_end}, past tenant {self.tenant}'s memory "
                f"of {self.size} bytes"
            )

    def view(self, region: RankRegion) -> PoolView:
        return PoolView.open_fd(
            self.fd, self.name, region.offset, region.slot_bytes, region.slot_count
        )

    def slot_versions(self, reg: RegisterResult, region: RankRegion) -> SlotVersions:
        return SlotVersions(
            self.name, reg.slot_table_offset, reg.slot_record_bytes, region.slot_count, fd=self.fd
        )

    def engine_lock(self, offset: int) -> EngineLock:
        return EngineLock(self.name, offset, fd=self.fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class TenantAttach:
    """A worker rank's side of the Register answer: checks the placement, and in node
    placement takes the tenant's memory for each registration (`accept`, the client's hook,
    on the registering thread) for the step thread to map (`take`). `problem`: why the last
    registration got no memory ("" once one did)."""

    def __init__(self, cfg: ConnectorConfig, rank: int) -> None:
        self.socket = cfg.socket
        self.node = cfg.placement is Placement.NODE
        self.server = "the node agent" if self.node else "the sidecar"
        self.memory_socket = os.path.join(os.path.dirname(cfg.socket), MEMORY_SOCKET)
        self.rank = rank
        self.timeout_s = cfg.rpc_timeout_ms / 1e3
        self.problem = ""
        self._lock = threading.Lock()
        self._fetched: list[tuple[RegisterResult, TenantMemory]] = []
        self._closed = False

    def accept(self, reg: RegisterResult) -> None:
        """PoolUnavailable with the reason when this rank cannot use the answer's memory."""
        if reg.tenant_memory and not self.node:
            raise self._fail(
                f"{self.socket} is a node agent's pool (tenant {reg.tenant_memory}), and "
                "kv_connector_extra_config['placement'] is 'pod': set it to 'node'"
            )
        if not reg.tenant_memory:
            if self.node:
                path = reg.regions[self.rank].path if self.rank < len(reg.regions) else ""
                raise self._fail(
                    f"placement is 'node', but {self.socket} answered a pool file ({path!r}) "
                    "instead of a tenant's memory"
                )
            return
        try:
            memory = TenantMemory.receive(self.memory_socket, reg.tenant_memory, self.timeout_s)
        except NodeMemoryError as e:
            raise self._fail(f"{self.memory_socket} gave no memory of tenant "
                             f"{reg.tenant_memory}: {e}") from None  # fmt: skip
        except OSError as e:
            raise self._fail(f"no answer at {self.memory_socket}: {e}") from None
        try:
            memory.check(reg, self.rank)
        except ValueError as e:
            memory.close()
            raise self._fail(str(e)) from None
        with self._lock:
            if self._closed:
                memory.close()
                raise PoolUnavailable("closed")
            self._fetched.append((reg, memory))
            stale = self._fetched[:-_KEEP_FETCHED]
            del self._fetched[:-_KEEP_FETCHED]
        for _, m in stale:
            m.close()
        if self.problem:
            log.info(
                "kvoffload: rank %d has tenant %s's memory again from %s",
                self.rank,
                reg.tenant_memory,
                self.memory_socket,
            )
        self.problem = ""

    def _fail(self, problem: str) -> PoolUnavailable:
        """Said once per reason (the client retries every backoff period)."""
        if problem != self.problem:
            log.warning("kvoffload: rank %d serves without the pool: %s", self.rank, problem)
        self.problem = problem
        return PoolUnavailable(problem)

    def take(self, reg: RegisterResult) -> TenantMemory | None:
        """The memory `accept` took for `reg` (None for a pool file's answer), now the
        caller's; the ones taken for earlier answers are closed. ValueError when there is none
        (a registration replaced before the step thread applied it)."""
        if not reg.tenant_memory:
            return None
        with self._lock:
            at = next((i for i, (r, _) in enumerate(self._fetched) if r is reg), None)
            if at is None:
                raise ValueError(f"no memory of tenant {reg.tenant_memory} for this registration")
            memory = self._fetched[at][1]
            stale = self._fetched[:at]
            del self._fetched[: at + 1]
        for _, m in stale:
            m.close()
        return memory

    def close(self) -> None:
        with self._lock:
            self._closed = True
            fetched, self._fetched = self._fetched, []
        for _, m in fetched:
            m.close()
