"""Check what `kvoffload inject` wrote, template by template, as the webhook checks a pod.

Every injected template gets the pure checks of `inject.verify` (the webhook's); with
``execute`` (``--verify``) also the run of `inject.verify_exec`, with the ConfigMaps of the input
as the files a mounted script comes from. A template that fails is written as the webhook would
admit it: unchanged, with ``kvoffload.io/skip-reason: verification-failed``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvoffload_operator.admission import skipped
from kvoffload_operator.inject import decide
from kvoffload_operator.inject.verify import VERIFICATION_FAILED, intent_of, verify
from kvoffload_operator.inject.verify_exec import UNVERIFIED, configmaps_of, run_delivery
from kvoffload_operator.policy import Policy
from kvoffload_operator.workloads import group_size, pod_templates, replace_template


@dataclass(frozen=True)
class Check:
    where: str  # e.g. "Deployment/llama (spec.template)"
    failed: bool  # False: could not be verified (a note, not an error)
    text: str


def _where(doc: Mapping[str, Any], path: tuple[str, ...]) -> str:
    name = (doc.get("metadata") or {}).get("name", "?")
    return f"{doc.get('kind')}/{name}" + (f" ({'.'.join(path)})" if path else "")


def check_documents(
    inputs: Sequence[Any], outputs: Sequence[Any], policies: Sequence[Policy], execute: bool
) -> tuple[list[Any], list[Check]]:
    """``outputs`` (`inject_documents` of ``inputs``) with failing templates withdrawn."""
    configmaps = configmaps_of(inputs) if execute else {}
    out: list[Any] = []
    checks: list[Check] = []
    for before, after in zip(inputs, outputs, strict=True):
        current = after
        if isinstance(before, Mapping) and isinstance(after, Mapping):
            written = dict(pod_templates(after))
            for path, template in pod_templates(before):
                decision = decide(template, policies, group_size(before))
                if not decision.inject or path not in written:
                    continue
                problem = _problem(template, written[path], decision, configmaps, execute)
                if problem is None:
                    continue
                failed, text = problem
                checks.append(Check(_where(before, path), failed, text))
                if failed:
                    current = replace_template(
                        current, path, skipped(template, VERIFICATION_FAILED)
                    )
        out.append(current)
    return out, checks


def _problem(
    template: Mapping[str, Any],
    written: Mapping[str, Any],
    decision: Any,
    configmaps: Mapping[str, Mapping[str, str]],
    execute: bool,
) -> tuple[bool, str] | None:
    intent = intent_of(decision)
    verdict = verify(template, written, intent)
    if not verdict.ok:
        return True, f"not injected ({VERIFICATION_FAILED}): {verdict.summary()}"
    if not execute:
        return None
    result = run_delivery({"kind": "Pod", **written}, intent, configmaps)
    if result.ok:
        return None
    if result.status == UNVERIFIED:
        return False, f"injected, delivery not verified: {result.message}"
    return True, f"not injected ({VERIFICATION_FAILED}): {result.message}"
