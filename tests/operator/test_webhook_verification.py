"""The webhook over real HTTPS checks every pod it injected before answering: a rendering that
fails the checks is admitted unchanged except for the skip reason, with the failing check in
the admission warning, and counted; the policy status counts the pod under that reason."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from kvoffload_operator import annotations as ann
from kvoffload_operator import inject as inject_pkg
from kvoffload_operator.inject import apply_patch
from kvoffload_operator.status import skipped_counts

from tests.operator.golden import cases
from tests.operator.harness import decoded_patch
from tests.operator.test_webhook_https import as_pod, load_case_policies, review, wait_for_index

pytestmark = pytest.mark.process
RENDER = inject_pkg.render


def duplicate_mounts(pod: Any, decision: Any, defaults: Any) -> dict[str, Any]:
    """The real renderer, plus a second mount at the pool's path in the vLLM container."""
    out = RENDER(pod, decision, defaults)
    vllm = next(c for c in out["spec"]["containers"] if c["name"] == decision.container)
    vllm["volumeMounts"].append({"name": "kvoffload-run", "mountPath": "/kvoffload/pool"})
    return out


async def test_a_rendering_that_fails_verification_is_admitted_unmutated(
    kmock: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    case = next(c for c in cases() if c.name == "deployment-command")
    load_case_policies(kmock, case, "probe")
    from tests.operator.harness import running_operator

    async with running_operator(kmock, tmp_path) as op:
        await wait_for_index(op, "probe")
        pod = as_pod(case.docs()[0]["spec"]["template"])
        good = await review(op, pod, "probe")
        assert any(p["path"].startswith("/spec/initContainers") for p in decoded_patch(good))

        monkeypatch.setattr(inject_pkg, "render", duplicate_mounts)
        response = await asyncio.wait_for(review(op, pod, "probe"), 15)
        assert response["allowed"] is True
        admitted = apply_patch({**pod, "metadata": {**pod["metadata"], "namespace": "probe"}},
                               decoded_patch(response))  # fmt: skip
        assert admitted["spec"] == pod["spec"]
        assert admitted["metadata"]["annotations"][ann.SKIP_REASON] == "verification-failed"
        (warning,) = response["warnings"]
        assert "verification-failed" in warning and "unique-mount-paths" in warning
        assert "/kvoffload/pool" in warning
        assert skipped_counts([admitted]) == {"verification-failed": 1}
        assert (
            op.metrics.registry.get_sample_value(
                "kvoffload_injections_total",
                {"outcome": "skipped", "reason": "verification-failed"},
            )
            == 1
        )

        def raising(*_: Any) -> Any:
            raise RuntimeError("checker bug")

        monkeypatch.setattr(inject_pkg, "render", RENDER)
        monkeypatch.setattr("kvoffload_operator.admission.verify", raising)
        response = await review(op, pod, "probe")
        assert response["allowed"] is True
        admitted = apply_patch({**pod, "metadata": {**pod["metadata"], "namespace": "probe"}},
                               decoded_patch(response))  # fmt: skip
        assert admitted["spec"] == pod["spec"]
        assert admitted["metadata"]["annotations"][ann.SKIP_REASON] == "verification-failed"
        assert "checker bug" in response["warnings"][0]
