"""Registration, namespaces and their partitions, clients' sessions and the reaper of idle
clients.

Methods of `Pool` (pool.py composes them); each runs under, or takes, `self._lock` as the
pool's thread contract says. Imports only pool_state and pool_types.
"""

from __future__ import annotations

import logging

from kvoffload_sidecar import persist
from kvoffload_sidecar.allocator import FreeSlots
from kvoffload_sidecar.engine_locks import MAX_ENGINE
from kvoffload_sidecar.errors import (
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
)
from kvoffload_sidecar.events import EventLog
from kvoffload_sidecar.index import SlotIndex
from kvoffload_sidecar.keys import (
    NamespaceId,
    NamespaceSpec,
    derive_namespace,
)
from kvoffload_sidecar.policies import CachePolicy, make_policy
from kvoffload_sidecar.pool_state import (
    ClientState,
    NamespaceState,
    is_int,
)
from kvoffload_sidecar.pool_types import (
    MAX_CLIENT_NAME,
    SLOT_BYTES_MULTIPLE,
    Registration,
)
from kvoffload_sidecar.tenants import TenantPolicy

log = logging.getLogger("kvoffload_sidecar.pool")


class PoolClients:
    """`Pool`'s clients part (pool.py)."""

    def register(
        self,
        spec: NamespaceSpec,
        num_ranks: int,
        slot_bytes_per_rank: int,
        client_name: str,
        engine: int = 0,
    ) -> Registration:
        """Attach an engine process to the namespace of `spec`, creating it on first use.
        `engine`: the key (1 .. MAX_ENGINE - 1) of the vLLM instance the process belongs to;
        its store reservations belong to that engine and outlive this client (engine_locks.py).
        0: the client is an engine of its own, with a key derived from its id."""
        if not isinstance(spec, NamespaceSpec):
            raise InvalidArgument("spec must be a NamespaceSpec")
        namespace_id = derive_namespace(spec)  # validates the spec
        if not is_int(num_ranks) or not 1 <= num_ranks <= 64:
            raise InvalidArgument(f"num_ranks must be in 1..64, got {num_ranks!r}")
        if num_ranks != spec.tp_size:
            raise InvalidArgument(f"num_ranks {num_ranks} differs from spec.tp_size {spec.tp_size}")
        if (
            not is_int(slot_bytes_per_rank)
            or slot_bytes_per_rank < 1
            or slot_bytes_per_rank % SLOT_BYTES_MULTIPLE
        ):
            raise InvalidArgument(
                f"slot_bytes_per_rank must be a positive multiple of {SLOT_BYTES_MULTIPLE}, "
                f"got {slot_bytes_per_rank!r}"
            )
        if not isinstance(client_name, str) or len(client_name) > MAX_CLIENT_NAME:
            raise InvalidArgument(f"client_name must be a string of at most {MAX_CLIENT_NAME}")
        if not is_int(engine) or not 0 <= engine < MAX_ENGINE:
            raise InvalidArgument(f"engine must be in 0..{MAX_ENGINE - 1}, got {engine!r}")
        with self._lock:
            self._check_serving()
            if not self._region.intact():
                raise Unavailable("the pool file changed under the sidecar; it is being rebuilt")
            now = self._clock()
            ns = self._namespaces.get(namespace_id)
            if ns is not None:
                if (ns.num_ranks, ns.slot_bytes_per_rank) != (num_ranks, slot_bytes_per_rank):
                    raise FailedPrecondition(
                        f"namespace {namespace_id} is registered with {ns.num_ranks} ranks of "
                        f"{ns.slot_bytes_per_rank} slot bytes, not {num_ranks} of "
                        f"{slot_bytes_per_rank}"
                    )
            else:
                ns = self._create_namespace(namespace_id, spec, num_ranks, slot_bytes_per_rank, now)
            client_id = self._next_client
            key = engine or client_id % (MAX_ENGINE - 1) + 1
            client = ClientState(client_id, client_name, namespace_id, last_seen=now, engine=key)
            self._next_client += 1
            self._clients[client.client_id] = client
            ns.clients.add(client.client_id)
            ns.last_used = now
            region = self._region
            return Registration(
                namespace_id=namespace_id,
                client_id=client.client_id,
                regions=ns.regions,
                pool_ready=region.done,
                prefault_fraction=region.prefaulted_bytes / region.size,
                committed_blocks=ns.index.counts.committed,
                pool_generation=self.generation,
                sidecar_epoch=self.epoch,
                engine=key,
                engine_lock_base=self.lock_base,
                slot_table_offset=ns.layout.table_offset,
                slot_record_bytes=ns.layout.record_bytes,
            )

    def _create_namespace(
        self,
        namespace_id: NamespaceId,
        spec: NamespaceSpec,
        num_ranks: int,
        slot_bytes_per_rank: int,
        now: float,
    ) -> NamespaceState:
        geom = self._geometry
        if persist.plan_namespace(geom, 0, spec, num_ranks, slot_bytes_per_rank) is None:
            raise ResourceExhausted(
                f"a partition of {geom.partition_bytes} bytes holds no slot of {num_ranks} x "
                f"{slot_bytes_per_rank} bytes (each rank's region is aligned to {geom.align} "
                "bytes, and the partition keeps its slot table)"
            )
        partition = self._take_partition(now)
        layout = persist.plan_namespace(geom, partition, spec, num_ranks, slot_bytes_per_rank)
        assert layout is not None  # every partition has the same size
        slot_count = layout.slot_count
        table = persist.write_namespace(self._region.buffer, layout, self.generation)
        ns = NamespaceState(
            namespace_id=namespace_id,
            spec=spec,
            num_ranks=num_ranks,
            slot_bytes_per_rank=slot_bytes_per_rank,
            partition=partition,
            regions=self._regions_of(layout),
            index=SlotIndex(slot_count, num_ranks, spec.key_size),
            free=FreeSlots(slot_count),
            policy=self._new_policy(slot_count),
            last_used=now,
            layout=layout,
            table=table,
            events=EventLog(slot_count, self._clock),
        )
        if isinstance(ns.policy, TenantPolicy):
            ns.tenants = ns.policy
        self._partitions[partition] = namespace_id
        self._namespaces[namespace_id] = ns
        self._set_prefault_priority()
        self._update_ready(ns)
        log.info(
            "namespace %s (%s) in partition %d: %d ranks x %d slots of %d bytes",
            namespace_id,
            spec.model,
            partition,
            num_ranks,
            slot_count,
            slot_bytes_per_rank,
        )
        return ns

    def _new_policy(self, slot_count: int) -> CachePolicy:
        """A namespace's eviction policy: per-tenant quotas over one policy per tenant when
        --tenants is set, else one."""
        tenants = self.settings.tenants
        if tenants is None:
            return make_policy(self.settings.eviction, slot_count)
        return TenantPolicy(tenants, self.settings.eviction, slot_count)

    def _take_partition(self, now: float) -> int:
        for i, owner in enumerate(self._partitions):
            if owner is None:
                return i
        idle = [  # a namespace whose engines may still write its slots is not idle
            ns
            for ns in self._namespaces.values()
            if not any(self._is_live(self._clients[c], now) for c in ns.clients)
            and not ns.index.stores
            and not len(ns.withheld)
        ]
        if not idle:
            raise ResourceExhausted(
                f"all {len(self._partitions)} partitions belong to namespaces with live clients"
            )
        victim = min(idle, key=lambda n: n.last_used)
        self._drop_namespace(victim)
        log.info(
            "reclaimed partition %d from idle namespace %s (%d committed blocks dropped)",
            victim.partition,
            victim.namespace_id,
            victim.index.counts.committed,
        )
        return victim.partition

    def _drop_namespace(self, ns: NamespaceState) -> None:
        for cid in ns.clients:
            del self._clients[cid]
        del self._namespaces[ns.namespace_id]
        self._partitions[ns.partition] = None
        self._set_prefault_priority()

    def attach(self, client_id: int) -> None:
        """A session stream opened for this client: it stays live until `detach`."""
        with self._lock:
            client = self._client(client_id)
            client.sessions += 1
            client.last_seen = self._clock()
            client.detached_at = None

    def detach(self, client_id: int) -> None:
        """A session ended. When it was the client's last one: after `detach_grace_s` (at once
        when 0) release its pins and forget it (NotFound if unknown). Its store reservations
        stay with its engine: a client of the same engine that registers again finishes them,
        and they are reclaimed only once the engine is dead (`_reclaim_dead_engines`)."""
        with self._lock:
            client = self._client(client_id)
            client.sessions = max(0, client.sessions - 1)
            if client.sessions == 0:
                if self.settings.detach_grace_s > 0:
                    client.detached_at = self._clock()
                else:
                    self._forget_client(client)

    def reap_idle_clients(self) -> int:
        """Forget clients detached for `detach_grace_s`, or with no session and no call for
        `client_timeout_s`, and reclaim the reservations of dead engines; returns how many
        clients were forgotten."""
        with self._lock:
            now = self._clock()
            if self._evict_from and now >= self._evict_from:
                self._evict_from = 0.0
            idle = [c for c in self._clients.values() if not self._is_live(c, now)]
            for client in idle:
                log.info("reaping idle client %d (%s)", client.client_id, client.name)
                self._forget_client(client)
            self._reclaim_dead_engines()
            return len(idle)

    def _is_live(self, client: ClientState, now: float) -> bool:
        if client.sessions > 0:
            return True
        if client.detached_at is not None:
            return now - client.detached_at < self.settings.detach_grace_s
        return now - client.last_seen < self.settings.client_timeout_s

    def _forget_client(self, client: ClientState) -> None:
        """Lock held: its pins go; its store reservations stay with its engine."""
        ns = self._namespaces[client.namespace_id]
        for pin_id in client.pins:
            ns.index.unpin(pin_id)
        ns.clients.discard(client.client_id)
        del self._clients[client.client_id]
