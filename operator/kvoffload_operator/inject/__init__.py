"""The pod mutation: decide → render → patch. Shared by the webhook and `kvoffload inject`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvoffload_operator.inject.decide import Decision, SkipReason, decide
from kvoffload_operator.inject.patch import apply_patch, json_patch
from kvoffload_operator.inject.render import RenderDefaults, annotate_skip, render
from kvoffload_operator.inject.reserved import SIDECAR_NAME
from kvoffload_operator.policy import Policy

__all__ = [
    "SIDECAR_NAME",
    "Decision",
    "Injection",
    "RenderDefaults",
    "SkipReason",
    "apply_patch",
    "decide",
    "inject_pod",
    "json_patch",
]


@dataclass(frozen=True)
class Injection:
    decision: Decision
    pod: dict[str, Any]  # the pod after mutation (equal to the input when nothing changed)
    patch: list[dict[str, Any]]  # JSON patch from the input to ``pod``


DEFAULTS = RenderDefaults()


def inject_pod(
    pod: Mapping[str, Any],
    policies: Sequence[Policy],
    defaults: RenderDefaults = DEFAULTS,
    group_size: int | None = None,
) -> Injection:
    """Mutate one pod (or pod template: the same shape) for ``policies`` of its namespace.
    ``group_size``: pods per group of the LeaderWorkerSet the template belongs to, if any."""
    decision = decide(pod, policies, group_size)
    if decision.inject:
        mutated = render(pod, decision, defaults)
    else:
        assert decision.reason is not None
        mutated = annotate_skip(pod, decision.reason)
    return Injection(decision, mutated, json_patch(pod, mutated))
