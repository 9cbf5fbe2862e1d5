"""Store reservations, fenced commits and aborts, and the presence map kept true for every key a
store reserves.

Methods of `Pool` (pool.py composes them); each runs under, or takes, `self._lock` as the
pool's thread contract says. Imports only pool_state and pool_types.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from itertools import compress, repeat
from operator import is_

import numpy as np

from kvoffload_sidecar import allocator, persist
from kvoffload_sidecar.errors import FailedPrecondition
from kvoffload_sidecar.events import check_announce
from kvoffload_sidecar.index import Slots, StoreRecord
from kvoffload_sidecar.keys import (
    PoolKey,
    check_packed,
    split_keys,
)
from kvoffload_sidecar.pool_state import NamespaceState
from kvoffload_sidecar.pool_types import (
    StoreDecision,
    StoreReservation,
)
from kvoffload_sidecar.presence import PresenceMap
from kvoffload_sidecar.tenants import KeySalts

log = logging.getLogger("kvoffload_sidecar.pool")


_NEW, _PRESENT, _NO_SPACE = StoreDecision.NEW, StoreDecision.PRESENT, StoreDecision.NO_SPACE


class PoolStores:
    """`Pool`'s stores part (pool.py)."""

    def reserve_store(
        self,
        namespace_id: str,
        client_id: int,
        keys: bytes,
        announce: Sequence[bytes] = (),
        salts: KeySalts | None = None,
    ) -> StoreReservation:
        """Per key in order: PRESENT if committed or being stored; else NEW with a slot (a free
        ready slot, else one freed by evicting unpinned victims); NO_SPACE once nothing is left,
        and for every key during the quarantine after a reused pool file (`start`).

        `announce`: per key, what KV events say of its block (events.py), or nothing.
        `salts`: the keys' cache salts, for per-tenant quotas (--tenants; tenants.py)."""
        if announce:
            check_announce(announce)
        with self._lock:
            reservation = self._reserve_store(namespace_id, client_id, keys, salts)
            if announce and reservation.store_id:
                self._remember_announce(namespace_id, keys, announce, reservation)
            return reservation

    def _remember_announce(
        self,
        namespace_id: str,
        keys: bytes,
        announce: Sequence[bytes],
        reservation: StoreReservation,
    ) -> None:
        """Lock held: keep the NEW keys' announce blobs with the open store."""
        ns = self._namespaces[namespace_id]
        if ns.events is None:
            return
        key_list = split_keys(keys, ns.spec.key_size)
        new = [i for i, d in enumerate(reservation.decisions) if d == _NEW]
        ns.events.reserved(
            reservation.store_id,
            [key_list[i] for i in new],
            [announce[i] if i < len(announce) else b"" for i in new],
        )

    def _reserve_store(
        self, namespace_id: str, client_id: int, keys: bytes, salts: KeySalts | None = None
    ) -> StoreReservation:
        """Lock held: `reserve_store` without the announce blobs."""
        self._check_serving()
        ns = self._namespace(namespace_id)
        client = self._owned_client(ns, client_id)
        packed, n_keys = check_packed(keys, ns.spec.key_size)
        if self._presence is not None:  # before any key can be committed (presence.py)
            self._mark_present(packed, ns.spec.key_size)
        if self._earlier_writers():  # a worker of the file's earlier contents may still copy
            return StoreReservation(0, (_NO_SPACE,) * n_keys, ())  # a skipped store
        if not self._region.intact():  # the reaper rebuilds the file; writing it is SIGBUS
            return StoreReservation(0, (_NO_SPACE,) * n_keys, ())
        engine = client.engine
        if not self._engine_armed(ns, engine):
            # a rank without its lock could write while the death probe says nobody does
            ns.counters.unlocked_reservations += 1
            return StoreReservation(0, (_NO_SPACE,) * n_keys, ())
        owner = ns.engines[engine]
        index, free, tenants = ns.index, ns.free, ns.tenants
        new_slots = self._reserve_new(ns, packed, n_keys) if tenants is None else None
        if new_slots is not None:  # the usual store: every key new, distinct, slots free
            ns.table.mark(new_slots, persist.RESERVED, self._now_ms(), engine)  # before any byte
            store_id = self._next_store
            self._next_store += 1
            index.open_store_packed(store_id, engine, new_slots, packed)
            owner.stores.add(store_id)
            return StoreReservation(store_id, (_NEW,) * n_keys, new_slots)
        key_list = split_keys(packed, ns.spec.key_size)
        found = index.slots_of(key_list)
        missing = found.count(None)
        if not missing:
            return StoreReservation(0, (_PRESENT,) * len(key_list), ())
        if missing == len(found):
            fresh = key_list
        else:
            fresh = list(compress(key_list, map(is_, found, repeat(None))))
        unique = len(set(fresh)) == len(fresh)
        if not unique:
            fresh = list(dict.fromkeys(fresh))  # first occurrences, in key order
        refused: list[PoolKey] = []
        if tenants is not None:  # quotas: what each tenant may store, room made for it
            fresh, refused, owners = self._admit_tenants(ns, tenants, key_list, fresh, salts)
        shortfall = len(fresh) - free.available()
        if shortfall > 0:
            self._evict(ns, shortfall, self._protected(index, key_list))
        # Eviction only removes keys: `fresh` is still exactly the keys not in the index.
        slots = free.allocate_many(len(fresh))
        stored = fresh if len(slots) == len(fresh) else fresh[: len(slots)]
        slot_list = index.reserve_many(stored, slots, keys_free=True)
        unstored = fresh[len(slots) :]
        decisions = _store_decisions(key_list, stored, unstored + refused, unique)
        store_id = 0
        if slot_list:
            ns.table.mark(slot_list, persist.RESERVED, self._now_ms(), engine)  # before any byte
            store_id = self._next_store
            self._next_store += 1
            index.open_store(store_id, engine, slots, stored)
            owner.stores.add(store_id)
            if tenants is not None:
                tenants.reserve(stored, owners if type(owners) is int else owners[: len(stored)])
        return StoreReservation(store_id, decisions, tuple(slot_list))

    @staticmethod
    def _reserve_new(ns: NamespaceState, packed: bytes, n: int) -> np.ndarray | None:
        """The fast path of `reserve_store` for a large batch of keys that are all new and fit
        in the free slots: allocate, then insert and check in one key-map pass over the packed
        request. The slots when that worked, else None with nothing changed (a key is known or
        repeats, the batch is small, or eviction is needed): the caller takes the general
        path."""
        free = ns.free
        if n <= allocator.VECTOR_MIN or n > free.available():
            return None
        mark = free.mark()
        slots = free.allocate_many(n)
        if not ns.index.reserve_new_packed(packed, slots):
            free.rewind(mark)
            return None
        return slots

    def commit_store(
        self,
        namespace_id: str,
        store_id: int,
        rank: int,
        *,
        epoch: int | None = None,
        engine: int | None = None,
    ) -> bool:
        """Rank `rank` wrote its part of the store. True when every rank has (keys now visible);
        repeating a rank's commit is harmless. `epoch` and `engine` (None: not checked, for
        in-process callers) name the sidecar instance that answered the reservation and the
        engine it belongs to: another one is refused (FailedPrecondition, counted), so a late
        commit can never make another instance's or engine's slots visible."""
        with self._lock:
            ns = self._namespace(namespace_id)
            self._check_id(store_id, "store id")
            self._check_fence(ns, store_id, epoch, engine, "commit")
            record = ns.index.stores.get(store_id)
            keys = ns.index.commit_rank(store_id, rank)
            if keys is None:
                return False
            if record is not None:  # it just completed (else a repeat of a completed store)
                self._apply_touches(ns)
                insert = ns.policy.insert
                for key in keys:
                    insert(key)
                if self._region.intact():  # the commit record: visible after a restart too
                    owners = ns.tenants.codes(keys) if ns.tenants is not None else 0
                    ns.table.commit(record.slots, b"".join(keys), self._commit_seq, owners)
                    self._commit_seq += 1
                ns.counters.stored_blocks += len(keys)
                if ns.events is not None:
                    ns.events.committed(store_id, keys)
                self._store_done(ns, record)
            ns.last_used = self._clock()
            return True

    def _check_fence(
        self, ns: NamespaceState, store_id: int, epoch: int | None, engine: int | None, what: str
    ) -> None:
        """Lock held: FailedPrecondition (counted) for a commit or abort naming another sidecar
        instance, or a store of another engine."""
        if epoch is not None and epoch != self.epoch:
            ns.counters.refused_commits += 1
            raise FailedPrecondition(
                f"{what} of store {store_id} names sidecar instance {epoch:#x}, this is "
                f"{self.epoch:#x} (its reservation died with that instance)"
            )
        record = ns.index.stores.get(store_id)
        if engine is not None and record is not None and record.owner != engine:
            ns.counters.refused_commits += 1
            raise FailedPrecondition(
                f"{what} of store {store_id} by engine {engine}: it belongs to {record.owner}"
            )

    @staticmethod
    def _store_done(ns: NamespaceState, record: StoreRecord) -> None:
        owner = ns.engines.get(record.owner)
        if owner is not None:
            owner.stores.discard(record.store_id)

    def abort_store(
        self,
        namespace_id: str,
        store_id: int,
        *,
        epoch: int | None = None,
        engine: int | None = None,
    ) -> int:
        """Give back an open store reservation; returns the slots freed. Its engine calls it
        once every rank finished (or never started) the store's copies; `epoch` and `engine`
        as for `commit_store`."""
        with self._lock:
            ns = self._namespace(namespace_id)
            self._check_id(store_id, "store id")
            self._check_fence(ns, store_id, epoch, engine, "abort")
            _, slots = self._abort(ns, store_id)
            return len(slots)

    def _abort(self, ns: NamespaceState, store_id: int) -> tuple[StoreRecord | None, Slots]:
        """Lock held: an open store's slots are free again (index, tenants, event log, slot
        table, free list); its record (None when unknown) and the slots freed."""
        record = ns.index.stores.get(store_id)
        slots = ns.index.abort_store(store_id)
        if record is not None:
            self._store_done(ns, record)
        if ns.tenants is not None and record is not None:
            ns.tenants.abort(record.keys or ())  # the abort cut them into `keys`
        if ns.events is not None:
            ns.events.aborted(store_id)
        self._mark_free(ns, slots)
        ns.free.release_many(slots)
        return record, slots

    def _mark_free(self, ns: NamespaceState, slots: Sequence[int] | np.ndarray) -> None:
        """Lock held: aborted store slots are free in the file's table too."""
        if self._region.intact():
            ns.table.mark(slots, persist.FREE)

    def attach_presence(self, presence: PresenceMap) -> None:
        """Keep `presence` (presence.py) true from now on: every live key marked at once (the
        adopted ones too), every key a store reserves marked before it can be committed."""
        with self._lock:
            self._presence = presence
            self._rebuild_presence()

    def _mark_present(self, packed: bytes, key_size: int) -> None:
        """Lock held."""
        presence = self._presence
        assert presence is not None
        # a rebuild marks the index's keys only: it runs before this batch is marked, never
        # after (the batch's new keys are not in the index yet)
        if presence.rebuild_due(sum(ns.index.live_keys() for ns in self._namespaces.values())):
            self._rebuild_presence()
        presence.mark_packed(packed, key_size)

    def _rebuild_presence(self) -> None:
        """Lock held: the live keys of every namespace (reserved or committed) only."""
        if self._presence is not None:
            self._presence.rebuild(
                [
                    (ns.index.live_keys_packed(), ns.spec.key_size)
                    for ns in self._namespaces.values()
                ]
            )


def _store_decisions(
    keys: Sequence[PoolKey], stored: Sequence[PoolKey], unstored: Sequence[PoolKey], unique: bool
) -> tuple[StoreDecision, ...]:
    """Per key: NEW for the first occurrence of a stored key, NO_SPACE for every occurrence of
    a fresh key that got no slot, PRESENT otherwise (in the index already, or a repeat)."""
    if len(stored) == len(keys):
        return (_NEW,) * len(keys)
    decide: dict[PoolKey, StoreDecision] = dict.fromkeys(stored, _NEW)
    if unstored:
        decide.update(dict.fromkeys(unstored, _NO_SPACE))
    if unique:  # one C-level pass: keys outside `decide` are PRESENT
        return tuple(map(decide.get, keys, repeat(_PRESENT)))  # type: ignore[arg-type]
    decisions: list[StoreDecision] = []
    for key in keys:
        decision = decide.get(key, _PRESENT)
        if decision is _NEW:
            decide[key] = _PRESENT  # a repeat of a stored key is PRESENT
        decisions.append(decision)
    return tuple(decisions)
