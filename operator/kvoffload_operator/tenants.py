"""``spec.tenants`` of a KVOffloadPolicy → typed `TenantSpec`s and the sidecar's ``--tenants``.

Pure (no kopf, no Kubernetes client). The checks are the CRD's schema and CEL rules on
``spec.tenants``, with the same messages, so the offline ``kvoffload inject`` rejects what the
API server would. The sidecar reads the same JSON shape (kvoffload_sidecar/tenants.py).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

DEFAULT_TENANT = "default"
MAX_TENANTS = 16
MAX_SALTS = 16
MAX_SALT_LENGTH = 128
NAME = re.compile(r"^[a-z0-9]([-a-z0-9_]*[a-z0-9])?$")
PERCENT = re.compile(r"^([0-9]{1,2}(\.[0-9]{1,2})?|100)%$")
_KEYS = ("name", "cacheSalts", "guaranteed", "max")


@dataclass(frozen=True)
class TenantSpec:
    """One tenant of a policy: the cache salts that name it and its shares of the pool."""

    name: str
    cache_salts: tuple[str, ...] = ()
    guaranteed: str = "0%"  # as written ("25%"): the sidecar parses the same text
    max: str = "100%"

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name}
        if self.cache_salts:
            out["cacheSalts"] = list(self.cache_salts)
        out["guaranteed"] = self.guaranteed
        out["max"] = self.max
        return out


def sidecar_flag(tenants: Sequence[TenantSpec]) -> str:
    """The sidecar's ``--tenants`` value (compact JSON, the policy's order)."""
    return json.dumps([t.to_json() for t in tenants], separators=(",", ":"))


def _percent(value: str) -> Decimal:
    return Decimal(value[:-1])


def tenants_from_spec(raw: Any, error: Callable[[str], Exception]) -> tuple[TenantSpec, ...]:
    """``spec.tenants`` (a list, or None) → tenants; `error(message)` for anything the CRD
    rejects."""
    path = "spec.tenants"
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise error(f"{path}: must be a list of tenants")
    if len(raw) > MAX_TENANTS:
        raise error(f"{path}: at most {MAX_TENANTS} tenants, got {len(raw)}")
    out: list[TenantSpec] = []
    for i, entry in enumerate(raw):
        where = f"{path}[{i}]"
        if not isinstance(entry, dict):
            raise error(f"{where}: must be an object")
        unknown = sorted(set(entry) - set(_KEYS))
        if unknown:
            raise error(
                f"{where}: unknown field(s) {', '.join(map(repr, unknown))}; "
                f"expected: {', '.join(_KEYS)}"
            )
        name = entry.get("name")
        if not isinstance(name, str) or len(name) > 63 or not NAME.match(name):
            raise error(
                f"{where}.name: {name!r} should match {NAME.pattern!r} (at most 63 characters)"
            )
        salts = entry.get("cacheSalts") or []
        if not isinstance(salts, list) or len(salts) > MAX_SALTS:
            raise error(f"{where}.cacheSalts: a list of at most {MAX_SALTS} salts")
        for salt in salts:
            if not isinstance(salt, str) or not 1 <= len(salt) <= MAX_SALT_LENGTH:
                raise error(f"{where}.cacheSalts: {salt!r} is not 1-{MAX_SALT_LENGTH} characters")
        if len(set(salts)) != len(salts):
            raise error(f"{where}.cacheSalts: must not repeat a salt")
        shares = {}
        for key, default in (("guaranteed", "0%"), ("max", "100%")):
            value = entry.get(key, default)
            if not isinstance(value, str) or not PERCENT.match(value):
                raise error(
                    f"{where}.{key}: {value!r} should match {PERCENT.pattern!r} "
                    '(a percentage such as "25%")'
                )
            shares[key] = value
        if _percent(shares["guaranteed"]) > _percent(shares["max"]):
            raise error(f"{path}: a tenant's guaranteed share must not be above its max")
        if (name == DEFAULT_TENANT) == bool(salts):
            raise error(
                f"{path}: every tenant but default needs cacheSalts; default takes none (it "
                "is every request without a salt a tenant names)"
            )
        out.append(TenantSpec(name, tuple(salts), shares["guaranteed"], shares["max"]))
    names = [t.name for t in out]
    if len(set(names)) != len(names):
        raise error(f"{path}: names must be unique")
    if sum((_percent(t.guaranteed) for t in out), Decimal(0)) > 100:
        raise error(f"{path}: the guaranteed shares add up to more than 100%")
    salts = [s for t in out for s in t.cache_salts]
    if len(set(salts)) != len(salts):
        raise error(f"{path}: a cache salt may name only one tenant")
    return tuple(out)
