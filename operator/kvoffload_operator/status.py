"""Policy status from observed pods (pure): counts, conditions, observedGeneration.

Conditions follow ``metav1.Condition``: ``lastTransitionTime`` changes only when ``status``
changes. ``Ready``: the policy is valid and its namespace admits injection. ``Conflicting``:
another policy wins some of the pods this one selects (see `selection`). ``skipped``: matched
pods left alone, counted per skip reason.

``Degraded``: some injected pods serve worse than they could, each for its most basic cause:
1. a kvoffload container cannot run (image pull failure, crash loop; from the pod's status): no
   pod spec can bypass a sidecar image that cannot be pulled, so vLLM waits; or the pod cannot
   be scheduled for want of memory, hugepages or CPU, which the sidecar adds (the pool is in
   its memory request: ``Unschedulable``, the scheduler's message quoted);
2. else the sidecar serves without a pool (``PoolUnavailable``: its ``Stats.degraded_reason``);
3. else a vLLM connector turned itself off (``ConnectorDisabled``: a ``connector_status`` entry
   with state ``disabled``); when the pool is unavailable the connectors are off *because* of
   it, so 2 hides 3 for that pod.
The condition's reason is the worst cause present (1 as ``ImagePullFailed``/``Unschedulable``/
``ContainerFailing``,
then ``PoolUnavailable``, then ``ConnectorDisabled``); its message names up to 5 pods, worst
first, each with its own cause. ``degradedPods`` counts those pods, ``degradedReasons`` counts
the causes, ``unreachableSidecars`` the sidecars that did not answer ``Stats`` (never a cause of
``Degraded``: a NetworkPolicy may keep the operator out). ``poolCapacity``/``poolUsed`` (and
``...Bytes``) sum the pools of the injected pods whose sidecar answered (`pool_usage`).

``Limited``: some injected pods use the pool under a limit their vLLM connector noted (e.g.
PYTHONHASHSEED unset with a vLLM that seeds block hashes per process: hits last one engine's
life, a restarted engine finds nothing). Such a pod serves as well as it can and better than
without kvoffload, so it is not ``Degraded``; ``notedPods`` counts them and the message names
up to 5 with their note.

``NodePlacement`` (only with ``spec.pool.placement: node``): the pods have no sidecar, so no
``Stats`` is asked of them (``readySidecars``, ``unreachableSidecars``, ``pool*`` and the
Stats-derived causes stay empty) and the condition says where the pool is instead: the node
pool's tenant, whose agents report in the ``KVOffloadNodePool``'s ``status.nodes``. A pod the
scheduler cannot place is not blamed on kvoffload there: nothing injected requests the pool.
What is blamed is a pod the kubelet cannot start because it cannot mount the node agent's CSI
volume (``kvoffload-node``): a pod still Pending on its node with a ``FailedMount`` event
(the kubelet's, from the namespace's events) for that volume. ``NodeAgentUnavailable``: the
driver is not registered on that node or does not answer (no agent there, or the agent down);
``NodeMountRefused``: the agent answered a refusal (a volume the webhook did not write). The
condition names the nodes; the kubelet retries the mount, so the pod starts once an agent
serves there.

The node pool itself (``node_pool``): the operator reads the ``KVOffloadNodePool`` the policy
names and checks what the agent checks at each publish (`node_pool`). The pool missing
(``NodePoolNotFound``), without the tenant, or with a grant that does not admit the policy's
namespace or a pod's service account (``TenantNotGranted``) is a cause of ``Degraded`` ranked
with ``PoolUnavailable``: such pods start and serve without the pool. It is reported before any
pod exists too. ``status.nodePool`` names the pool and tenant and sums the tenant's memfds over
the nodes whose agent reports it (``sharedCapacityBytes``): shared by every pod of the tenant on
a node, so counted once per node, never per replica.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvoffload_operator import annotations as ann
from kvoffload_operator.hashseed import weak_hash_algo
from kvoffload_operator.inject.reserved import INSTALLER_NAME, SIDECAR_NAME
from kvoffload_operator.node_pool import (
    NODE_POOL_NOT_FOUND,
    TENANT_NOT_GRANTED,
    NodePoolRead,
    refused_pods,
)
from kvoffload_operator.policy import Policy
from kvoffload_operator.pool_usage import pool_usage
from kvoffload_operator.selection import select_policy
from kvoffload_operator.sidecar_reports import SidecarReport

Condition = dict[str, Any]
# waiting reasons of our containers that keep the pod from starting or the sidecar from serving
FAILING_REASONS = frozenset(
    {"ImagePullBackOff", "ErrImagePull", "InvalidImageName", "CrashLoopBackOff"}
)
PULL_REASONS = frozenset({"ImagePullBackOff", "ErrImagePull", "InvalidImageName"})
UNSCHEDULABLE = "Unschedulable"  # the scheduler's PodScheduled reason, for what we add
# the scheduler's words for a resource the sidecar requests (its memory holds the pool)
ADDED_RESOURCE_SHORTAGES = ("Insufficient memory", "Insufficient hugepages", "Insufficient cpu")
OUR_CONTAINERS = (SIDECAR_NAME, INSTALLER_NAME)
MAX_NAMED_PODS = 5  # the condition's message names this many pods, then counts the rest
MAX_CAUSE_CHARS = 160  # one pod's cause in the condition's message
MAX_SKIP_REASONS = 32  # status.skipped's maxProperties in the CRD
POOL_UNAVAILABLE = "PoolUnavailable"  # the sidecar serves without a pool
CONNECTOR_DISABLED = "ConnectorDisabled"  # a vLLM connector serves without the pool
NODE_AGENT_UNAVAILABLE = "NodeAgentUnavailable"  # no node agent serves the pod's CSI volume
NODE_MOUNT_REFUSED = "NodeMountRefused"  # the node agent refused to publish the volume
NODE_REASONS = frozenset({NODE_AGENT_UNAVAILABLE, NODE_MOUNT_REFUSED})
NODE_POOL_REASONS = frozenset({NODE_POOL_NOT_FOUND, TENANT_NOT_GRANTED})  # the pod serves
NODE_VOLUME = "kvoffload-node"  # the webhook's CSI inline volume (tested to be the injected one)
NODE_DRIVER = "node.kvoffload.io"
FAILED_MOUNT = "FailedMount"  # the kubelet's event reason
# the kubelet's words when no driver answers (csi_mounter.go, csi_client.go; gRPC's codes)
_NO_DRIVER = (
    "not found in the list of registered CSI drivers",
    "code = Unavailable",
    "code = DeadlineExceeded",
    "connection refused",
    "no such file or directory",
)
MAX_NAMED_NODES = 10


@dataclass(frozen=True)
class ContainerProblem:
    """One of our containers in one pod that cannot run, from the pod's status."""

    pod: str
    namespace: str
    uid: str
    container: str
    reason: str  # the kubelet's waiting reason (ImagePullBackOff...), PoolUnavailable, ...
    message: str  # the kubelet's message (e.g. the pull error) or the sidecar's reason
    node: str = ""  # the pod's node, for the causes that are the node's (NODE_REASONS)

    @property
    def key(self) -> tuple[str, str, str]:
        """Identity for reporting once: the pod (uid), the container and the reason."""
        return (self.uid or f"{self.namespace}/{self.pod}", self.container, self.reason)

    @property
    def pod_key(self) -> str:
        return self.uid or f"{self.namespace}/{self.pod}"

    @property
    def serving(self) -> bool:
        """From the sidecar's Stats (the pod runs, without the pool), not the pod's status."""
        return self.reason in (POOL_UNAVAILABLE, CONNECTOR_DISABLED, *NODE_POOL_REASONS)

    @property
    def field_path(self) -> str:
        """The Event's ``involvedObject.fieldPath``: our init container or the vLLM container."""
        if not self.container:
            return ""
        kind = "initContainers" if self.container in OUR_CONTAINERS else "containers"
        return f"spec.{kind}{{{self.container}}}"


def container_problems(pods: Sequence[Mapping[str, Any]]) -> list[ContainerProblem]:
    """Our init containers (sidecar, installer) stuck in a failing state, pod by pod."""
    out = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        for st in (pod.get("status") or {}).get("initContainerStatuses") or []:
            if st.get("name") not in OUR_CONTAINERS:
                continue
            waiting = (st.get("state") or {}).get("waiting") or {}
            if waiting.get("reason") in FAILING_REASONS:
                out.append(
                    ContainerProblem(
                        pod=str(meta.get("name", "?")),
                        namespace=str(meta.get("namespace", "")),
                        uid=str(meta.get("uid", "")),
                        container=str(st["name"]),
                        reason=str(waiting["reason"]),
                        message=str(waiting.get("message", "")),
                    )
                )
    return out


def unschedulable_problems(pods: Sequence[Mapping[str, Any]]) -> list[ContainerProblem]:
    """Pending pods the scheduler places nowhere for want of a resource the sidecar requests:
    the pod waits, where without kvoffload it might have run."""
    out = []
    for pod in pods:
        status = pod.get("status") or {}
        if status.get("phase") not in (None, "Pending"):
            continue
        for cond in status.get("conditions") or []:
            message = str(cond.get("message", ""))
            if (
                cond.get("type") == "PodScheduled"
                and cond.get("status") == "False"
                and cond.get("reason") == UNSCHEDULABLE
                and any(s in message for s in ADDED_RESOURCE_SHORTAGES)
            ):
                meta = pod.get("metadata") or {}
                out.append(
                    ContainerProblem(
                        pod=str(meta.get("name", "?")),
                        namespace=str(meta.get("namespace", "")),
                        uid=str(meta.get("uid", "")),
                        container=SIDECAR_NAME,
                        reason=UNSCHEDULABLE,
                        message=message,
                    )
                )
    return out


def _event_time(event: Mapping[str, Any]) -> str:
    series = event.get("series") or {}
    return str(
        series.get("lastObservedTime")
        or event.get("lastTimestamp")
        or event.get("eventTime")
        or event.get("firstTimestamp")
        or ""
    )


def _names_node_volume(message: str) -> bool:
    """The kubelet's FailedMount messages for the node volume: `MountVolume.SetUp failed for
    volume "kvoffload-node" : ...` or `... unmounted volumes=[kvoffload-node ...]: ...`."""
    if f'volume "{NODE_VOLUME}"' in message:
        return True
    unmounted = message.partition("unmounted volumes=[")[2].partition("]")[0]
    return NODE_VOLUME in unmounted.split()


def node_mount_problems(
    mine: Sequence[Mapping[str, Any]], events: Sequence[Mapping[str, Any]]
) -> list[ContainerProblem]:
    """Injected pods (placement node) the kubelet cannot start for want of the node volume:
    still Pending on a node, with a ``FailedMount`` event for ``kvoffload-node``. The latest
    event naming a cause (``MountVolume.SetUp failed``) decides which; a pod whose events only
    say the wait timed out is counted as waiting for the agent."""
    by_pod: dict[str, list[Mapping[str, Any]]] = {}
    for e in events:
        obj = e.get("involvedObject") or {}
        if e.get("reason") != FAILED_MOUNT or obj.get("kind", "Pod") != "Pod":
            continue
        if not _names_node_volume(str(e.get("message", ""))):
            continue
        for key in (obj.get("uid"), f"{obj.get('namespace', '')}/{obj.get('name', '')}"):
            if key:
                by_pod.setdefault(str(key), []).append(e)
    out = []
    for pod in mine:
        meta, status = pod.get("metadata") or {}, pod.get("status") or {}
        node = str((pod.get("spec") or {}).get("nodeName") or "")
        if status.get("phase") not in (None, "Pending") or not node:
            continue
        uid = str(meta.get("uid") or "")
        found = by_pod.get(uid) if uid else None
        if found is None:
            found = by_pod.get(f"{meta.get('namespace', '')}/{meta.get('name', '')}", [])
        if not found:
            continue
        found = sorted(found, key=_event_time)
        causes = [e for e in found if "MountVolume.SetUp failed" in str(e.get("message", ""))]
        message = str((causes or found)[-1].get("message", ""))
        cause = message.partition(" : ")[2] or message
        unavailable = not causes or any(w in cause for w in _NO_DRIVER)
        out.append(
            ContainerProblem(
                pod=str(meta.get("name", "?")),
                namespace=str(meta.get("namespace", "")),
                uid=uid,
                container="",
                reason=NODE_AGENT_UNAVAILABLE if unavailable else NODE_MOUNT_REFUSED,
                message=cause,
                node=node,
            )
        )
    return out


def skipped_counts(pods: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """Pods carrying ``kvoffload.io/skip-reason``, counted per reason; the most frequent
    `MAX_SKIP_REASONS` only, since a pod's author can write any value there and the CRD bounds
    ``status.skipped`` (a status over it would be refused whole)."""
    out: dict[str, int] = {}
    for pod in pods:
        reason = ((pod.get("metadata") or {}).get("annotations") or {}).get(ann.SKIP_REASON)
        if reason:
            out[str(reason)] = out.get(str(reason), 0) + 1
    kept = sorted(out.items(), key=lambda kv: (-kv[1], kv[0]))[:MAX_SKIP_REASONS]
    return dict(sorted(kept))


def injected_pods(policy: Policy, pods: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Active pods of ``pods`` that ``policy`` injected."""
    return [p for p in pods if _active(p) and injected_by(p) == policy.name]


def serving_problems(reports: Sequence[SidecarReport]) -> list[ContainerProblem]:
    """Pods whose sidecar answered that they serve without the pool: one problem per pod, the
    pool's reason first (the connectors are off because of it), else the disabled connectors."""
    out = []
    for r in reports:
        if not r.reachable:
            continue
        if r.degraded_reason:
            out.append(
                ContainerProblem(
                    r.pod, r.namespace, r.uid, SIDECAR_NAME, POOL_UNAVAILABLE, r.degraded_reason
                )
            )
        elif disabled := r.disabled_connectors:
            causes = sorted({c.describe() for c in disabled})
            out.append(
                ContainerProblem(
                    r.pod,
                    r.namespace,
                    r.uid,
                    r.vllm_container,
                    CONNECTOR_DISABLED,
                    "; ".join(causes[:3])
                    + (f" (+{len(causes) - 3} more)" if len(causes) > 3 else ""),
                )
            )
    return out


def _severity(problem: ContainerProblem) -> int:
    return {
        POOL_UNAVAILABLE: 1,
        NODE_POOL_NOT_FOUND: 1,
        TENANT_NOT_GRANTED: 1,
        CONNECTOR_DISABLED: 2,
    }.get(problem.reason, 0)


def node_pool_problems(
    mine: Sequence[Mapping[str, Any]], node_pool: NodePoolRead | None
) -> list[ContainerProblem]:
    """Injected pods (placement node) whose tenant the node agent will refuse: the pool
    missing, no such tenant, or a grant that does not admit the pod's namespace or service
    account. They start and serve without the pool."""
    if node_pool is None:
        return []
    out = []
    for pod, reason, message in refused_pods(node_pool, mine):
        meta = pod.get("metadata") or {}
        out.append(
            ContainerProblem(
                pod=str(meta.get("name", "?")),
                namespace=str(meta.get("namespace", "")),
                uid=str(meta.get("uid", "")),
                container="",
                reason=reason,
                message=message,
                node=str((pod.get("spec") or {}).get("nodeName") or ""),
            )
        )
    return out


def degraded_problems(
    mine: Sequence[Mapping[str, Any]],
    reports: Sequence[SidecarReport] = (),
    *,
    node: bool = False,
    events: Sequence[Mapping[str, Any]] = (),
    node_pool: NodePoolRead | None = None,
) -> list[ContainerProblem]:
    """Every cause of ``Degraded`` among the injected pods ``mine``, worst first (see the module
    doc): a pod with a failing container gets no Stats-derived problem. ``node``: placement node,
    where nothing injected requests the pool, so an unschedulable pod is not kvoffload's doing,
    and a pod whose node volume cannot be mounted (the namespace's ``events``) is, as is one
    whose tenant the node pool does not grant (``node_pool``, the object read)."""
    failing = [
        *(node_mount_problems(mine, events) if node else unschedulable_problems(mine)),
        *container_problems(mine),
    ]
    blocked = {p.pod_key for p in failing}
    live = {(p.get("metadata") or {}).get("uid") or "" for p in mine}
    names = {
        f"{(p.get('metadata') or {}).get('namespace', '')}/{(p.get('metadata') or {}).get('name')}"
        for p in mine
    }
    served = [
        p
        for p in serving_problems(reports)
        if p.pod_key not in blocked and (p.uid in live or f"{p.namespace}/{p.pod}" in names)
    ]
    if node:
        served += [p for p in node_pool_problems(mine, node_pool) if p.pod_key not in blocked]
    return sorted([*failing, *served], key=_severity)  # stable: pod order kept within a cause


def reports_of(
    mine: Sequence[Mapping[str, Any]], reports: Sequence[SidecarReport]
) -> list[SidecarReport]:
    """The reports of the pods in ``mine`` (by uid, else namespace/name)."""
    uids = {(p.get("metadata") or {}).get("uid") or "" for p in mine} - {""}
    names = {
        f"{(p.get('metadata') or {}).get('namespace', '')}/{(p.get('metadata') or {}).get('name')}"
        for p in mine
    }
    return [r for r in reports if r.uid in uids or f"{r.namespace}/{r.pod}" in names]


def degraded_counts(problems: Sequence[ContainerProblem]) -> tuple[int, dict[str, int]]:
    """(pods with any problem, problems per reason)."""
    reasons: dict[str, int] = {}
    for p in problems:
        reasons[p.reason] = reasons.get(p.reason, 0) + 1
    return len({p.pod_key for p in problems}), dict(sorted(reasons.items()))


def _named(problem: ContainerProblem) -> str:
    if problem.reason in NODE_REASONS:
        return f"{problem.pod} (node {problem.node}: {_clip(problem.message)})"
    if problem.reason == UNSCHEDULABLE:
        return f"{problem.pod} ({problem.reason}: {_clip(problem.message)})"
    if not problem.serving:
        return f"{problem.pod} ({problem.container}: {problem.reason})"
    return f"{problem.pod} ({problem.reason}: {_clip(problem.message)})"


def _clip(cause: str) -> str:
    """One pod's cause as the condition's message quotes it: MAX_CAUSE_CHARS at most."""
    return cause if len(cause) <= MAX_CAUSE_CHARS else cause[: MAX_CAUSE_CHARS - 3] + "..."


def _degraded(
    problems: Sequence[ContainerProblem], pool_refusal: tuple[str, str] | None = None
) -> tuple[str, str, str]:
    """(status, reason, message) of the ``Degraded`` condition; ``problems`` worst first.
    ``pool_refusal``: the node pool refuses every pod of the policy (placement node), said even
    while no pod is injected."""
    if not problems and pool_refusal is not None:
        return ("True", pool_refusal[0], f"{pool_refusal[1]} (no injected pod yet)")
    if not problems:
        return (
            "False",
            "SidecarsRunning",
            "no injected pod has a failing kvoffload container, a sidecar without its pool "
            "or a disabled connector",
        )
    named = [_named(p) for p in problems[:MAX_NAMED_PODS]]
    more = len(problems) - len(named)
    containers = {p.reason for p in problems if not p.serving}
    if containers:
        if containers <= PULL_REASONS:
            reason = "ImagePullFailed"
        elif containers == {UNSCHEDULABLE}:
            reason = UNSCHEDULABLE
        elif containers <= NODE_REASONS:  # an agent missing anywhere is the first thing to fix
            reason = (
                NODE_AGENT_UNAVAILABLE
                if NODE_AGENT_UNAVAILABLE in containers
                else NODE_MOUNT_REFUSED
            )
        else:
            reason = "ContainerFailing"
    else:
        reason = problems[0].reason  # PoolUnavailable before ConnectorDisabled
    head = {
        "ImagePullFailed": "cannot run a kvoffload container",
        "ContainerFailing": "cannot run a kvoffload container",
        UNSCHEDULABLE: "cannot be scheduled with the kvoffload sidecar's resources",
        POOL_UNAVAILABLE: "serve without the kvoffload pool",
        CONNECTOR_DISABLED: "serve without the kvoffload pool",
        NODE_POOL_NOT_FOUND: "serve without the kvoffload node pool",
        TENANT_NOT_GRANTED: "serve without the kvoffload node pool",
        NODE_AGENT_UNAVAILABLE: "wait in ContainerCreating: no kvoffload node agent (CSI driver "
        f"{NODE_DRIVER}) serves their volume on node(s) {_nodes(problems, NODE_AGENT_UNAVAILABLE)}",
        NODE_MOUNT_REFUSED: "wait in ContainerCreating: the kvoffload node agent refuses their "
        f"volume on node(s) {_nodes(problems, NODE_MOUNT_REFUSED)}",
    }[reason]
    pods = len({p.pod_key for p in problems})
    return (
        "True",
        reason,
        f"{pods} injected pod(s) {head}: "
        + ", ".join(named)
        + (f" and {more} more" if more else ""),
    )


def _nodes(problems: Sequence[ContainerProblem], reason: str) -> str:
    nodes = sorted({p.node for p in problems if p.reason == reason})
    named = ", ".join(nodes[:MAX_NAMED_NODES])
    return named + (
        f" and {len(nodes) - MAX_NAMED_NODES} more" if len(nodes) > MAX_NAMED_NODES else ""
    )


def noted_pods(
    mine: Sequence[Mapping[str, Any]], reports: Sequence[SidecarReport]
) -> list[tuple[str, str]]:
    """(pod, its connectors' notes joined) for each injected pod whose sidecar relayed notes."""
    return [
        (r.pod, "; ".join(r.connector_notes))
        for r in reports_of(mine, reports)
        if r.reachable and r.connector_notes
    ]


def _limited(noted: Sequence[tuple[str, str]]) -> tuple[str, str, str]:
    """(status, reason, message) of the ``Limited`` condition."""
    if not noted:
        return ("False", "NoLimits", "no injected pod's connector noted a limit")
    named = [f"{pod} ({_clip(note)})" for pod, note in noted[:MAX_NAMED_PODS]]
    more = len(noted) - len(named)
    return (
        "True",
        "ConnectorNotes",
        f"{len(noted)} injected pod(s) use the pool under a limit: "
        + ", ".join(named)
        + (f" and {more} more" if more else ""),
    )


def event_for(problem: ContainerProblem) -> tuple[str, str]:
    """(reason, message) of the one Warning Event posted on the pod for ``problem``."""
    if problem.reason == POOL_UNAVAILABLE:
        return (
            "KVOffloadPoolUnavailable",
            f"kvoffload sidecar serves without a pool: {problem.message}; vLLM serves without "
            "the KV offload tier. Fix the policy's pool settings (size, numaNode, hugepages) or "
            "the node.",
        )
    if problem.reason == UNSCHEDULABLE:
        return (
            "KVOffloadUnschedulable",
            f"no node fits this pod with the kvoffload sidecar's request (its memory holds the "
            f"pool): {problem.message}. Lower the policy's pool size (or this pod's "
            'kvoffload.io/pool-size), or opt the pod out (kvoffload.io/inject: "false").',
        )
    if problem.reason == NODE_AGENT_UNAVAILABLE:
        return (
            "KVOffloadNodeAgentUnavailable",
            f"no kvoffload node agent serves CSI driver {NODE_DRIVER} on node {problem.node} "
            f"({problem.message}); the pod waits in ContainerCreating until one does. Run the "
            "node agent DaemonSet on every node this workload can land on (chart value "
            "nodeAgent.enabled, with nodeAgent.nodeSelector and nodeAgent.tolerations covering "
            'these nodes), or opt the pod out (kvoffload.io/inject: "false").',
        )
    if problem.reason == NODE_MOUNT_REFUSED:
        return (
            "KVOffloadNodeMountRefused",
            f"the kvoffload node agent on node {problem.node} refuses this pod's volume "
            f"{NODE_VOLUME} ({problem.message}); the pod waits in ContainerCreating. The "
            "webhook's volume is always accepted: compare the pod's volume with the policy's "
            'injection, or opt the pod out (kvoffload.io/inject: "false").',
        )
    if problem.reason in NODE_POOL_REASONS:
        return (
            "KVOffload" + problem.reason,
            f"{problem.message}. vLLM serves without the KV offload tier (tokens unchanged); "
            "the node agent gives the pod its tenant once the pool grants it, without a restart.",
        )
    if problem.reason == CONNECTOR_DISABLED:
        return (
            "KVOffloadConnectorDisabled",
            f"kvoffload connector disabled in vLLM: {problem.message}; vLLM serves without the "
            "pool (tokens unchanged).",
        )
    return (
        "KVOffloadContainerFailing",
        f"kvoffload container {problem.container} is in {problem.reason}"
        + (f" ({problem.message})" if problem.message else "")
        + "; the pod's vLLM container waits until it runs. Fix the image, or opt the pod out "
        '(kvoffload.io/inject: "false") to serve without kvoffload.',
    )


def set_condition(
    conditions: Sequence[Condition],
    type_: str,
    status: str,
    reason: str,
    message: str,
    generation: int,
    now: str,
) -> list[Condition]:
    """``conditions`` with ``type_`` set (added or replaced); other types are kept in order."""
    old = next((c for c in conditions if c.get("type") == type_), None)
    since = old["lastTransitionTime"] if old and old.get("status") == status else now
    new = {
        "type": type_,
        "status": status,
        "reason": reason,
        "message": message,
        "observedGeneration": generation,
        "lastTransitionTime": since,
    }
    out = [new if c.get("type") == type_ else dict(c) for c in conditions]
    return out if old else [*out, new]


def _active(pod: Mapping[str, Any]) -> bool:
    meta = pod.get("metadata") or {}
    phase = (pod.get("status") or {}).get("phase")
    return not meta.get("deletionTimestamp") and phase not in ("Succeeded", "Failed")


def injected_by(pod: Mapping[str, Any]) -> str | None:
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    if ann.STATUS not in annotations:
        return None
    try:
        return str(json.loads(annotations[ann.STATUS]).get("policy"))
    except ValueError:
        return annotations.get(ann.POLICY)


def sidecar_ready(pod: Mapping[str, Any]) -> bool:
    for status in (pod.get("status") or {}).get("initContainerStatuses") or []:
        if status.get("name") == SIDECAR_NAME:
            return bool(status.get("started")) and bool(status.get("ready"))
    return False


def build_status(
    policy: Policy,
    pods: Sequence[Mapping[str, Any]],
    namespace_policies: Sequence[Policy],
    *,
    namespace_enabled: bool,
    now: str,
    previous: Mapping[str, Any] | None = None,
    reports: Sequence[SidecarReport] = (),
    pods_visible: bool = True,
    events: Sequence[Mapping[str, Any]] = (),
    node_pool: NodePoolRead | None = None,
) -> dict[str, Any]:
    """The ``status`` of ``policy`` given the pods of its namespace (any; filtered here) and
    what their sidecars said over Stats (``reports``; none when not asked). ``pods_visible``
    False: the operator may not list pods there, so the counts are unknown (0) and the
    ``PodsVisible`` condition says so. ``events``: the namespace's ``FailedMount`` events
    (placement node: pods waiting for the node agent's volume; others ignore them).
    ``node_pool``: the ``KVOffloadNodePool`` a node policy names, as read (placement node)."""
    matched = [
        p
        for p in pods
        if _active(p) and policy.selector.matches((p.get("metadata") or {}).get("labels"))
    ]
    mine = injected_pods(policy, matched)
    node = policy.pool.node
    if node:  # no sidecar to have asked; whatever was passed is not these pods'
        reports = ()
    else:
        node_pool = None
    winners: dict[str, bool] = {}  # other winner -> decided by name only
    for pod in matched:
        sel = select_policy((pod.get("metadata") or {}).get("labels"), namespace_policies)
        if sel.winner is not None and sel.winner.name != policy.name:
            winners[sel.winner.name] = winners.get(sel.winner.name, False) or (
                sel.winner.priority == policy.priority
            )
    conditions = list((previous or {}).get("conditions") or [])
    gen = policy.generation
    if namespace_enabled:
        conditions = set_condition(
            conditions,
            "Ready",
            "True",
            "Applied",
            f"{len(matched)} pods matched, {len(mine)} injected, "
            + (
                f"using tenant {policy.pool.tenant!r} of node pool {policy.pool.node_pool!r}"
                if node
                else f"{sum(map(sidecar_ready, mine))} sidecars ready"
            ),
            gen,
            now,
        )
    else:
        conditions = set_condition(
            conditions,
            "Ready",
            "False",
            "InjectionDisabled",
            f"namespace {policy.namespace!r} lacks the label {ann.NAMESPACE_INJECTION}=enabled; "
            "the webhook does not see its pods",
            gen,
            now,
        )
    if winners:
        tie = any(winners.values())
        names = ", ".join(sorted(winners))
        conditions = set_condition(
            conditions,
            "Conflicting",
            "True",
            "PriorityTie" if tie else "LowerPriority",
            f"policy {names} wins some pods this policy selects"
            + (" (equal priority, decided by name; set distinct priorities)" if tie else ""),
            gen,
            now,
        )
    else:
        conditions = set_condition(
            conditions,
            "Conflicting",
            "False",
            "NoConflict",
            "no other policy wins a selected pod",
            gen,
            now,
        )
    problems = degraded_problems(mine, reports, node=node, events=events, node_pool=node_pool)
    pool_refusal = node_pool.refusal() if node_pool is not None else None
    conditions = set_condition(conditions, "Degraded", *_degraded(problems, pool_refusal), gen, now)
    degraded_pods, degraded_reasons = degraded_counts(problems)
    noted = noted_pods(mine, reports)
    conditions = set_condition(conditions, "Limited", *_limited(noted), gen, now)
    conditions = _optional_condition(
        conditions,
        "PodsVisible",
        None
        if pods_visible
        else (
            "NoPodAccess",
            f"the operator may not list pods in namespace {policy.namespace!r}: pod counts and "
            "sidecar health are unknown, and no hash-seed Secret is created there (add the "
            "namespace to the chart's rbac.namespaces)",
        ),
        gen,
        now,
        status="False",
    )
    conditions = _optional_condition(
        conditions,
        "NodePlacement",
        (
            "SidecarStatsNotAsked",
            f"pods use tenant {policy.pool.tenant!r} of node pool {policy.pool.node_pool!r} "
            "through the node agent's CSI volume: they have no sidecar, so none is asked for "
            "Stats (readySidecars, unreachableSidecars, poolCapacity and poolUsed stay 0); the "
            f"node agents report in KVOffloadNodePool {policy.pool.node_pool!r} (status.nodes; "
            "the tenant's capacity there, shared by its pods, is status.nodePool)"
            + (
                f"; the operator could not read that pool: {node_pool.error}"
                if node_pool is not None and not node_pool.readable
                else ""
            ),
        )
        if node
        else None,
        gen,
        now,
    )
    weak = [(p, algo) for p in mine if (algo := weak_hash_algo_of(p)) is not None]
    conditions = _optional_condition(
        conditions,
        "WeakPrefixHash",
        (
            "NonCryptographicHash",
            f"{len(weak)} injected pods hash prefixes with {weak[0][1]} and share the policy's "
            "seed (and the pool keeps blocks across restarts): whoever learns the seed can craft "
            "colliding prompts that read or poison cached KV; use sha256 (vLLM's default): "
            + ", ".join(
                str((p.get("metadata") or {}).get("name")) for p, _ in weak[:MAX_NAMED_PODS]
            ),
        )
        if weak
        else None,
        gen,
        now,
    )
    pool_status: dict[str, Any] = {}
    if node and node_pool is not None:
        pool_status["nodePool"] = node_pool.status()
    elif (previous or {}).get("nodePool") is not None:  # now pod placement: the patch drops it
        pool_status["nodePool"] = None
    return {
        "observedGeneration": gen,
        "skipped": skipped_counts(matched),
        "matchedPods": len(matched),
        "injectedPods": len(mine),
        "readySidecars": sum(1 for p in mine if sidecar_ready(p)),
        "degradedPods": degraded_pods,
        "degradedReasons": degraded_reasons,
        "unreachableSidecars": sum(1 for r in reports if not r.reachable),
        "notedPods": len(noted),
        **pool_usage(reports_of(mine, reports)).status(),
        "policyHash": policy.spec_hash,
        **pool_status,
        "conditions": conditions,
    }


def _optional_condition(
    conditions: Sequence[Condition],
    type_: str,
    problem: tuple[str, str] | None,
    generation: int,
    now: str,
    status: str = "True",
) -> list[Condition]:
    """A condition present only while its problem is: set with ``status`` when ``problem``
    (reason, message) is given, dropped otherwise."""
    if problem is None:
        return [c for c in conditions if c.get("type") != type_]
    return set_condition(conditions, type_, status, *problem, generation, now)


def weak_hash_algo_of(pod: Mapping[str, Any]) -> str | None:
    """The non-cryptographic prefix-cache hash an injected pod's vLLM container asks for."""
    try:
        name = json.loads(((pod.get("metadata") or {}).get("annotations") or {})[ann.STATUS])[
            "vllmContainer"
        ]
    except (KeyError, ValueError, TypeError):
        return None
    for c in (pod.get("spec") or {}).get("containers") or []:
        if c.get("name") == name:
            return weak_hash_algo(c)
    return None


def invalid_status(
    generation: int,
    message: str,
    now: str,
    previous: Mapping[str, Any] | None = None,
    reason: str = "InvalidSpec",
) -> dict[str, Any]:
    """Status of a policy the operator cannot parse (the API server normally prevents this) or
    that the cluster admin does not allow (``reason`` NotAllowed): never injected."""
    conditions = set_condition(
        list((previous or {}).get("conditions") or []),
        "Ready",
        "False",
        reason,
        message,
        generation,
        now,
    )
    return {"observedGeneration": generation, "conditions": conditions}
