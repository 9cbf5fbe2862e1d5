"""Per-tenant quotas of a namespace's slots (`--tenants`): config, key ownership, eviction.

vLLM requests may carry a `cache_salt` (per-tenant prefix isolation). The sidecar maps salts to
configured tenants; a request without a salt, or with a salt no tenant names, is the `default`
tenant. Each tenant has a guaranteed share and a maximum share of every namespace's slots:

- a tenant at its maximum makes room only from its own blocks;
- otherwise victims come from tenants above their guarantee, oldest first across them (each
  tenant's blocks in its own policy's order), never pushing another tenant below its guarantee;
  the storing tenant's own blocks come last;
- NO_SPACE when nothing may be evicted.

"Used" is committed plus reserved slots (a flood of reservations counts against the maximum
before it commits); only committed, unpinned blocks are victims. Each tenant has its own
eviction policy (`make_policy`: LRU, ARC, ...) and a recency map (key -> sequence number of its
last insert or hit) that orders the tenants' oldest blocks against each other.

A block's tenant is recorded when it is reserved, and in the pool file's commit record (its
index + 1, persist.py): blocks adopted after a sidecar restart go back to the tenant that stored
them, under the same --tenants (the pod's flag; an index this configuration lacks, or a file
written without tenants, means the default tenant).

No grpc here: the pool core (pool.py) calls `TenantPolicy`; the servicer decodes salts.
"""

from __future__ import annotations

import heapq
import json
import re
from array import array
from collections import OrderedDict
from collections.abc import Container, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from itertools import filterfalse, islice, repeat
from typing import Any

from kvoffload_sidecar.errors import InvalidArgument
from kvoffload_sidecar.keys import PoolKey
from kvoffload_sidecar.policies import CachePolicy, make_policy
from kvoffload_sidecar.policies.base import consume

__all__ = [
    "DEFAULT_TENANT",
    "KeySalts",
    "TenantConfig",
    "TenantPolicy",
    "TenantStats",
    "TenantsConfig",
    "parse_share",
    "parse_tenants",
]

DEFAULT_TENANT = "default"
MAX_TENANTS = 64  # configured tenants, default included (the metric label stays bounded)
MAX_SALTS = 1024  # cache salts of one tenant
MAX_SALT_BYTES = 1024
NAME_PATTERN = re.compile(r"^[a-z0-9]([-a-z0-9_]{0,61}[a-z0-9])?$")  # a DNS-label-ish name
_PERCENT = re.compile(r"^([0-9]{1,3}(?:\.[0-9]{1,4})?)%$")
_KEYS = ("name", "cacheSalts", "guaranteed", "max")


@dataclass(frozen=True)
class TenantConfig:
    """One tenant: the salts that name it and its shares of each namespace's slots."""

    name: str
    cache_salts: tuple[str, ...] = ()
    guaranteed: Fraction = Fraction(0)  # share no other tenant's stores can push it below
    max: Fraction = Fraction(1)  # share it may fill at most

    def slots(self, slot_count: int) -> tuple[int, int]:
        """(guaranteed, max) slots of a namespace of `slot_count` slots (rounded down)."""
        guaranteed = int(self.guaranteed * slot_count)
        return guaranteed, max(guaranteed, int(self.max * slot_count))

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name}
        if self.cache_salts:
            out["cacheSalts"] = list(self.cache_salts)
        out["guaranteed"] = _percent(self.guaranteed)
        out["max"] = _percent(self.max)
        return out


@dataclass(frozen=True)
class TenantsConfig:
    """The configured tenants, the default tenant last (always present)."""

    tenants: tuple[TenantConfig, ...]

    def __post_init__(self) -> None:
        if not self.tenants or self.tenants[-1].name != DEFAULT_TENANT:
            raise ValueError("the default tenant must come last")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tenants)

    def describe(self) -> str:
        """Names and shares for logs ("a 25%..60%, default 0%..100%"): no salts, which
        isolate tenants' prefixes and are best not spread."""
        return ", ".join(
            f"{t.name} {_percent(t.guaranteed)}..{_percent(t.max)}" for t in self.tenants
        )

    def to_json(self) -> str:
        """The `--tenants` text that parses back to this config."""
        return json.dumps([t.to_json() for t in self.tenants], separators=(",", ":"))


def _percent(share: Fraction) -> str:
    text = f"{float(share * 100):.4f}".rstrip("0").rstrip(".")
    return f"{text}%"


def parse_share(value: object, where: str) -> Fraction:
    """`"25%"` (up to 4 decimals) or a number in 0..1 -> an exact fraction of the slots."""
    if isinstance(value, str):
        m = _PERCENT.match(value.strip())
        if not m:
            raise ValueError(f'{where}: {value!r} is not a percentage such as "25%"')
        share = Fraction(m.group(1)) / 100
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        share = Fraction(str(value))
    else:
        raise ValueError(f'{where}: {value!r} is not a percentage such as "25%" or 0..1')
    if not 0 <= share <= 1:
        raise ValueError(f"{where}: {value!r} is outside 0%..100%")
    return share


def parse_tenants(text: str) -> TenantsConfig:
    """The `--tenants` JSON: a list of `{"name", "cacheSalts", "guaranteed", "max"}` objects
    (shares as "25%" or 0..1; a `default` entry, without salts, sets the default tenant's
    shares: guaranteed 0%, max 100% when absent). ValueError naming the entry on bad input."""
    try:
        raw = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(raw, list):
        raise ValueError('expected a JSON list of tenants, e.g. [{"name": "a", ...}]')
    if len(raw) > MAX_TENANTS:
        raise ValueError(f"{len(raw)} tenants; at most {MAX_TENANTS}")
    tenants: list[TenantConfig] = []
    default = TenantConfig(DEFAULT_TENANT)
    names: set[str] = set()
    owner_of: dict[str, str] = {}
    for i, entry in enumerate(raw):
        where = f"tenant {i}"
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: must be an object with name, cacheSalts, guaranteed, max")
        unknown = sorted(set(entry) - set(_KEYS))
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {unknown}; expected {', '.join(_KEYS)}")
        name = entry.get("name")
        if not isinstance(name, str) or not NAME_PATTERN.match(name):
            raise ValueError(
                f"{where}: name {name!r} must be 1-63 lowercase letters, digits, '-' or '_' "
                "(starting and ending with a letter or digit)"
            )
        where = f"tenant {name!r}"
        if name in names:
            raise ValueError(f"{where}: the name repeats")
        names.add(name)
        salts = entry.get("cacheSalts", [])
        if not isinstance(salts, list) or not all(isinstance(s, str) and s for s in salts):
            raise ValueError(f"{where}: cacheSalts must be a list of non-empty strings")
        if len(salts) > MAX_SALTS or any(len(s.encode()) > MAX_SALT_BYTES for s in salts):
            raise ValueError(
                f"{where}: at most {MAX_SALTS} cacheSalts of {MAX_SALT_BYTES} bytes each"
            )
        for salt in salts:
            other = owner_of.setdefault(salt, name)
            if other != name:
                raise ValueError(f"{where}: cache salt {salt!r} already names tenant {other!r}")
        if name == DEFAULT_TENANT and salts:
            raise ValueError(
                f"{where}: the default tenant has no cacheSalts (it is every request without a "
                "salt, or with a salt no tenant names)"
            )
        if name != DEFAULT_TENANT and not salts:
            raise ValueError(f"{where}: cacheSalts is required (the salts that name the tenant)")
        guaranteed = parse_share(entry.get("guaranteed", 0), f"{where}: guaranteed")
        maximum = parse_share(entry.get("max", 1), f"{where}: max")
        if guaranteed > maximum:
            raise ValueError(
                f"{where}: guaranteed {_percent(guaranteed)} is above max {_percent(maximum)}"
            )
        tenant = TenantConfig(name, tuple(dict.fromkeys(salts)), guaranteed, maximum)
        if name == DEFAULT_TENANT:
            default = tenant
        else:
            tenants.append(tenant)
    total = sum((t.guaranteed for t in (*tenants, default)), Fraction(0))
    if total > 1:
        raise ValueError(f"the guarantees add up to {_percent(total)}, more than 100%")
    return TenantsConfig((*tenants, default))


@dataclass(frozen=True)
class KeySalts:
    """The cache salts of a store batch's keys: `per_key` holds, per key, 1 + the index of its
    salt in `salts` (0: no salt), one byte per key, or two (little-endian) when the batch names
    more than 255 salts; empty: no key has a salt."""

    salts: tuple[str, ...] = ()
    per_key: bytes = b""


@dataclass(frozen=True)
class TenantStats:
    """Same fields as proto `TenantStats`: one tenant's quota, use and counters in a namespace."""

    name: str
    guaranteed_fraction: float
    max_fraction: float
    guaranteed_slots: int
    max_slots: int
    used_slots: int  # committed + reserved
    committed_slots: int
    used_bytes: int
    stored_blocks: int  # committed by all ranks
    evicted_blocks: int
    lookups: int  # lookup queries carrying one of its salts (or none: default)
    hit_blocks: int
    miss_blocks: int
    queried_blocks: int  # keys its lookups asked (hit rate: hit_blocks / queried_blocks)


@dataclass(slots=True, eq=False)
class _Tenant:
    config: TenantConfig
    guaranteed: int  # slots
    max_slots: int
    policy: CachePolicy
    recency: OrderedDict[PoolKey, int] = field(default_factory=OrderedDict)  # oldest first
    reserved: int = 0
    stored: int = 0
    evicted: int = 0
    lookups: int = 0
    hit_blocks: int = 0
    miss_blocks: int = 0
    queried_blocks: int = 0

    def used(self) -> int:
        return len(self.recency) + self.reserved


class TenantPolicy:
    """The `CachePolicy` of a namespace with tenants: one policy per tenant, keys routed by the
    tenant that stored them, plus the quota-aware `admit` the pool calls to store.

    Not thread-safe: the pool calls it with its lock held (as every policy)."""

    def __init__(self, config: TenantsConfig, eviction: str, slot_count: int) -> None:
        self.config = config
        self.name = eviction
        self._tenants: list[_Tenant] = []
        for t in config.tenants:
            guaranteed, max_slots = t.slots(slot_count)
            policy = make_policy(eviction, max(1, max_slots))
            self._tenants.append(_Tenant(t, guaranteed, max_slots, policy))
        self.default = len(self._tenants) - 1
        self._by_salt: dict[str, int] = {
            salt: i for i, t in enumerate(config.tenants) for salt in t.cache_salts
        }
        self._owner: dict[PoolKey, int] = {}  # committed key -> tenant index
        self._pending: dict[PoolKey, int] = {}  # reserved key -> tenant index
        self._seq = 0

    # -- salts ----------------------------------------------------------------------------------

    def tenant_of(self, salt: str | None) -> int:
        """The tenant a request's salt names (the default tenant for none or an unknown one)."""
        return self._by_salt.get(salt, self.default) if salt else self.default

    def key_tenants(self, salts: KeySalts | None, n: int) -> int | list[int]:
        """Per key of a store batch of `n` keys, its tenant index: an int when they all share
        one (the usual batch), else a list (InvalidArgument for a malformed `KeySalts`)."""
        if salts is None or not salts.per_key:
            return self.default
        per_key, names = salts.per_key, salts.salts
        if len(names) > 0xFFFF:
            raise InvalidArgument(f"{len(names)} cache salts in one batch; at most 65535")
        if len(per_key) == n:
            codes: Sequence[int] = per_key
        elif len(per_key) == 2 * n:
            codes = array("H", per_key)
            if array("H", b"\x01\x00")[0] != 1:  # pragma: no cover - big-endian host
                codes.byteswap()
        else:
            raise InvalidArgument(
                f"key_salts has {len(per_key)} bytes for {n} keys (one or two per key)"
            )
        if max(codes, default=0) > len(names):
            raise InvalidArgument(
                f"key_salts names salt {max(codes)} but the batch has {len(names)} cache_salts"
            )
        table = [self.default, *map(self.tenant_of, names)]
        owners = list(map(table.__getitem__, codes))
        return owners[0] if owners.count(owners[0]) == n else owners

    # -- CachePolicy ----------------------------------------------------------------------------

    def insert(self, key: PoolKey) -> None:
        """A reserved key committed: it joins the tenant that reserved it (default if none)."""
        t = self._pending.pop(key, None)
        tenant = self._tenants[self.default if t is None else t]
        if t is not None:
            tenant.reserved -= 1
            tenant.stored += 1
        self._owner[key] = self.default if t is None else t
        tenant.policy.insert(key)
        tenant.recency[key] = self._seq

    def insert_many(self, keys: Iterable[PoolKey]) -> None:
        """Blocks of no recorded tenant, oldest first: the default tenant's."""
        keys = list(keys)
        self.adopt(keys, [0] * len(keys))

    def adopt(self, keys: Sequence[PoolKey], codes: Sequence[int]) -> None:
        """Adopted blocks, oldest first, each to the tenant the pool file recorded (`codes`:
        index + 1 per key; 0 or an index past this configuration: the default tenant)."""
        n = len(self._tenants)
        groups: dict[int, list[PoolKey]] = {}
        for key, code in zip(keys, codes, strict=True):
            groups.setdefault(code - 1 if 0 < code <= n else self.default, []).append(key)
        for t, group in groups.items():
            tenant = self._tenants[t]
            insert_many = getattr(tenant.policy, "insert_many", None)
            if insert_many is not None:
                insert_many(group)
            else:
                consume(map(tenant.policy.insert, group))
            tenant.recency.update(zip(group, repeat(self._seq)))
            self._owner.update(zip(group, repeat(t)))

    def codes(self, keys: Sequence[PoolKey]) -> int | list[int]:
        """What the pool file records of committed keys' tenants (index + 1): one int when
        they share one (the usual store), else one per key."""
        owner, default = self._owner, self.default
        codes = [owner.get(k, default) + 1 for k in keys]
        return codes[0] if codes and codes.count(codes[0]) == len(codes) else codes

    def remove(self, key: PoolKey) -> None:
        t = self._owner.pop(key, None)
        if t is not None:
            tenant = self._tenants[t]
            tenant.policy.remove(key)
            del tenant.recency[key]

    def touch(self, keys: Iterable[PoolKey]) -> None:
        keys = keys if type(keys) in (list, tuple) else list(keys)
        if not keys:
            return
        self._seq += 1
        owners = list(map(self._owner.get, keys))
        first = owners[0]
        if first is not None and owners.count(first) == len(owners):  # one tenant's hit
            self._touch(self._tenants[first], keys)
            return
        groups: dict[int, list[PoolKey]] = {}
        for key, t in zip(keys, owners, strict=True):
            if t is not None:
                groups.setdefault(t, []).append(key)
        for t, group in groups.items():
            self._touch(self._tenants[t], group)

    def _touch(self, tenant: _Tenant, keys: Sequence[PoolKey]) -> None:
        tenant.policy.touch(keys)
        recency = tenant.recency
        consume(map(recency.move_to_end, keys))
        recency.update(zip(keys, repeat(self._seq)))

    def evict(self, n: int, protected: Container[PoolKey]) -> list[PoolKey] | None:
        """`n` victims from tenants above their guarantee, oldest first; None (and nothing
        changed) when fewer may go."""
        if n <= 0:
            return []
        plan = self._plan(n, protected)
        if sum(plan.values()) < n:
            return None
        return self._execute(plan, protected)

    def __len__(self) -> int:
        return len(self._owner)

    def __contains__(self, key: object) -> bool:
        return key in self._owner

    def keys(self) -> Iterator[PoolKey]:
        return iter(self._owner)

    # -- quotas ---------------------------------------------------------------------------------

    def fits(self, tenant: int | list[int], n: int) -> bool:
        """Whether one tenant may reserve `n` more slots without reaching past its maximum."""
        if not isinstance(tenant, int):
            return False
        t = self._tenants[tenant]
        return t.used() + n <= t.max_slots

    def reserve(self, keys: Sequence[PoolKey], tenant: int | Sequence[int]) -> None:
        """Keys got slots for `tenant` (one index, or one per key): they count as its use."""
        if isinstance(tenant, int):
            self._pending.update(zip(keys, repeat(tenant)))
            self._tenants[tenant].reserved += len(keys)
            return
        self._pending.update(zip(keys, tenant, strict=True))
        for t in tenant:
            self._tenants[t].reserved += 1

    def abort(self, keys: Iterable[PoolKey]) -> None:
        """Reserved keys that will not be committed."""
        pending, tenants = self._pending, self._tenants
        for key in keys:
            t = pending.pop(key, None)
            if t is not None:
                tenants[t].reserved -= 1

    def admit(
        self,
        tenant: int,
        n: int,
        available: int,
        protected: Container[PoolKey],
        *,
        may_evict: bool = True,
    ) -> tuple[int, list[PoolKey]]:
        """How many of `n` new keys of `tenant` may be stored with `available` free slots, and
        the victims evicted (already gone from this policy; the pool frees their slots).

        At its maximum the tenant makes room from its own blocks only; then missing free slots
        come from tenants above their guarantee, oldest first, and last from its own blocks."""
        if n <= 0:
            return 0, []
        t = self._tenants[tenant]
        victims: list[PoolKey] = []
        room = t.max_slots - t.used()
        if room < n and may_evict:
            victims += self._evict_own(t, n - room, protected)
            room += len(victims)
        count = max(0, min(n, room))
        free = available + len(victims)
        if count > free and may_evict:
            need = count - free
            got = self._execute(self._plan(need, protected), protected)
            if len(got) < need:
                got += self._evict_own(t, need - len(got), protected)
            victims += got
            free += len(got)
        return min(count, free), victims

    def _plan(self, n: int, protected: Container[PoolKey]) -> dict[int, int]:
        """Victims per tenant: the `n` oldest unprotected blocks of tenants above their
        guarantee, each giving at most what keeps it at its guarantee."""
        skip = protected.__contains__
        streams = []
        for i, t in enumerate(self._tenants):
            budget = min(t.used() - t.guaranteed, len(t.recency), n)
            if budget > 0:
                recency = t.recency
                oldest = islice(filterfalse(skip, recency), budget)
                streams.append(zip(map(recency.__getitem__, oldest), repeat(i)))
        plan: dict[int, int] = {}
        for _, i in islice(heapq.merge(*streams), n):
            plan[i] = plan.get(i, 0) + 1
        return plan

    def _execute(self, plan: dict[int, int], protected: Container[PoolKey]) -> list[PoolKey]:
        victims: list[PoolKey] = []
        for i, k in plan.items():
            victims += self._evict_own(self._tenants[i], k, protected)
        return victims

    def _evict_own(self, t: _Tenant, n: int, protected: Container[PoolKey]) -> list[PoolKey]:
        """Up to `n` victims from `t`'s own policy (as many as it can give: its `evict` is
        all-or-nothing, so a refusal asks for half as many)."""
        out: list[PoolKey] = []
        ask = n = min(n, len(t.recency))
        while n > 0 and ask > 0:
            victims = t.policy.evict(ask, protected)
            if victims is None:
                ask //= 2
                continue
            out += victims
            n -= len(victims)
            ask = min(ask, n)
        if out:
            owner, recency = self._owner, t.recency
            consume(map(owner.__delitem__, out))
            consume(map(recency.__delitem__, out))
            t.evicted += len(out)
        return out

    # -- observation ----------------------------------------------------------------------------

    def count_lookup(self, salt: str | None, hits: int, keys: int) -> None:
        """One lookup query of a request with `salt`: `hits` of its `keys` keys found."""
        t = self._tenants[self.tenant_of(salt)]
        t.lookups += 1
        t.hit_blocks += hits
        t.miss_blocks += hits < keys
        t.queried_blocks += keys

    def stats(self, slot_bytes: int) -> tuple[TenantStats, ...]:
        return tuple(
            TenantStats(
                name=t.config.name,
                guaranteed_fraction=float(t.config.guaranteed),
                max_fraction=float(t.config.max),
                guaranteed_slots=t.guaranteed,
                max_slots=t.max_slots,
                used_slots=t.used(),
                committed_slots=len(t.recency),
                used_bytes=t.used() * slot_bytes,
                stored_blocks=t.stored,
                evicted_blocks=t.evicted,
                lookups=t.lookups,
                hit_blocks=t.hit_blocks,
                miss_blocks=t.miss_blocks,
                queried_blocks=t.queried_blocks,
            )
            for t in self._tenants
        )

    def check(self, reserved_keys: set[PoolKey]) -> None:
        """AssertionError naming the first broken invariant (tests; O(keys))."""
        held: set[PoolKey] = set()
        for i, t in enumerate(self._tenants):
            keys = set(t.policy.keys())
            name = t.config.name
            assert len(keys) == len(t.policy), f"tenant {name}: its policy holds a key twice"
            assert keys == set(t.recency), f"tenant {name}: policy and recency disagree"
            assert all(self._owner.get(k) == i for k in keys), f"tenant {name}: owner mismatch"
            assert not (held & keys), f"tenant {name}: a key belongs to two tenants"
            held |= keys
            reserved = sum(1 for v in self._pending.values() if v == i)
            assert t.reserved == reserved, (
                f"tenant {name}: {t.reserved} reserved, {reserved} pending"
            )
            seqs = list(t.recency.values())
            assert seqs == sorted(seqs), f"tenant {name}: recency out of order"
        assert held == set(self._owner), "a committed key has no tenant"
        assert set(self._pending) == reserved_keys, "pending keys differ from reserved keys"
