"""Whether to inject a pod, and why not (pure). Every reason is in docs/INJECTION.md.

Precedence (first match wins; every step reads only the pod and the policies):
1. opted out: label or annotation ``kvoffload.io/inject: "false"``            → OPTED_OUT
2. no policy of the namespace selects the pod's labels                          → NO_MATCHING_POLICY
3. already injected (our ``kvoffload.io/status`` annotation: the injector's record, never a
   container name or our label alone): by the winning policy → ALREADY_INJECTED (no change);
   by another → CONFLICTING_POLICIES
4. kvoffload wired by hand (its sidecar, mounts under /kvoffload or /var/run/kvoffload, the
   node agent's CSI volume, KVOffloadConnector)                                   → HAND_WIRED
5. ``hostNetwork: true`` (the sidecar's ports would bind on the node; not with placement node,
   which adds no sidecar)                                                        → HOST_NETWORK
6. a per-pod ``kvoffload.io/pool-size`` the policy rules reject (ignored with placement node:
   the node pool's tenant share is the memory), or an unknown
   ``kvoffload.io/inject-via``                                                    → INVALID_OVERRIDE
7. the engine spans pods (LeaderWorkerSet size > 1, Ray cluster nodes)          → MULTI_NODE
8. the vLLM container: named (pod annotation, else ``spec.vllmContainer.name``) or detected
   (see `engine`: ``vllm serve|run-batch``, ``vllm bench throughput|latency``, ``python -m
   vllm.entrypoints...``, huggingfaceserver ``--backend vllm``, a ``sh -c`` script with one
   engine invocation (here-document texts are data) or running its arguments (``exec "$@"``),
   a vLLM image's entrypoint); missing                                           → NO_VLLM_CONTAINER
9. it already configures a KV connector (``--kv-transfer-config`` in args, shell text or env)
                                                                        → HAS_KV_TRANSFER_CONFIG
   vLLM's own offloading (``--kv-offloading-size|backend``, VLLM_USE_SIMPLE_KV_OFFLOAD)
                                                                        → HAS_KV_OFFLOADING
   another stack's KV cache by env (LMCache, AIBrix, Dynamo KVBM, NIXL…) → OTHER_KV_CACHE
   its ranks span pods (launcher flags)                                  → MULTI_NODE
10. what runs cannot be seen — unless ``inject-via`` (annotation, else
   ``spec.vllmContainer.injectVia``) says how the config gets there:
   a client only (``vllm bench serve``, huggingfaceserver's HF backend; no override) → NO_ENGINE
   a script with several engines, or none recognised                    → SHELL_WRAPPER
   a script file, a ConfigMap script, an unknown image entrypoint       → OPAQUE_ENTRYPOINT
   ``--config FILE`` not in the spec (it may set the connector)          → CONFIG_FILE
   huggingfaceserver ``--backend auto`` (vLLM or not is chosen at start) → BACKEND_AUTO
11. the pod already has what the rendering adds (`reserved`): a container, volume or env
   name → NAME_CLASH; a device at, above or under a path mounted in the vLLM container
   → PATH_CLASH; a port the sidecar binds, declared or in a flag or env → PORT_CLASH
Otherwise inject with the winner (see `selection` for how overlaps resolve).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from kvoffload_operator import annotations as ann
from kvoffload_operator.inject.conflicts import (
    clashes,
    config_file,
    conflicts,
    hand_wired,
    multi_node,
)
from kvoffload_operator.inject.container import shell_script
from kvoffload_operator.inject.engine import append_edit, engine_site
from kvoffload_operator.inject.site import NOT_VLLM, Edit, EnvEdit, Problem, Site
from kvoffload_operator.policy import InjectVia, Policy, PolicyError, pool_from_spec
from kvoffload_operator.selection import select_policy


class SkipReason(str, Enum):
    """Why a pod was left alone; the value is written to ``kvoffload.io/skip-reason``."""

    OPTED_OUT = "opted-out"
    NO_MATCHING_POLICY = "no-matching-policy"
    ALREADY_INJECTED = "already-injected"
    CONFLICTING_POLICIES = "conflicting-policies"
    HOST_NETWORK = "host-network"
    INVALID_OVERRIDE = "invalid-override"
    HAND_WIRED = "hand-wired"
    NO_VLLM_CONTAINER = "no-vllm-container"
    SHELL_WRAPPER = "shell-wrapper"
    OPAQUE_ENTRYPOINT = "opaque-entrypoint"
    CONFIG_FILE = "config-file"
    BACKEND_AUTO = "backend-auto"
    NO_ENGINE = "no-engine"
    HAS_KV_TRANSFER_CONFIG = "has-kv-transfer-config"
    HAS_KV_OFFLOADING = "has-kv-offloading"
    OTHER_KV_CACHE = "other-kv-cache"
    MULTI_NODE = "multi-node"
    NAME_CLASH = "name-clash"
    PATH_CLASH = "path-clash"
    PORT_CLASH = "port-clash"
    ERROR = "error"  # the injector itself failed; the pod is admitted unchanged

    @property
    def annotated(self) -> bool:
        """Whether the pod gets a skip annotation (not when nothing targeted it, or no-op)."""
        return self not in (SkipReason.NO_MATCHING_POLICY, SkipReason.ALREADY_INJECTED)


@dataclass(frozen=True)
class Decision:
    inject: bool
    reason: SkipReason | None
    policy: Policy | None
    container: str | None = None  # the vLLM container's name when inject
    pool_bytes: int | None = None  # after a per-pod override; None with placement node
    losers: tuple[Policy, ...] = ()
    message: str = ""
    edit: Edit = None  # where the flag goes: a shell script, env; None: appended to args

    @staticmethod
    def skip(
        reason: SkipReason, policy: Policy | None, message: str, losers: tuple[Policy, ...] = ()
    ) -> Decision:
        return Decision(False, reason, policy, losers=losers, message=message)


def runs_vllm(container: Mapping[str, Any]) -> bool:
    """Does this container start the vLLM engine where our flag can reach it?"""
    return engine_site(container).engine


def is_shell_wrapper(container: Mapping[str, Any]) -> bool:
    """``sh -c "..."`` and friends (also ``-ec``, ``-lc``)."""
    return shell_script(container) is not None


def _opted_out(meta: Mapping[str, Any]) -> bool:
    labels = meta.get("labels") or {}
    annotations = meta.get("annotations") or {}
    return "false" in (
        str(labels.get(ann.INJECT, "")).lower(),
        str(annotations.get(ann.INJECT, "")).lower(),
    )


def injected_by(pod: Mapping[str, Any]) -> str | None:
    """The policy that injected this pod, ``""`` if injected by an unknown one, None if not.
    The status annotation is the injector's record; a container named like ours without it is
    someone else's (`hand_wired` when it runs kvoffload, else a name clash), and our label is
    no record (a user may copy it into a template)."""
    meta = pod.get("metadata") or {}
    raw = (meta.get("annotations") or {}).get(ann.STATUS)
    if raw is None:
        return None
    try:
        return str(json.loads(raw).get("policy", ""))
    except (ValueError, AttributeError):
        return ""


def _skip_of(site: Site) -> tuple[SkipReason, str]:
    assert site.problem is not None
    return SkipReason(site.problem.value), site.message


def _skip_decision(site: Site, policy: Policy, losers: tuple[Policy, ...]) -> Decision:
    reason, message = _skip_of(site)
    return Decision.skip(reason, policy, message, losers)


def _volume_kinds(pod: Mapping[str, Any]) -> dict[str, str]:
    """Volume name → what it is, for messages (``ConfigMap 'vllm-scripts'``)."""
    out = {}
    for v in (pod.get("spec") or {}).get("volumes") or []:
        for key, kind in (("configMap", "ConfigMap"), ("secret", "Secret")):
            if isinstance(v.get(key), Mapping):
                ref = v[key].get("name") or v[key].get("secretName") or ""
                out[str(v.get("name"))] = f"{kind} {ref!r}"
    return out


def _named(pod: Mapping[str, Any], policy: Policy) -> str | None:
    meta = pod.get("metadata") or {}
    return (meta.get("annotations") or {}).get(ann.VLLM_CONTAINER) or policy.vllm_container


def _find_vllm(
    pod: Mapping[str, Any], policy: Policy
) -> tuple[Mapping[str, Any] | None, Site, str]:
    """(the vLLM container, its site, why none) — the container is also returned when its
    site is a problem (it looks like vLLM's), so its conflicts and overrides can be read."""
    containers = (pod.get("spec") or {}).get("containers") or []
    volumes = _volume_kinds(pod)
    wanted = _named(pod, policy)
    if wanted:
        found = [c for c in containers if c.get("name") == wanted]
        if not found:
            return None, NOT_VLLM, f"no container named {wanted!r}"
        return found[0], engine_site(found[0], named=True, volumes=volumes), ""
    sites = [(c, engine_site(c, volumes=volumes)) for c in containers]
    for container, site in sites:
        if site.engine:
            return container, site, ""
    for container, site in sites:
        if site.problem is not None:
            return container, site, ""
    return (
        None,
        NOT_VLLM,
        "no container runs `vllm serve|run-batch`, `vllm bench throughput|latency` or "
        "`python -m vllm.entrypoints...`; set spec.vllmContainer.name or the "
        "kvoffload.io/vllm-container annotation",
    )


def _inject_via(meta: Mapping[str, Any], policy: Policy) -> InjectVia | str:
    """The override (annotation over policy), or the bad annotation value as a string."""
    raw = (meta.get("annotations") or {}).get(ann.INJECT_VIA)
    if raw is None:
        return policy.inject_via
    try:
        return InjectVia(str(raw).strip().lower())
    except ValueError:
        return str(raw)


def decide(
    pod: Mapping[str, Any], policies: Sequence[Policy], group_size: int | None = None
) -> Decision:
    """Decide for ``pod`` among ``policies`` (all of the pod's namespace). See the module doc.
    ``group_size``: pods per group when the pod is a LeaderWorkerSet template (offline inject)."""
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    if _opted_out(meta):
        return Decision.skip(SkipReason.OPTED_OUT, None, f'{ann.INJECT} is "false"')
    selection = select_policy(meta.get("labels") or {}, policies)
    policy, losers = selection.winner, selection.losers
    previous = injected_by(pod)
    if policy is None:
        if previous is not None:
            return Decision.skip(SkipReason.ALREADY_INJECTED, None, "already injected")
        return Decision.skip(SkipReason.NO_MATCHING_POLICY, None, "no policy selects this pod")
    if previous is not None:
        if previous == policy.name:
            return Decision.skip(SkipReason.ALREADY_INJECTED, policy, "already injected", losers)
        return Decision.skip(
            SkipReason.CONFLICTING_POLICIES,
            policy,
            f"injected by policy {previous or '<unknown>'!r}, but {policy.name!r} "
            "selects it now; recreate the pod to re-inject",
            losers,
        )
    named = _named(pod, policy)
    wired = hand_wired(
        pod, next((c for c in spec.get("containers") or [] if c.get("name") == named), None)
    )
    if wired is not None:
        return _skip_decision(wired, policy, losers)
    node = policy.pool.node  # no sidecar: no ports, no pool size of the pod's own
    if spec.get("hostNetwork") and not node:
        return Decision.skip(
            SkipReason.HOST_NETWORK,
            policy,
            "hostNetwork pods would bind the sidecar's ports on the node",
            losers,
        )
    pool_bytes = None if node else policy.pool.size_bytes
    override = (meta.get("annotations") or {}).get(ann.POOL_SIZE)
    if override is not None and not node:
        try:
            pool_bytes = pool_from_spec(
                {"size": override, "hugepages": policy.pool.hugepages}
            ).size_bytes
        except PolicyError as exc:
            return Decision.skip(
                SkipReason.INVALID_OVERRIDE,
                policy,
                f"{ann.POOL_SIZE}: {exc}".replace("spec.pool.size: ", ""),
                losers,
            )
    via = _inject_via(meta, policy)
    if not isinstance(via, InjectVia):
        allowed = ", ".join(v.value for v in InjectVia)
        return Decision.skip(
            SkipReason.INVALID_OVERRIDE,
            policy,
            f"{ann.INJECT_VIA}: {via!r} is not one of: {allowed}",
            losers,
        )
    spans_pods = multi_node(pod, {}, group_size)  # whatever its containers run
    if spans_pods is not None:
        return _skip_decision(spans_pods, policy, losers)
    container, site, message = _find_vllm(pod, policy)
    if container is None:
        return Decision.skip(SkipReason.NO_VLLM_CONTAINER, policy, message, losers)
    if site.problem is Problem.NO_ENGINE:
        return _skip_decision(site, policy, losers)  # a client: nothing to configure
    problem = conflicts(container) or multi_node(pod, container, group_size)
    if problem is None and site.engine:
        problem = config_file(container)
    if problem is None and not site.engine:
        problem = site
    edit: Edit = site.edit
    if via is not InjectVia.AUTO:
        if problem is not None and not (problem.problem and problem.problem.overridable):
            return _skip_decision(problem, policy, losers)
        edit = EnvEdit() if via is InjectVia.ENV else append_edit(container)
    elif problem is not None:
        return _skip_decision(problem, policy, losers)
    clash = clashes(pod, container, policy)
    if clash is not None:
        return _skip_decision(clash, policy, losers)
    how = f" (inject-via {via.value})" if via is not InjectVia.AUTO else ""
    return Decision(
        True,
        None,
        policy,
        container=str(container.get("name")),
        pool_bytes=pool_bytes,
        edit=edit,
        losers=losers,
        message=f"injected by policy {policy.name!r}{how}",
    )
