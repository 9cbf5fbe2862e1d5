"""One admission request for a pod: the webhook's logic without kopf (kopf calls `admit_pod`).

Never blocks pod creation: any exception in the injector admits the pod unchanged except for
``kvoffload.io/skip-reason: error`` and an admission warning, and is counted. Before an injected
pod is answered, `inject.verify` checks it (structure, and the flag's delivery re-parsed as the
shell reads it); a pod that fails, or a check that raises, is admitted unchanged except for
``kvoffload.io/skip-reason: verification-failed``, with the failing check in the warning.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvoffload_operator import annotations as ann
from kvoffload_operator.inject import RenderDefaults, SkipReason, inject_pod
from kvoffload_operator.inject.verify import VERIFICATION_FAILED, intent_of, verify
from kvoffload_operator.metrics import OperatorMetrics
from kvoffload_operator.policy import Policy

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Admission:
    pod: dict[str, Any]  # the pod to admit (mutated or not)
    outcome: str  # injected | skipped | error
    reason: str  # a SkipReason value, or "none" when injected
    warnings: tuple[str, ...] = ()


def admit_pod(
    pod: Mapping[str, Any],
    policies: Sequence[Policy],
    defaults: RenderDefaults,
    metrics: OperatorMetrics | None = None,
) -> Admission:
    start = time.perf_counter()
    try:
        result = inject_pod(pod, policies, defaults)
        decision = result.decision
        if decision.inject:
            admission = Admission(result.pod, "injected", "none")
            problem = _verification_problem(pod, result.pod, decision)
            if problem is not None:
                log.warning("kvoffload: rendering failed verification (%s); not injected", problem)
                admission = Admission(
                    skipped(pod, VERIFICATION_FAILED),
                    "skipped",
                    VERIFICATION_FAILED,
                    (f"kvoffload: not injected ({VERIFICATION_FAILED}): {problem}",),
                )
        else:
            assert decision.reason is not None
            warns = (
                (f"kvoffload: not injected ({decision.reason.value}): {decision.message}",)
                if decision.reason.annotated
                else ()
            )
            admission = Admission(result.pod, "skipped", decision.reason.value, warns)
    except Exception as exc:  # the webhook must never block pod creation
        log.exception("kvoffload: injection failed; admitting the pod unchanged")
        admission = Admission(
            skipped(pod, SkipReason.ERROR.value),
            "error",
            SkipReason.ERROR.value,
            (f"kvoffload: injection failed, pod admitted unchanged: {exc}",),
        )
    if metrics is not None:
        metrics.injections.labels(outcome=admission.outcome, reason=admission.reason).inc()
        metrics.injection_seconds.observe(time.perf_counter() - start)
    meta = pod.get("metadata") or {}
    log.info(
        "kvoffload: pod %s/%s: %s (%s)",
        meta.get("namespace"),
        meta.get("name") or meta.get("generateName"),
        admission.outcome,
        admission.reason,
    )
    return admission


def skipped(pod: Mapping[str, Any], reason: str) -> dict[str, Any]:
    """``pod`` unchanged but for ``kvoffload.io/skip-reason: <reason>``."""
    out = copy.deepcopy(dict(pod))
    out.setdefault("metadata", {}).setdefault("annotations", {})[ann.SKIP_REASON] = reason
    return out


def _verification_problem(
    pod: Mapping[str, Any], mutated: Mapping[str, Any], decision: Any
) -> str | None:
    """Why the injected ``mutated`` must not be answered, or None when it passes."""
    try:
        verdict = verify(pod, mutated, intent_of(decision))
    except Exception as exc:  # a checker bug must not block the pod, nor let it through
        log.exception("kvoffload: verification raised")
        return f"the check raised {type(exc).__name__}: {exc}"
    return None if verdict.ok else verdict.summary()
