"""The agent follows its `KVOffloadNodePool` and reports its own node's part of the status.

Grants: the agent reads the object, then watches it; every accepted change is the grant that new
NodePublishVolume calls are checked against, and published pods that lacked their tenant's
grant get it if it admits them now (`on_grants`); published pods keep what they were granted
until they unpublish. A change it cannot honour (malformed, or shares that sum past the node's
pool) is refused: the last good grants stay, and the node's status says why.

CSIDriver: the agent reads `node.kvoffload.io` and grants tenants only once it says
`podInfoOnMount: true` and `volumeLifecycleModes: [Ephemeral]` (the pod fields in a volume
context could otherwise be the pod spec's own); until then, and until it has good grants,
pods are published but their sockets answer UNAVAILABLE with the reason (access.py).

Status: each agent writes only `status.nodes.<its node>` with a JSON merge patch, a map keyed by
node name, so agents on different nodes never read-modify-write a shared list (docs/NODE.md).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from kvoffload_sidecar.node.bindings import Binding
from kvoffload_sidecar.node.csi import DRIVER_NAME
from kvoffload_sidecar.node.grants import GrantsError, NodePoolSpec, parse_node_pool
from kvoffload_sidecar.node.kube import CSI_DRIVERS, NODE_POOLS, ApiError, KubeClient
from kvoffload_sidecar.node.tenant_memory import TenantMemory

log = logging.getLogger(__name__)

READY, GRANTS_REJECTED = "Ready", "GrantsRejected"


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def csidriver_problem(obj: Mapping[str, Any] | None) -> str | None:
    """Why the CSIDriver object does not let the agent trust a volume context (None: it does)."""
    if obj is None:
        return f"CSIDriver {DRIVER_NAME} does not exist"
    spec = obj.get("spec") or {}
    if spec.get("podInfoOnMount") is not True:
        return (
            f"CSIDriver {DRIVER_NAME} lacks podInfoOnMount: true (a pod's identity in its "
            "volume context would be the pod spec's own)"
        )
    if spec.get("volumeLifecycleModes") != ["Ephemeral"]:
        return (
            f"CSIDriver {DRIVER_NAME} must have volumeLifecycleModes [Ephemeral], has "
            f"{spec.get('volumeLifecycleModes')!r}"
        )
    return None


@dataclass
class Condition:
    type: str
    status: str
    reason: str
    message: str
    last_transition_time: str = field(default_factory=_now)

    def to_api(self, generation: int | None) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "type": self.type,
            "status": self.status,
            "reason": self.reason,
            "message": self.message,
            "lastTransitionTime": self.last_transition_time,
        }
        if generation is not None:
            doc["observedGeneration"] = generation
        return doc


class PoolFollower:
    """The last good grants, the CSIDriver verdict, and this node's status entry."""

    def __init__(
        self,
        *,
        name: str,
        node_id: str,
        pool_bytes: int,
        memory: TenantMemory,
        bindings: Callable[[], list[Binding]],
        client: KubeClient,
        resync_s: int = 300,
        on_grants: Callable[[], object] = lambda: None,
    ) -> None:
        """`pool_bytes`: the node's pool (the holder's memory limit); grants past it fail.
        `on_grants()` is called after each accepted generation and once the CSIDriver passes
        (csi.py `NodeAgent.reconsider`: published pods that lacked a grant may get it)."""
        self.name = name
        self._on_grants = on_grants
        self._driver_retry_s = min(30.0, float(resync_s))
        self._node = node_id
        self._pool_bytes = pool_bytes
        self._memory = memory
        self._bindings = bindings
        self._client = client
        self._resync_s = resync_s
        self._lock = threading.Lock()
        self._spec = NodePoolSpec(name=name, tenants=())
        self._generation: int | None = None  # of the grants in force
        self._seen: Any = object()  # the generation last decided on, accepted or not
        self._driver_problem: str | None = "the CSIDriver has not been read yet"
        self._conditions: dict[str, Condition] = {}
        self._set(READY, "False", "Starting", "grants and CSIDriver not read yet")
        self._set(GRANTS_REJECTED, "False", "Accepted", "no grant refused")
        self._dirty = threading.Event()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    # what the CSI services read

    def spec(self) -> NodePoolSpec:
        with self._lock:
            return self._spec

    def precondition(self) -> str | None:
        with self._lock:
            if self._driver_problem is not None:
                return self._driver_problem
            if self._generation is None:
                return f"KVOffloadNodePool {self.name} has not been read yet"
            return None

    def changed(self) -> None:
        self._dirty.set()

    # decisions

    def check_driver(self, obj: Mapping[str, Any] | None) -> None:
        problem = csidriver_problem(obj)
        with self._lock:
            self._driver_problem = problem
            self._refresh_ready()
        if problem:
            log.error("no pod gets its tenant (their sockets answer UNAVAILABLE): %s", problem)
        else:
            self._on_grants()
        self._dirty.set()

    def apply(self, obj: Mapping[str, Any] | None) -> bool:
        """Take `obj` as the grants if it is good; False (last good grants kept) if not."""
        if obj is None:
            with self._lock:
                self._seen = object()
            return self._reject("Deleted", f"KVOffloadNodePool {self.name} does not exist")
        generation = (obj.get("metadata") or {}).get("generation")
        with self._lock:
            self._seen = generation
        try:
            spec = parse_node_pool(obj)
        except GrantsError as e:
            return self._reject("Invalid", str(e), generation)
        pool = self._pool_bytes
        # memfds already made stay (sealed, and published pods hold them): they count too
        held = {r.tenant: r.size for r in self._memory.regions()}
        after = sum(held.values()) + sum(t.share_bytes for t in spec.tenants if t.name not in held)
        if spec.size_bytes > pool or after > pool:
            return self._reject(
                "PoolExceeded",
                f"the tenants' shares sum to {spec.size_bytes} bytes ({after} with the memory "
                f"already held), past this node's pool of {pool} bytes",
                generation,
            )
        try:
            self._memory.update(spec)  # new tenants' memfds (the holder's, with one)
        except Exception as e:  # noqa: BLE001 (any failure: the last good grants stay)
            return self._reject("MemoryUnavailable", f"a new tenant's memfd: {e}", generation)
        with self._lock:
            self._spec = spec
            self._generation = generation if isinstance(generation, int) else 0
            self._set(GRANTS_REJECTED, "False", "Accepted", f"generation {generation} accepted")
            self._refresh_ready()
        log.info("grants of generation %s: %s", generation, [t.name for t in spec.tenants])
        self._on_grants()
        self._dirty.set()
        return True

    def _reject(self, reason: str, message: str, generation: Any = None) -> bool:
        with self._lock:
            kept = "no grants" if self._generation is None else f"generation {self._generation}"
            self._set(GRANTS_REJECTED, "True", reason, f"{message}; {kept} kept")
            self._refresh_ready()
        log.error("grants refused (%s): %s", reason, message)
        self._dirty.set()
        return False

    def _set(self, type_: str, status: str, reason: str, message: str) -> None:
        old = self._conditions.get(type_)
        cond = Condition(type_, status, reason, message)
        if old is not None and old.status == status:
            cond.last_transition_time = old.last_transition_time
        self._conditions[type_] = cond

    def _refresh_ready(self) -> None:
        if self._driver_problem is not None:
            self._set(READY, "False", "CSIDriverUntrusted", self._driver_problem)
        elif self._generation is None:
            self._set(READY, "False", "NoGrants", f"no good KVOffloadNodePool {self.name} yet")
        else:
            self._set(READY, "True", "Serving", f"{len(self._spec.tenants)} tenants granted")

    # the status entry

    def status_entry(self) -> dict[str, Any]:
        bindings = self._bindings()
        regions = {r.tenant: r for r in self._memory.regions()}
        with self._lock:
            spec, generation = self._spec, self._generation
            conditions = [c.to_api(generation) for c in self._conditions.values()]
            pool = self._pool_bytes
        tenants = []
        for name in sorted({t.name for t in spec.tenants} | set(regions)):
            grant, region = spec.tenant(name), regions.get(name)
            tenants.append(
                {
                    "name": name,
                    "granted": grant is not None,
                    "shareBytes": grant.share_bytes if grant else 0,
                    "bytes": region.size if region else 0,
                    "publishedPods": sum(1 for b in bindings if b.granted and b.tenant == name),
                }
            )
        used = sum(r.size for r in regions.values())
        entry: dict[str, Any] = {
            "tenants": tenants,
            "poolBytes": pool,
            "usedBytes": used,
            "freeBytes": max(0, pool - used),
            "publishedPods": len(bindings),
            "ungrantedPods": sum(1 for b in bindings if not b.granted),
            "conditions": conditions,
            "lastUpdateTime": _now(),
        }
        if generation is not None:
            entry["observedGeneration"] = generation
        return entry

    def write_status(self) -> None:
        body = {"status": {"nodes": {self._node: self.status_entry()}}}
        self._client.merge_patch(f"{NODE_POOLS}/{self.name}/status", body)

    # the loops

    def start(self) -> None:
        loops = (
            (self._check_driver, "node-csidriver"),
            (self._follow, "node-pool-watch"),
            (self._report, "node-status"),
        )
        for target, name in loops:
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self) -> None:
        self._stop.set()
        self._dirty.set()

    def _check_driver(self) -> None:
        """Read the CSIDriver until it passes, again every `driver_retry_s` while it does not
        (an admin fixing it gives the published pods their tenants without a restart)."""
        while not self._stop.is_set():
            try:
                self.check_driver(self._client.get(f"{CSI_DRIVERS}/{DRIVER_NAME}"))
            except Exception as e:  # noqa: BLE001 (an API failure: read it again later)
                log.warning("CSIDriver %s not read: %s", DRIVER_NAME, e)
            with self._lock:
                if self._driver_problem is None:
                    return
            self._stop.wait(self._driver_retry_s)

    def _follow(self) -> None:
        backoff = 0.5
        while not self._stop.is_set():
            try:
                self.apply(self._client.get(f"{NODE_POOLS}/{self.name}"))
                backoff = 0.5
                for event in self._client.watch(NODE_POOLS, self.name, self._resync_s):
                    if self._stop.is_set():
                        return
                    kind = event.get("type")
                    if kind in ("ADDED", "MODIFIED"):
                        obj = event["object"]
                        with self._lock:
                            same = obj.get("metadata", {}).get("generation") == self._seen
                        if not same:  # status writes (ours, other nodes') change no spec
                            self.apply(obj)
                    elif kind == "DELETED":
                        self.apply(None)
                    elif kind == "ERROR":
                        break  # e.g. 410 Gone: read again
            except Exception as e:  # noqa: BLE001 (the watch must outlive any one failure)
                log.warning("node pool watch: %s (again in %.1fs)", e, backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 30.0)

    def _report(self) -> None:
        while not self._stop.is_set():
            self._dirty.wait(self._resync_s)
            if self._stop.is_set():
                return
            self._dirty.clear()
            try:
                self.write_status()
            except (ApiError, OSError) as e:
                log.warning("node pool status not written: %s", e)
                self._dirty.set()
                self._stop.wait(1.0)
            time.sleep(0.05)  # coalesce bursts of publishes into one patch
