"""The in-place upgrade of the node agent container, run by the operator (``--agent-daemonset``).

Every ``--agent-upgrade-interval`` seconds: read the DaemonSet by name and its pods in the
operator's namespace, take `agent_upgrade.next_step`, do it. Events on the DaemonSet say what
happened: Normal ``AgentUpgraded`` per pod back with the new image, Warning
``AgentUpgradeStalled`` once per pod not back within ``--agent-upgrade-timeout``, Warning
``AgentUpgradeNeedsRollout`` once per image when the template changes more than the agent's
image. Never a pod deleted; never the holder touched. A started task of the operator, not a kopf
resource handler: kopf would put its finalizer and bookkeeping on the DaemonSet, and watch
DaemonSets in every namespace it serves; this reads one DaemonSet by name.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
from typing import Any

from kvoffload_operator import agent_upgrade as au
from kvoffload_operator.k8s import ApiError
from kvoffload_operator.settings import OperatorConfig

log = logging.getLogger(__name__)
UPGRADED = "AgentUpgraded"
STALLED = "AgentUpgradeStalled"
NEEDS_ROLLOUT = "AgentUpgradeNeedsRollout"


def _selector(daemonset: dict[str, Any]) -> str:
    labels = ((daemonset.get("spec") or {}).get("selector") or {}).get("matchLabels") or {}
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def _stamp(now: datetime.datetime) -> str:
    return now.astimezone(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def upgrade_once(
    api: Any,
    config: OperatorConfig,
    reported: set[tuple[str, str]],
    now: datetime.datetime | None = None,
) -> au.Step:
    """One round; returns the step taken. ``reported``: (DaemonSet uid, image) pairs already
    announced as needing a rollout (per operator process)."""
    ns, name = config.pod_namespace, config.agent_daemonset
    now = now or datetime.datetime.now(datetime.timezone.utc)
    ds = api.read_daemonset(ns, name)
    if ds is None:
        return au.Step("done", reason=f"no DaemonSet {ns}/{name}")
    step = au.next_step(ds, api.list_pods(ns, _selector(ds)), now, config.agent_upgrade_timeout)
    meta = ds["metadata"]
    involved = {"apiVersion": "apps/v1", "kind": "DaemonSet", "name": name, "uid": meta.get("uid")}

    def event(type_: str, reason: str, message: str) -> None:
        try:
            api.post_event(ns, involved, type_, reason, message, _stamp(now))
        except ApiError as exc:  # the change is made and marked; only its Event is lost
            log.warning("kvoffload: event %s on %s not posted: %s %s (%s)", reason, name,
                        exc.status, exc.reason, message)  # fmt: skip

    def mark(pod: au.AgentPod, key: Any) -> bool:
        try:
            api.json_patch_pod(ns, pod.name, au.mark_patch(pod, key, now))
        except ApiError as exc:  # another replica marked it (a failed test), or gone
            log.info("kvoffload: agent pod %s not marked %s: %s %s", pod.name, key, exc.status,
                     exc.reason)  # fmt: skip
            return False
        return True

    for pod in step.finished:
        if mark(pod, "done"):
            log.info("kvoffload: agent pod %s on node %s runs %s", pod.name, pod.node, pod.image)
            event("Normal", UPGRADED, f"pod {pod.name} on node {pod.node}: the agent container "
                  f"runs {pod.image}; the holder kept the node's pools")  # fmt: skip
    pod = step.pod
    if step.action == "patch" and pod is not None:
        try:
            api.json_patch_pod(ns, pod.name, au.image_patch(pod, step.image, now))
        except ApiError as exc:  # 422: a test failed (another replica patched it first)
            log.info("kvoffload: agent pod %s not patched: %s %s", pod.name, exc.status,
                     exc.reason)  # fmt: skip
            return step
        log.info("kvoffload: agent pod %s on node %s: agent image %s -> %s", pod.name, pod.node,
                 pod.image, step.image)  # fmt: skip
    elif step.action == "stalled" and pod is not None and not (pod.upgrade or {}).get("stalled"):
        if mark(pod, "stalled"):
            event("Warning", STALLED, f"pod {pod.name} on node {pod.node}: the agent container "
                  f"is not running and ready with {pod.image} within "
                  f"{config.agent_upgrade_timeout:g} s of its image change; no other agent pod "
                  f"is upgraded until it is (kubectl describe pod {pod.name} -n {ns})")  # fmt: skip
    elif step.action == "blocked" and pod is not None:
        key = (str(meta.get("uid")), step.image)
        if key not in reported:
            event("Warning", NEEDS_ROLLOUT, f"agent image {step.image} not applied in place: "
                  f"{step.reason}; delete the agent pods one by one (each node loses its "
                  "cache) or keep the running agents")  # fmt: skip
            reported.add(key)
    return step


async def upgrade_forever(api: Any, config: OperatorConfig) -> None:
    """`upgrade_once` every ``agent_upgrade_interval`` seconds until cancelled."""
    reported: set[tuple[str, str]] = set()
    while True:
        try:
            await asyncio.to_thread(upgrade_once, api, config, reported)
        except Exception as exc:  # the API unreachable, no RBAC: tried again next round
            log.warning("kvoffload: agent upgrade check of %s failed: %s", config.agent_daemonset,
                        exc)  # fmt: skip
        await asyncio.sleep(config.agent_upgrade_interval)
