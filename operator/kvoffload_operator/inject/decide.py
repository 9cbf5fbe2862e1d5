"""Whether to inject a pod, and why not (pure).

Precedence (first match wins; every step reads only the pod and the policies):
1. opted out: label or annotation ``kvoffload.io/inject: "false"``            → OPTED_OUT
2. no policy of the namespace selects the pod's labels                          → NO_MATCHING_POLICY
3. already injected (status annotation or our sidecar present): by the winning
   policy → ALREADY_INJECTED (no change); by another → CONFLICTING_POLICIES
4. ``hostNetwork: true`` (the sidecar's ports would bind on the node)           → HOST_NETWORK
5. a per-pod ``kvoffload.io/pool-size`` that the policy rules reject           → INVALID_OVERRIDE
6. the vLLM container: named (pod annotation, else ``spec.vllmContainer.name``) or detected
   (see `engine`: ``vllm serve``, ``vllm bench throughput|latency``, ``python -m
   vllm.entrypoints...``, a ``sh -c`` script with one engine invocation, an image's entrypoint);
   missing                                                                       → NO_VLLM_CONTAINER
   a client only (``vllm bench serve``)                                          → NO_ENGINE
   a shell script with several engine invocations (ambiguous)                    → SHELL_WRAPPER
7. it already configures a KV connector (``--kv-transfer-config`` in args, shell text or env)
                                                                        → HAS_KV_TRANSFER_CONFIG
   or vLLM's own offloading (``--kv-offloading-size|backend``, VLLM_USE_SIMPLE_KV_OFFLOAD)
                                                                        → HAS_KV_OFFLOADING
8. the engine spans pods (LeaderWorkerSet size > 1, Ray cluster nodes)  → MULTI_NODE
Otherwise inject with the winner (see `selection` for how overlaps resolve).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from kvoffload_operator import annotations as ann
from kvoffload_operator.inject.engine import (
    NOT_VLLM,
    Problem,
    ShellEdit,
    Site,
    conflicts,
    engine_site,
    multi_node,
    shell_script,
)
from kvoffload_operator.policy import Policy, PolicyError, pool_from_spec
from kvoffload_operator.selection import select_policy

SIDECAR_NAME = "kvoffload-sidecar"


class SkipReason(str, Enum):
    """Why a pod was left alone; the value is written to ``kvoffload.io/skip-reason``."""

    OPTED_OUT = "opted-out"
    NO_MATCHING_POLICY = "no-matching-policy"
    ALREADY_INJECTED = "already-injected"
    CONFLICTING_POLICIES = "conflicting-policies"
    HOST_NETWORK = "host-network"
    INVALID_OVERRIDE = "invalid-override"
    NO_VLLM_CONTAINER = "no-vllm-container"
    SHELL_WRAPPER = "shell-wrapper"
    NO_ENGINE = "no-engine"
    HAS_KV_TRANSFER_CONFIG = "has-kv-transfer-config"
    HAS_KV_OFFLOADING = "has-kv-offloading"
    MULTI_NODE = "multi-node"
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
    pool_bytes: int | None = None  # after a per-pod override
    losers: tuple[Policy, ...] = ()
    message: str = ""
    edit: ShellEdit | None = None  # where the flag goes in a shell script; None: append to args

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
    """The policy that injected this pod, ``""`` if injected by an unknown one, None if not."""
    meta = pod.get("metadata") or {}
    raw = (meta.get("annotations") or {}).get(ann.STATUS)
    if raw is not None:
        try:
            return str(json.loads(raw).get("policy", ""))
        except (ValueError, AttributeError):
            return ""
    spec = pod.get("spec") or {}
    names = {
        c.get("name") for c in (spec.get("initContainers") or []) + (spec.get("containers") or [])
    }
    return "" if SIDECAR_NAME in names else None


_PROBLEM_REASON = {
    Problem.NO_ENGINE: "NO_ENGINE",
    Problem.SHELL_WRAPPER: "SHELL_WRAPPER",
    Problem.HAS_KV_TRANSFER_CONFIG: "HAS_KV_TRANSFER_CONFIG",
    Problem.HAS_KV_OFFLOADING: "HAS_KV_OFFLOADING",
    Problem.MULTI_NODE: "MULTI_NODE",
}


def _skip_of(site: Site) -> tuple[SkipReason, str]:
    assert site.problem is not None
    return SkipReason[_PROBLEM_REASON[site.problem]], site.message


def _skip_decision(site: Site, policy: Policy, losers: tuple[Policy, ...]) -> Decision:
    reason, message = _skip_of(site)
    return Decision.skip(reason, policy, message, losers)


def _find_vllm(
    pod: Mapping[str, Any], policy: Policy
) -> tuple[Mapping[str, Any] | None, Site, SkipReason | None, str]:
    meta = pod.get("metadata") or {}
    containers = (pod.get("spec") or {}).get("containers") or []
    wanted = (meta.get("annotations") or {}).get(ann.VLLM_CONTAINER) or policy.vllm_container
    if wanted:
        found = [c for c in containers if c.get("name") == wanted]
        if not found:
            return None, NOT_VLLM, SkipReason.NO_VLLM_CONTAINER, f"no container named {wanted!r}"
        site = engine_site(found[0], named=True)
        if not site.engine:
            return None, site, *_skip_of(site)
        return found[0], site, None, ""
    sites = [(c, engine_site(c)) for c in containers]
    for container, site in sites:
        if site.engine:
            return container, site, None, ""
    for _, site in sites:
        if site.problem is not None:
            return None, site, *_skip_of(site)
    return (
        None,
        NOT_VLLM,
        SkipReason.NO_VLLM_CONTAINER,
        (
            "no container runs `vllm serve`, `vllm bench throughput|latency` or "
            "`python -m vllm.entrypoints...`; set spec.vllmContainer.name or the "
            "kvoffload.io/vllm-container annotation"
        ),
    )


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
    if spec.get("hostNetwork"):
        return Decision.skip(
            SkipReason.HOST_NETWORK,
            policy,
            "hostNetwork pods would bind the sidecar's ports on the node",
            losers,
        )
    pool_bytes = policy.pool.size_bytes
    override = (meta.get("annotations") or {}).get(ann.POOL_SIZE)
    if override is not None:
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
    spans_pods = multi_node(pod, {}, group_size)  # whatever its containers run
    if spans_pods is not None:
        return _skip_decision(spans_pods, policy, losers)
    container, site, reason, message = _find_vllm(pod, policy)
    if container is None:
        assert reason is not None
        return Decision.skip(reason, policy, message, losers)
    problem = conflicts(container) or multi_node(pod, container, group_size)
    if problem is not None:
        return _skip_decision(problem, policy, losers)
    return Decision(
        True,
        None,
        policy,
        container=str(container.get("name")),
        pool_bytes=pool_bytes,
        edit=site.edit,
        losers=losers,
        message=f"injected by policy {policy.name!r}",
    )
