"""In-place upgrades of the node agent container (pure: decisions and patches, no API calls).

The node agent DaemonSet (chart value ``nodeAgent.upgrade: inPlace``) has ``updateStrategy:
OnDelete`` and the label ``LABEL: inPlace``: the DaemonSet controller never replaces its pods.
When the template's ``agent`` container names another image than a pod's, the operator changes
that one container's image in the pod (a JSON patch guarded by ``test`` operations on the
container's name and old image); the kubelet restarts only that container, the ``holder``
keeps every tenant's memfd and the new agent adopts the pools. One pod at a time: the next only
once the patched pod's agent runs and is ready with the new image; a pod that is not back within
the timeout halts the upgrade until it is.

The progress lives on each patched pod, in the annotation ``ANNOTATION`` (JSON ``{"image",
"since"}`` and then ``"done"`` or ``"stalled"``, each a UTC time), so a restarted operator or
another replica continues where one stopped; each transition is a patch that ``test``s the
previous value, so only one replica makes it and posts its Event.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from kvoffload_operator.annotations import PREFIX

LABEL = PREFIX + "agent-upgrade"
"""On the DaemonSet: ``inPlace`` lets the operator patch its pods' agent image."""
IN_PLACE = "inPlace"
ANNOTATION = PREFIX + "agent-upgrade"
"""On a patched pod: the upgrade's progress (JSON)."""
AGENT = "agent"
"""The container upgraded in place (never the holder, an init container)."""

Action = Literal["done", "patch", "wait", "stalled", "blocked"]


@dataclass(frozen=True)
class AgentPod:
    """What the decision needs of one agent pod."""

    name: str
    node: str
    index: int  # of the agent container in spec.containers
    image: str  # the agent container's image in the pod's spec
    command: tuple[str, ...]
    args: tuple[str, ...]
    running_image: str  # status: the image the agent container runs
    image_id: str
    ready: bool
    running: bool
    upgrade: Mapping[str, Any] | None  # the ANNOTATION, parsed
    annotation: str | None  # its raw value (what a patch tests)
    has_annotations: bool

    def back(self) -> bool:
        """The agent container runs, is ready and runs the image its spec names."""
        shown = image_matches(self.running_image, self.image_id, self.image)
        return self.running and self.ready and shown

    def upgrading(self) -> bool:
        """Patched by the operator to the image it names now, neither done nor stalled."""
        u = self.upgrade
        return bool(u) and u.get("image") == self.image and not u.get("done")


@dataclass(frozen=True)
class Step:
    """What to do next: ``patch`` ``pod``; ``wait`` for ``pod``; ``stalled``: ``pod`` is not
    back in time (nothing more is patched until it is); ``blocked``: the outdated pods' agent
    differs from the template in more than its image (``reason``), an in-place patch cannot
    bring that; ``done``. ``finished``: pods back with the image they were patched to, whose
    upgrade is to be marked done (and announced)."""

    action: Action
    pod: AgentPod | None = None
    image: str = ""
    finished: tuple[AgentPod, ...] = ()
    reason: str = ""


def _reference(ref: str) -> tuple[str, str, str]:
    """(repository with registry, tag, digest) of an image reference, Docker Hub defaults
    filled in (the kubelet may report ``docker.io/library/x:1`` for ``x:1``)."""
    name, _, digest = ref.partition("@")
    tag = ""
    slash = name.rfind("/")
    colon = name.rfind(":")
    if colon > slash:
        name, tag = name[:colon], name[colon + 1 :]
    elif not digest:
        tag = "latest"
    parts = name.split("/")
    if len(parts) == 1 or not ("." in parts[0] or ":" in parts[0] or parts[0] == "localhost"):
        parts = ["docker.io", *(["library"] if len(parts) == 1 else []), *parts]
    return "/".join(parts), tag, digest


def image_matches(reported: str, image_id: str, wanted: str) -> bool:
    """Whether a container status (``image``, ``imageID``) shows the image ``wanted``."""
    if not reported and not image_id:
        return False
    repo, tag, digest = _reference(wanted)
    if digest:
        return image_id.endswith("@" + digest) or _reference(reported)[2] == digest
    return _reference(reported)[:2] == (repo, tag)


def template_agent(daemonset: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The DaemonSet template's agent container."""
    spec = ((daemonset.get("spec") or {}).get("template") or {}).get("spec") or {}
    return next((c for c in spec.get("containers") or [] if c.get("name") == AGENT), None)


def in_place(daemonset: Mapping[str, Any]) -> bool:
    """The DaemonSet asks for in-place upgrades: the label, and OnDelete (a RollingUpdate
    DaemonSet replaces its pods itself, whatever the operator patched)."""
    labels = (daemonset.get("metadata") or {}).get("labels") or {}
    strategy = ((daemonset.get("spec") or {}).get("updateStrategy") or {}).get("type")
    return labels.get(LABEL) == IN_PLACE and strategy == "OnDelete"


def _owned(pod: Mapping[str, Any], uid: str) -> bool:
    return any(
        o.get("uid") == uid and o.get("controller")
        for o in (pod.get("metadata") or {}).get("ownerReferences") or []
    )


def agent_pod(pod: Mapping[str, Any]) -> AgentPod | None:
    """``pod``'s agent, None when it has none or is being deleted."""
    meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
    if meta.get("deletionTimestamp"):
        return None
    containers = spec.get("containers") or []
    index = next((i for i, c in enumerate(containers) if c.get("name") == AGENT), None)
    if index is None:
        return None
    agent = containers[index]
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    status = next((s for s in statuses if s.get("name") == AGENT), {})
    annotations = meta.get("annotations")
    raw = (annotations or {}).get(ANNOTATION)
    try:
        upgrade = json.loads(raw) if raw else None
    except ValueError:
        upgrade = None
    return AgentPod(
        name=str(meta.get("name") or ""),
        node=str(spec.get("nodeName") or ""),
        index=index,
        image=str(agent.get("image") or ""),
        command=tuple(agent.get("command") or ()),
        args=tuple(agent.get("args") or ()),
        running_image=str(status.get("image") or ""),
        image_id=str(status.get("imageID") or ""),
        ready=bool(status.get("ready")),
        running="running" in (status.get("state") or {}),
        upgrade=upgrade if isinstance(upgrade, dict) else None,
        annotation=raw,
        has_annotations=annotations is not None,
    )


def agent_pods(daemonset: Mapping[str, Any], pods: Sequence[Mapping[str, Any]]) -> list[AgentPod]:
    """The DaemonSet's own pods (its controller reference), by node then name."""
    uid = (daemonset.get("metadata") or {}).get("uid")
    found = [a for p in pods if _owned(p, uid) and (a := agent_pod(p)) is not None]
    return sorted(found, key=lambda a: (a.node, a.name))


def _since(pod: AgentPod) -> datetime.datetime | None:
    try:
        when = datetime.datetime.fromisoformat(str((pod.upgrade or {}).get("since")))
    except ValueError:
        return None
    return when if when.tzinfo else when.replace(tzinfo=datetime.timezone.utc)


def next_step(
    daemonset: Mapping[str, Any],
    pods: Sequence[Mapping[str, Any]],
    now: datetime.datetime,
    timeout_s: float,
) -> Step:
    """The next step of the DaemonSet's in-place upgrade (``pods``: its namespace's pods)."""
    template = template_agent(daemonset)
    if template is None or not in_place(daemonset):
        return Step("done", reason="not an in-place node agent DaemonSet")
    image = str(template.get("image") or "")
    agents = agent_pods(daemonset, pods)
    finished = tuple(a for a in agents if a.upgrading() and a.back())
    for a in agents:
        if a.upgrading() and a.image == image and not a.back():
            since = _since(a)
            late = since is None or (now - since).total_seconds() > timeout_s
            return Step("stalled" if late else "wait", a, image, finished)
    outdated = [a for a in agents if a.image != image]
    want = (tuple(template.get("command") or ()), tuple(template.get("args") or ()))
    same = [a for a in outdated if (a.command, a.args) == want]
    if same:
        return Step("patch", same[0], image, finished)
    if outdated:
        why = "the template changes the agent's command or args, which an in-place patch keeps"
        return Step("blocked", outdated[0], image, finished, reason=why)
    return Step("done", image=image, finished=finished)


def _stamp(now: datetime.datetime) -> str:
    return now.astimezone(datetime.timezone.utc).isoformat(timespec="seconds")


def _annotation_ops(pod: AgentPod, value: Mapping[str, Any]) -> list[dict[str, Any]]:
    encoded = json.dumps(dict(value), sort_keys=True)
    if not pod.has_annotations:
        return [{"op": "add", "path": "/metadata/annotations", "value": {ANNOTATION: encoded}}]
    path = "/metadata/annotations/" + ANNOTATION.replace("~", "~0").replace("/", "~1")
    ops: list[dict[str, Any]] = []
    if pod.annotation is not None:  # another replica's transition in between fails the patch
        ops.append({"op": "test", "path": path, "value": pod.annotation})
    return [*ops, {"op": "add", "path": path, "value": encoded}]


def image_patch(pod: AgentPod, image: str, now: datetime.datetime) -> list[dict[str, Any]]:
    """A JSON patch of ``pod``: its agent container's image (only if that container is still
    at its index with the old image) and the progress annotation."""
    base = f"/spec/containers/{pod.index}"
    return [
        {"op": "test", "path": f"{base}/name", "value": AGENT},
        {"op": "test", "path": f"{base}/image", "value": pod.image},
        {"op": "replace", "path": f"{base}/image", "value": image},
        *_annotation_ops(pod, {"image": image, "since": _stamp(now)}),
    ]


def mark_patch(pod: AgentPod, key: Literal["done", "stalled"], now: datetime.datetime) -> list:
    """A JSON patch marking ``pod``'s upgrade done or stalled (only from the value read)."""
    return _annotation_ops(pod, {**(pod.upgrade or {}), key: _stamp(now)})
