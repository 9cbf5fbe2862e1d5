"""What a placement-node policy's status says of the node pool it names (pure).

The policy names a ``KVOffloadNodePool`` (cluster-scoped, the admin's) and a tenant of it. The
operator reads that object by name at each status refresh and checks what the node agent will
check at each pod's publish: the pool exists, it has the tenant, and the tenant's grant admits
the policy's namespace and the service account each injected pod runs as. A pod that fails it
is published all the same and serves without the pool (its sockets refuse): the policy's
``Degraded`` says why (``NodePoolNotFound``, ``TenantNotGranted``), before any pod exists too.

Capacity is the tenant's memfd on each node whose agent reports it granted
(``status.nodes.<node>.tenants[]``), summed over those nodes. It is SHARED: every pod of the
tenant on a node maps the same memfd, so it is reported once per node in ``status.nodePool``
(``sharedCapacityBytes``), never once per replica as a sidecar's pool is (``poolCapacity``).

Entries of nodes that left: each agent writes only its own node's entry, at least every 5
minutes, so a node deleted with its agent leaves an entry nobody rewrites. An entry not written
for `STALE_AFTER_S` is a candidate (`stale_nodes`); the operator removes it only once the API
server says its node does not exist (`prune_patch`: a merge patch conditioned on the
resourceVersion read, so an agent's write in between is never lost).
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvoffload_operator.pool_usage import binary_quantity

NODE_POOL_NOT_FOUND = "NodePoolNotFound"  # the KVOffloadNodePool the policy names is missing
TENANT_NOT_GRANTED = "TenantNotGranted"  # no such tenant, or not for this namespace or account
DEFAULT_SERVICE_ACCOUNT = "default"
STALE_AFTER_S = 900.0  # three of the agents' rewrite periods (5 minutes at most)


@dataclass(frozen=True)
class NodePoolRead:
    """The policy's node pool as the operator read it: the object (None: not found), or
    ``readable`` False when the operator may not read it (RBAC) or the read failed."""

    name: str
    tenant: str
    namespace: str
    obj: Mapping[str, Any] | None = None
    readable: bool = True
    error: str = ""

    @property
    def found(self) -> bool:
        return self.readable and self.obj is not None

    def _tenant(self) -> Mapping[str, Any] | None:
        for t in ((self.obj or {}).get("spec") or {}).get("tenants") or []:
            if isinstance(t, Mapping) and t.get("name") == self.tenant:
                return t
        return None

    def refusal(self) -> tuple[str, str] | None:
        """(reason, message) when no pod of the policy's namespace can have the tenant: the
        pool missing, no such tenant, or a grant for other namespaces. None when readable and
        the namespace is granted (service accounts are each pod's: `refusal_for`), or when the
        pool could not be read (nothing is known)."""
        if not self.readable:
            return None
        pool = f"KVOffloadNodePool {self.name!r}"
        if self.obj is None:
            return (
                NODE_POOL_NOT_FOUND,
                f"{pool} does not exist: the policy's pods serve without the node pool (their "
                "node agent follows another pool, or none); create it, or name the pool the "
                "agents follow (the chart's nodeAgent.pool.name)",
            )
        t = self._tenant()
        if t is None:
            return (
                TENANT_NOT_GRANTED,
                f"{pool} has no tenant {self.tenant!r}: the policy's pods serve without the node "
                "pool; the cluster admin adds the tenant to the pool's spec.tenants",
            )
        if self.namespace not in (t.get("namespaces") or []):
            return (
                TENANT_NOT_GRANTED,
                f"tenant {self.tenant!r} of {pool} is not granted to namespace "
                f"{self.namespace!r}: the policy's pods serve without the node pool; the "
                "cluster admin adds the namespace to the tenant's namespaces",
            )
        return None

    def refusal_for(self, service_account: str) -> tuple[str, str] | None:
        """`refusal`, then the tenant's ``serviceAccounts`` (when set) for one pod's account."""
        if (whole := self.refusal()) is not None or not self.found:
            return whole
        accounts = (self._tenant() or {}).get("serviceAccounts") or []
        if accounts and service_account not in accounts:
            return (
                TENANT_NOT_GRANTED,
                f"tenant {self.tenant!r} of KVOffloadNodePool {self.name!r} is granted in "
                f"namespace {self.namespace!r} to service accounts {', '.join(accounts)}, not "
                f"to {service_account!r}: this pod serves without the node pool",
            )
        return None

    def shared(self) -> tuple[int, int, int]:
        """(nodes, bytes, pods): the nodes whose agent reports the tenant granted with memory,
        its memfds' bytes summed over them, and its published pods holding the grant there."""
        nodes = ((self.obj or {}).get("status") or {}).get("nodes") or {}
        count = size = pods = 0
        for entry in nodes.values() if isinstance(nodes, Mapping) else ():
            for t in (entry or {}).get("tenants") or [] if isinstance(entry, Mapping) else ():
                if not isinstance(t, Mapping) or t.get("name") != self.tenant:
                    continue
                if t.get("granted") is True and _int(t.get("bytes")) > 0:
                    count += 1
                    size += _int(t.get("bytes"))
                    pods += _int(t.get("publishedPods"))
        return count, size, pods

    def status(self) -> dict[str, Any]:
        """``status.nodePool``: which pool and tenant, whether the namespace is granted, and
        the tenant's SHARED capacity (its memfd per node, counted once per node)."""
        out: dict[str, Any] = {"name": self.name, "tenant": self.tenant}
        if not self.readable:
            return out
        granted = self.refusal() is None
        nodes, size, pods = self.shared() if granted else (0, 0, 0)
        return {
            **out,
            "found": self.found,
            "granted": granted,
            "nodes": nodes,
            "publishedPods": pods,
            "sharedCapacityBytes": size,
            "sharedCapacity": binary_quantity(size),
        }


def service_account_of(pod: Mapping[str, Any]) -> str:
    spec = pod.get("spec") or {}
    return str(spec.get("serviceAccountName") or spec.get("serviceAccount") or "") or (
        DEFAULT_SERVICE_ACCOUNT
    )


def refused_pods(
    read: NodePoolRead, pods: Sequence[Mapping[str, Any]]
) -> list[tuple[Mapping[str, Any], str, str]]:
    """(pod, reason, message) of each pod the node agent will refuse its tenant."""
    out = []
    for pod in pods:
        why = read.refusal_for(service_account_of(pod))
        if why is not None:
            out.append((pod, *why))
    return out


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _written_at(entry: Any) -> datetime.datetime | None:
    raw = entry.get("lastUpdateTime") if isinstance(entry, Mapping) else None
    if not isinstance(raw, str):
        return None
    try:
        at = datetime.datetime.fromisoformat(raw.replace("Z", "+00:00"))
    except ValueError:
        return None
    return at if at.tzinfo is not None else at.replace(tzinfo=datetime.timezone.utc)


def stale_nodes(
    obj: Mapping[str, Any] | None, now: datetime.datetime, older_than_s: float = STALE_AFTER_S
) -> list[str]:
    """Nodes of ``status.nodes`` whose entry no agent wrote for ``older_than_s`` (or whose
    ``lastUpdateTime`` is missing or unreadable): the ones to look up."""
    nodes = ((obj or {}).get("status") or {}).get("nodes") or {}
    if not isinstance(nodes, Mapping):
        return []
    out = []
    for name, entry in sorted(nodes.items()):
        at = _written_at(entry)
        if at is None or (now - at).total_seconds() > older_than_s:
            out.append(str(name))
    return out


def prune_patch(obj: Mapping[str, Any], gone: Sequence[str]) -> dict[str, Any]:
    """A JSON merge patch of the status subresource removing the entries of ``gone`` nodes,
    conditioned on the resourceVersion read (a 409 when an agent wrote meanwhile)."""
    rv = (obj.get("metadata") or {}).get("resourceVersion")
    return {
        **({"metadata": {"resourceVersion": rv}} if rv else {}),
        "status": {"nodes": {name: None for name in gone}},
    }
