"""Policy status from observed pods (pure): counts, conditions, observedGeneration.

Conditions follow ``metav1.Condition``: ``lastTransitionTime`` changes only when ``status``
changes. ``Ready``: the policy is valid and its namespace admits injection. ``Conflicting``:
another policy wins some of the pods this one selects (see `selection`). ``Degraded``: some
injected pods' kvoffload containers cannot run (image pull failure, crash loop); no pod spec can
bypass a sidecar image that cannot be pulled (the kubelet starts no later container), so the
status names those pods and why. ``skipped``: matched pods left alone, counted per skip reason.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvoffload_operator import annotations as ann
from kvoffload_operator.inject.decide import SIDECAR_NAME
from kvoffload_operator.inject.render import INSTALLER_NAME
from kvoffload_operator.policy import Policy
from kvoffload_operator.selection import select_policy

Condition = dict[str, Any]
# waiting reasons of our containers that keep the pod from starting or the sidecar from serving
FAILING_REASONS = frozenset(
    {"ImagePullBackOff", "ErrImagePull", "InvalidImageName", "CrashLoopBackOff"}
)
OUR_CONTAINERS = (SIDECAR_NAME, INSTALLER_NAME)
MAX_NAMED_PODS = 5  # the condition's message names this many pods, then counts the rest


@dataclass(frozen=True)
class ContainerProblem:
    """One of our containers in one pod that cannot run, from the pod's status."""

    pod: str
    namespace: str
    uid: str
    container: str
    reason: str  # the kubelet's waiting reason, e.g. ImagePullBackOff
    message: str  # the kubelet's message (e.g. the pull error), may be empty

    @property
    def key(self) -> tuple[str, str, str]:
        """Identity for reporting once: the pod (uid), the container and the reason."""
        return (self.uid or f"{self.namespace}/{self.pod}", self.container, self.reason)


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


def skipped_counts(pods: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """Pods carrying ``kvoffload.io/skip-reason``, counted per reason."""
    out: dict[str, int] = {}
    for pod in pods:
        reason = ((pod.get("metadata") or {}).get("annotations") or {}).get(ann.SKIP_REASON)
        if reason:
            out[str(reason)] = out.get(str(reason), 0) + 1
    return dict(sorted(out.items()))


def injected_pods(policy: Policy, pods: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Active pods of ``pods`` that ``policy`` injected."""
    return [p for p in pods if _active(p) and injected_by(p) == policy.name]


def _degraded(problems: Sequence[ContainerProblem]) -> tuple[str, str, str]:
    """(status, reason, message) of the ``Degraded`` condition."""
    if not problems:
        return "False", "SidecarsRunning", "no injected pod has a failing kvoffload container"
    named = [f"{p.pod} ({p.container}: {p.reason})" for p in problems[:MAX_NAMED_PODS]]
    more = len(problems) - len(named)
    reasons = sorted({p.reason for p in problems})
    return (
        "True",
        "ImagePullFailed"
        if set(reasons) <= {"ImagePullBackOff", "ErrImagePull", "InvalidImageName"}
        else "ContainerFailing",
        f"{len(problems)} injected pod(s) cannot run a kvoffload container: "
        + ", ".join(named)
        + (f" and {more} more" if more else ""),
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
) -> dict[str, Any]:
    """The ``status`` of ``policy`` given the pods of its namespace (any; filtered here)."""
    matched = [
        p
        for p in pods
        if _active(p) and policy.selector.matches((p.get("metadata") or {}).get("labels"))
    ]
    mine = injected_pods(policy, matched)
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
            f"{sum(map(sidecar_ready, mine))} sidecars ready",
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
    conditions = set_condition(
        conditions, "Degraded", *_degraded(container_problems(mine)), gen, now
    )
    return {
        "observedGeneration": gen,
        "skipped": skipped_counts(matched),
        "matchedPods": len(matched),
        "injectedPods": len(mine),
        "readySidecars": sum(1 for p in mine if sidecar_ready(p)),
        "policyHash": policy.spec_hash,
        "conditions": conditions,
    }


def invalid_status(
    generation: int, message: str, now: str, previous: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Status of a policy the operator cannot parse (the API server normally prevents this)."""
    conditions = set_condition(
        list((previous or {}).get("conditions") or []),
        "Ready",
        "False",
        "InvalidSpec",
        message,
        generation,
        now,
    )
    return {"observedGeneration": generation, "conditions": conditions}
