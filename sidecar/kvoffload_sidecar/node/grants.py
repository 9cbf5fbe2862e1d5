"""The admin's node pool: its tenants, their shares, and who may use each.

The cluster-scoped `KVOffloadNodePool` object (crds/kvoffloadnodepool.yaml), as the API returns
it (follow.py) or from a JSON or YAML file, or `{name, tenants: [{shareBytes, ...}]}` from a
file. A namespace user writes only the tenant
name into a pod's volume; whether that pod may use it is decided here, from the admin's object.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvoffload_sidecar.node.identity import PodIdentity

_MIN_SHARE = 1 << 20
_QUANTITY = re.compile(r"^([0-9]+)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$")
_SUFFIX = {
    "": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
    "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "Pi": 1 << 50, "Ei": 1 << 60,
}  # fmt: skip


class GrantsError(ValueError):
    """The node pool spec is malformed."""


@dataclass(frozen=True)
class TenantGrant:
    name: str
    share_bytes: int  # the size of the tenant's memfd
    namespaces: tuple[str, ...]  # pods of these namespaces may use it
    service_accounts: tuple[str, ...] = ()  # and, when not empty, only these service accounts

    def admits(self, pod: PodIdentity) -> bool:
        if pod.namespace not in self.namespaces:
            return False
        return not self.service_accounts or pod.service_account in self.service_accounts


@dataclass(frozen=True)
class NodePoolSpec:
    name: str
    tenants: tuple[TenantGrant, ...]

    @property
    def size_bytes(self) -> int:
        return sum(t.share_bytes for t in self.tenants)

    def tenant(self, name: str) -> TenantGrant | None:
        return next((t for t in self.tenants if t.name == name), None)

    def admits(self, pod: PodIdentity, tenant: str) -> bool:
        """Whether `pod` may use `tenant`; an unknown tenant is simply not admitted."""
        grant = self.tenant(tenant)
        return grant is not None and grant.admits(pod)


def _strings(value: Any, what: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise GrantsError(f"{what} must be a list of non-empty strings")
    return tuple(value)


def share_bytes(value: Any, what: str) -> int:
    """A tenant's share: bytes (an integer) or a quantity as the CRD allows it (`64Gi`)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    m = _QUANTITY.match(value) if isinstance(value, str) else None
    if not m:
        raise GrantsError(f"{what} must be bytes or a quantity such as 64Gi, got {value!r}")
    return int(m.group(1)) * _SUFFIX[m.group(2) or ""]


def parse_node_pool(obj: Mapping[str, Any]) -> NodePoolSpec:
    """A `KVOffloadNodePool` object as the API returns it."""
    if obj.get("kind") != "KVOffloadNodePool":
        raise GrantsError(f"expected a KVOffloadNodePool, got kind {obj.get('kind')!r}")
    meta, spec = obj.get("metadata") or {}, obj.get("spec") or {}
    if not isinstance(meta, Mapping) or not isinstance(spec, Mapping):
        raise GrantsError("metadata and spec must be objects")
    return parse_spec({"name": meta.get("name"), "tenants": spec.get("tenants")})


def parse_spec(doc: Mapping[str, Any]) -> NodePoolSpec:
    """`{name, tenants: [{name, share | shareBytes, namespaces, serviceAccounts?}]}`."""
    if "kind" in doc:
        return parse_node_pool(doc)
    name = doc.get("name")
    if not isinstance(name, str) or not name:
        raise GrantsError("the node pool needs a name")
    raw = doc.get("tenants")
    if not isinstance(raw, list) or not raw:
        raise GrantsError("the node pool needs at least one tenant")
    tenants = []
    for i, t in enumerate(raw):
        if not isinstance(t, Mapping):
            raise GrantsError(f"tenants[{i}] must be an object")
        tname = t.get("name")
        if not isinstance(tname, str) or not tname:
            raise GrantsError(f"tenants[{i}].name must be a non-empty string")
        key = "shareBytes" if "shareBytes" in t else "share"
        share = share_bytes(t.get(key), f"tenants[{i}].{key}")
        if share < _MIN_SHARE:
            raise GrantsError(f"tenants[{i}].{key} must be at least 1Mi ({_MIN_SHARE} bytes)")
        tenants.append(
            TenantGrant(
                name=tname,
                share_bytes=share,
                namespaces=_strings(t.get("namespaces"), f"tenants[{i}].namespaces"),
                service_accounts=_strings(
                    t.get("serviceAccounts", []), f"tenants[{i}].serviceAccounts"
                )
                if t.get("serviceAccounts")
                else (),
            )
        )
    names = [t.name for t in tenants]
    if len(set(names)) != len(names):
        raise GrantsError("tenant names must be unique")
    return NodePoolSpec(name=name, tenants=tuple(tenants))


def load_spec(path: Path) -> NodePoolSpec:
    text = path.read_text()
    if path.suffix == ".json":
        doc = json.loads(text)
    else:
        import yaml  # only for YAML specs: the agent's JSON path needs no third-party module

        doc = yaml.safe_load(text)
    if not isinstance(doc, Mapping):
        raise GrantsError(f"{path}: expected an object")
    return parse_spec(doc)
