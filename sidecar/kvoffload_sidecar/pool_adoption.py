"""Reading back the index a dead sidecar left in the pool file (or starting a new generation),
and the fence on writers of a file's earlier contents.

Methods of `Pool` (pool.py composes them); each runs under, or takes, `self._lock` as the
pool's thread contract says. Imports only pool_state and pool_types.
"""

from __future__ import annotations

import logging
import secrets
import time

from kvoffload_sidecar import persist
from kvoffload_sidecar.allocator import FreeSlots
from kvoffload_sidecar.engine_locks import (
    GEN_SPAN,
    LOCK_BASE,
    LOCK_END,
    generation_base,
)
from kvoffload_sidecar.events import EventLog
from kvoffload_sidecar.index import SlotIndex
from kvoffload_sidecar.keys import split_keys
from kvoffload_sidecar.persist import Adoption, NamespaceLayout, SlotTable
from kvoffload_sidecar.policies.base import consume
from kvoffload_sidecar.pool_state import NamespaceState
from kvoffload_sidecar.pool_types import RankRegion
from kvoffload_sidecar.tenants import TenantPolicy

log = logging.getLogger("kvoffload_sidecar.pool")


class PoolAdoption:
    """`Pool`'s adoption part (pool.py)."""

    def _open_index(self) -> None:
        """Lock held, file mapped: adopt the index the sidecar before us left in the file
        (persist.py), or start a new one. Sets `generation` and `adoption`."""
        t0 = time.perf_counter()
        region, geom = self._region, self._geometry
        buf = region.buffer
        found = persist.read_header(buf, geom) if region.reused else None
        grace = self.settings.detach_grace_s
        tenants = self.settings.tenants
        # the codes index tenant names in order: shares and salts may change, names may not
        digest = persist.tenants_digest("\n".join(tenants.names) if tenants is not None else None)
        if found is not None and found.problem is None:
            self.generation = found.generation
            self.lock_base = generation_base(self.generation)
            adoption = Adoption("adopted", "", found.format_version, boots=found.boots + 1)
            persist.count_boot(buf, geom, adoption.boots)
            # the records' tenant codes index the --tenants recorded here: another one (or none)
            # means they say nothing of this one's tenants
            self._tenant_codes_valid = persist.read_tenants(buf, geom) == digest
            for partition in range(geom.max_namespaces):
                layout = persist.read_namespace(buf, geom, partition, self.generation)
                if isinstance(layout, str):
                    log.warning("partition %d: namespace not adopted: %s", partition, layout)
                    adoption.add_discards({"namespace": 1})
                elif layout is not None:
                    self._adopt_namespace(layout, adoption)
            # Slots reserved at death stay withheld until their engine is dead. Loads of the
            # dead instance's pins check their slots' versions; sparing adopted blocks from
            # eviction for the grace only keeps those loads from failing needlessly.
            self._evict_from = self._started_at + grace
        else:
            if found is None:
                adoption = Adoption("new", "no pool file was left: created one")
            elif found.format_version == 0 and region.path is None:
                # a memfd no agent wrote an index into (it is zero-filled when made); its
                # writers, should a pod have written anyway, are fenced as after a discard
                adoption = Adoption("new", f"{region.name} held no pool index: started one")
                self._writers_clear = False
            else:
                adoption = Adoption("discarded", found.problem or "", found.format_version)
                # Workers of the file's earlier contents may still copy into it: no slot goes
                # to a store until none holds a lock outside the new generation's range.
                self._writers_clear = False
            self._new_generation()
            persist.write_header(buf, geom, self.generation)
        persist.write_tenants(buf, geom, digest)  # the adopted records now agree with it
        adoption.seconds = time.perf_counter() - t0
        self.adoption = adoption
        if adoption.outcome == "adopted":
            log.warning(
                "adopted %s (boot %d, generation %s): %d committed blocks in %d "
                "namespace(s) in %.3f s; not adopted: %s",
                region.name,
                adoption.boots,
                self.generation,
                adoption.adopted_blocks,
                adoption.adopted_namespaces,
                adoption.seconds,
                adoption.discarded or "none",
            )
        elif adoption.outcome == "discarded":
            log.warning(
                "discarded the contents of %s: %s; stores start once the "
                "workers of its earlier contents drained or exited",
                region.name,
                adoption.reason,
            )

    def _new_generation(self) -> None:
        """Lock held: a fresh generation whose engine-lock range nobody holds (so every lock
        outside it is an earlier generation's writer)."""
        while True:
            self.generation = secrets.token_hex(8)
            self.lock_base = generation_base(self.generation)
            if not self._liveness(self.lock_base, GEN_SPAN):
                return

    def _earlier_writers(self) -> bool:
        """Lock held: some worker still holds an engine lock of another generation (it may
        still copy into this file's slots)."""
        if self._writers_clear:
            return False
        base, end = self.lock_base, self.lock_base + GEN_SPAN
        if self._liveness(LOCK_BASE, base - LOCK_BASE) or self._liveness(end, LOCK_END - end):
            return True
        self._writers_clear = True
        log.info("no worker of the pool file's earlier contents is left: stores start")
        return False

    def _adopt_namespace(self, layout: NamespaceLayout, adoption: Adoption) -> None:
        """Lock held: a namespace read back from the file, with its committed blocks."""
        table = SlotTable(self._region.buffer, layout)
        scan = table.scan()
        withheld = scan.withheld  # until each slot's owner is dead (`_reclaim_dead_engines`)
        spec = layout.spec
        index = SlotIndex(layout.slot_count, layout.num_ranks, spec.key_size)
        index.adopt(scan.packed, scan.slots)
        policy = self._new_policy(layout.slot_count)
        n = len(scan.slots)
        adopted = split_keys(scan.packed, spec.key_size, max_keys=max(n, 1))
        insert_many = getattr(policy, "insert_many", None)  # optional: LRU has a C-speed one
        if not self._tenant_codes_valid and scan.tenants.any():
            table.forget_tenants(scan.slots)  # they indexed another --tenants: default now
            scan.tenants[:] = 0
        if isinstance(policy, TenantPolicy):  # each block back to the tenant that stored it
            policy.adopt(adopted, scan.tenants.tolist())
        elif insert_many is not None:
            insert_many(adopted)
        else:
            consume(map(policy.insert, adopted))
        ns = NamespaceState(
            namespace_id=layout.namespace_id,
            spec=spec,
            num_ranks=layout.num_ranks,
            slot_bytes_per_rank=layout.slot_bytes_per_rank,
            partition=layout.partition,
            regions=self._regions_of(layout),
            index=index,
            free=FreeSlots.adopted(layout.slot_count, scan.slots, withheld),
            policy=policy,
            last_used=self._clock(),
            layout=layout,
            table=table,
            withheld=withheld,
            withheld_owners=scan.withheld_owners,
            events=EventLog(layout.slot_count, self._clock),
            tenants=policy if isinstance(policy, TenantPolicy) else None,
        )
        self._partitions[layout.partition] = ns.namespace_id
        self._namespaces[ns.namespace_id] = ns
        self._commit_seq = max(self._commit_seq, scan.max_seq + 1)
        adoption.adopted_blocks += n
        adoption.adopted_namespaces += 1
        adoption.add_discards(scan.discarded)
        self._set_prefault_priority()
        self._update_ready(ns)

    def _regions_of(self, layout: NamespaceLayout) -> tuple[RankRegion, ...]:
        # a memfd has no path: the client maps the one it received (node mode)
        path = "" if self._region.path is None else str(self._region.path)
        return tuple(
            RankRegion(
                r, path, layout.rank_offset(r), layout.slot_bytes_per_rank, layout.slot_count
            )
            for r in range(layout.num_ranks)
        )
