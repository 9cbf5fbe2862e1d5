"""Where pod templates live in workload kinds (pure): used by `kvoffload inject` and rollouts.

A template path is a tuple of keys from the object to its pod template (``()`` for a Pod). Kinds
without one pass through the CLI unchanged.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from typing import Any

from kvoffload_operator import annotations as ann

TemplatePath = tuple[str, ...]

# kind -> template paths (optional ones are skipped when absent)
TEMPLATE_PATHS: dict[str, tuple[TemplatePath, ...]] = {
    "Pod": ((),),
    "Deployment": (("spec", "template"),),
    "StatefulSet": (("spec", "template"),),
    "ReplicaSet": (("spec", "template"),),
    "DaemonSet": (("spec", "template"),),
    "Job": (("spec", "template"),),
    "CronJob": (("spec", "jobTemplate", "spec", "template"),),
    # leaderworkerset.x-k8s.io: the leader template is optional (workers' is used when absent)
    "LeaderWorkerSet": (
        ("spec", "leaderWorkerTemplate", "leaderTemplate"),
        ("spec", "leaderWorkerTemplate", "workerTemplate"),
    ),
}
ROLLOUT_KINDS = ("Deployment", "StatefulSet")


def _get(obj: Mapping[str, Any], path: TemplatePath) -> Any:
    node: Any = obj
    for key in path:
        if not isinstance(node, Mapping) or key not in node:
            return None
        node = node[key]
    return node


def pod_templates(obj: Mapping[str, Any]) -> Iterator[tuple[TemplatePath, Mapping[str, Any]]]:
    """(path, template) for every pod template present in ``obj``."""
    for path in TEMPLATE_PATHS.get(str(obj.get("kind", "")), ()):
        template = _get(obj, path)
        if isinstance(template, Mapping):
            yield path, template


def replace_template(
    obj: Mapping[str, Any], path: TemplatePath, template: Mapping[str, Any]
) -> dict[str, Any]:
    """A copy of ``obj`` with the template at ``path`` replaced."""
    if not path:
        return copy.deepcopy(dict(template))
    out = copy.deepcopy(dict(obj))
    node = out
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = copy.deepcopy(dict(template))
    return out


def template_hash(obj: Mapping[str, Any]) -> str | None:
    template = _get(obj, ("spec", "template")) or {}
    return ((template.get("metadata") or {}).get("annotations") or {}).get(ann.POLICY_HASH)


def hash_patch(value: str) -> dict[str, Any]:
    """Merge patch that stamps ``kvoffload.io/policy-hash`` on a Deployment/StatefulSet template
    (a template change rolls the workload; the new pods pass through the webhook)."""
    return {"spec": {"template": {"metadata": {"annotations": {ann.POLICY_HASH: value}}}}}


def group_size(obj: Mapping[str, Any]) -> int | None:
    """Pods per group of a LeaderWorkerSet (its engines span them), None for other kinds."""
    if obj.get("kind") != "LeaderWorkerSet":
        return None
    size = ((obj.get("spec") or {}).get("leaderWorkerTemplate") or {}).get("size", 1)
    return size if isinstance(size, int) else None
