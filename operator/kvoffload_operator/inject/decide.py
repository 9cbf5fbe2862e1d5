"""Whether to inject a pod, and why not (pure).

Precedence (first match wins; every step reads only the pod and the policies):
1. opted out: label or annotation ``kvoffload.io/inject: "false"``            → OPTED_OUT
2. no policy of the namespace selects the pod's labels                          → NO_MATCHING_POLICY
3. already injected (status annotation or our sidecar present): by the winning
   policy → ALREADY_INJECTED (no change); by another → CONFLICTING_POLICIES
4. ``hostNetwork: true`` (the sidecar's ports would bind on the node)           → HOST_NETWORK
5. a per-pod ``kvoffload.io/pool-size`` that the policy rules reject           → INVALID_OVERRIDE
6. the vLLM container: named (pod annotation, else ``spec.vllmContainer.name``)
   or detected (``vllm serve``, ``python -m vllm.entrypoints...``, an image named
   vllm without a command, or a container named ``vllm``); missing               → NO_VLLM_CONTAINER
   it (or the only vLLM-looking one) is a ``sh -c``/``bash -c`` wrapper, where
   appended arguments would not reach vLLM                                      → SHELL_WRAPPER
7. it already has ``--kv-transfer-config`` (someone else's connector) → HAS_KV_TRANSFER_CONFIG
Otherwise inject with the winner (see `selection` for how overlaps resolve).
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from kvoffload_operator import annotations as ann
from kvoffload_operator.policy import Policy, PolicyError, pool_from_spec
from kvoffload_operator.selection import select_policy

SIDECAR_NAME = "kvoffload-sidecar"
SHELLS = frozenset({"sh", "bash", "dash", "ash", "zsh", "busybox"})


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
    HAS_KV_TRANSFER_CONFIG = "has-kv-transfer-config"
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

    @staticmethod
    def skip(
        reason: SkipReason, policy: Policy | None, message: str, losers: tuple[Policy, ...] = ()
    ) -> Decision:
        return Decision(False, reason, policy, losers=losers, message=message)


def argv(container: Mapping[str, Any]) -> list[str]:
    return [str(a) for a in (container.get("command") or [])] + [
        str(a) for a in (container.get("args") or [])
    ]


def is_shell_wrapper(container: Mapping[str, Any]) -> bool:
    """``sh -c "..."`` and friends (also ``-ec``, ``-lc``): arguments appended never reach vLLM."""
    words = argv(container)
    if not words or posixpath.basename(words[0]) not in SHELLS:
        return False
    return any(w.startswith("-") and not w.startswith("--") and "c" in w for w in words[1:])


def runs_vllm(container: Mapping[str, Any]) -> bool:
    """Heuristic: does this container run the vLLM server directly (not through a shell)?"""
    if is_shell_wrapper(container):
        return False
    words = argv(container)
    if words:
        exe = posixpath.basename(words[0])
        if exe == "vllm" and words[1:2] == ["serve"]:
            return True
        if exe.startswith("python") and "-m" in words:
            module = words[words.index("-m") + 1] if words.index("-m") + 1 < len(words) else ""
            if module.startswith("vllm.entrypoints"):
                return True
    if not container.get("command"):
        # vllm/vllm-openai and its derivatives: the image's entrypoint is the server.
        repo = str(container.get("image", "")).split("@")[0].rsplit("/", 1)[-1].split(":")[0]
        if "vllm" in repo:
            return True
    return container.get("name") == "vllm"


def has_kv_transfer_config(container: Mapping[str, Any]) -> bool:
    return any(
        w.replace("_", "-").split("=", 1)[0] == "--kv-transfer-config" for w in argv(container)
    )


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


def _find_vllm(
    pod: Mapping[str, Any], policy: Policy
) -> tuple[Mapping[str, Any] | None, SkipReason | None, str]:
    meta = pod.get("metadata") or {}
    containers = (pod.get("spec") or {}).get("containers") or []
    wanted = (meta.get("annotations") or {}).get(ann.VLLM_CONTAINER) or policy.vllm_container
    if wanted:
        found = [c for c in containers if c.get("name") == wanted]
        if not found:
            return None, SkipReason.NO_VLLM_CONTAINER, f"no container named {wanted!r}"
        if is_shell_wrapper(found[0]):
            return None, SkipReason.SHELL_WRAPPER, f"container {wanted!r} runs vLLM through a shell"
        return found[0], None, ""
    candidates = [c for c in containers if runs_vllm(c)]
    if candidates:
        return candidates[0], None, ""
    wrappers = [c for c in containers if is_shell_wrapper(c) and "vllm" in " ".join(argv(c))]
    if wrappers:
        return (
            None,
            SkipReason.SHELL_WRAPPER,
            (
                f"container {wrappers[0].get('name')!r} runs vLLM through a shell; "
                "run `vllm serve` "
                "directly or name the container in spec.vllmContainer.name after removing the shell"
            ),
        )
    return (
        None,
        SkipReason.NO_VLLM_CONTAINER,
        (
            "no container runs `vllm serve` or `python -m vllm.entrypoints...`; set "
            "spec.vllmContainer.name or the kvoffload.io/vllm-container annotation"
        ),
    )


def decide(pod: Mapping[str, Any], policies: Sequence[Policy]) -> Decision:
    """Decide for ``pod`` among ``policies`` (all of the pod's namespace). See the module doc."""
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
    container, reason, message = _find_vllm(pod, policy)
    if container is None:
        assert reason is not None
        return Decision.skip(reason, policy, message, losers)
    if has_kv_transfer_config(container):
        return Decision.skip(
            SkipReason.HAS_KV_TRANSFER_CONFIG,
            policy,
            f"container {container.get('name')!r} already has --kv-transfer-config",
            losers,
        )
    return Decision(
        True,
        None,
        policy,
        container=str(container.get("name")),
        pool_bytes=pool_bytes,
        losers=losers,
        message=f"injected by policy {policy.name!r}",
    )
