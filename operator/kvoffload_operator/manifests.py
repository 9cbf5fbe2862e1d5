"""Inject a stream of manifests (pure): what `kvoffload inject` does to each document."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvoffload_operator.inject import RenderDefaults, SkipReason, inject_pod
from kvoffload_operator.policy import Policy
from kvoffload_operator.workloads import group_size, pod_templates, replace_template


@dataclass(frozen=True)
class Note:
    """A pod template left alone, for the user (stderr)."""

    where: str  # e.g. "Deployment/llama (spec.template)"
    reason: SkipReason
    text: str


def inject_documents(
    docs: Sequence[Any], policies: Sequence[Policy], defaults: RenderDefaults
) -> tuple[list[Any], list[Note]]:
    """Every pod template of every document injected (or annotated with its skip reason)."""
    out: list[Any] = []
    notes: list[Note] = []
    for doc in docs:
        if not isinstance(doc, Mapping):
            out.append(doc)
            continue
        current: Any = doc
        for path, template in list(pod_templates(doc)):
            result = inject_pod(template, policies, defaults, group_size(doc))
            current = replace_template(current, path, result.pod)
            reason = result.decision.reason
            if reason is not None and reason is not SkipReason.ALREADY_INJECTED:
                name = (doc.get("metadata") or {}).get("name", "?")
                where = f"{doc.get('kind')}/{name}" + (f" ({'.'.join(path)})" if path else "")
                notes.append(
                    Note(where, reason, f"not injected ({reason.value}): {result.decision.message}")
                )
        out.append(current)
    return out, notes
