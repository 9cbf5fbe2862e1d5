"""The webhook over real HTTPS: kopf's admission server run by our operator code in-process,
a certificate made with `cryptography`, AdmissionReview v1 JSON posted with an `ssl` client that
verifies the server against the CA. Policies come from the kmock API emulator (the operator's
index), exactly as in a cluster; the results must equal the CLI's golden files."""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from kvoffload_operator import annotations as ann
from kvoffload_operator.inject import apply_patch
from kvoffload_operator.inject.conflicts import LWS_SIZE_ANNOTATION as LWS_SIZE
from kvoffload_operator.workloads import group_size, pod_templates

from tests.operator.golden import DEFAULTS, Case, cases
from tests.operator.harness import (
    POLICIES,
    Running,
    decoded_patch,
    eventually,
    put,
    running_operator,
)

pytestmark = pytest.mark.process


def as_pod(template: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", **copy.deepcopy(template)}


def load_case_policies(kmock: Any, case: Case, namespace: str) -> None:
    for obj in yaml.safe_load_all(case.policy_file.read_text()):
        obj["metadata"]["namespace"] = namespace
        put(kmock, POLICIES, obj)


async def review(op: Running, pod: dict[str, Any], namespace: str, **kw: Any) -> dict[str, Any]:
    return await asyncio.to_thread(op.review, pod, namespace, **kw)


async def wait_for_index(op: Running, namespace: str) -> None:
    """The webhook answers before kopf's index has the policies: wait until it injects."""
    probe = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"labels": {"app": "vllm"}},
        "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v1"}]},
    }

    async def injected() -> bool:
        return bool(decoded_patch(await review(op, probe, namespace)))

    await eventually(injected)


async def test_golden_cases_through_the_webhook(kmock: Any, tmp_path: Path) -> None:
    all_cases = cases()
    # one namespace per policy file (most cases share testdata/policy.yaml): the operator's
    # start-up work grows with the number of policies, not of cases
    files = sorted({c.policy_file for c in all_cases})
    ns = {c.name: f"case-{files.index(c.policy_file)}" for c in all_cases}
    for i, policy_file in enumerate(files):
        load_case_policies(kmock, next(c for c in all_cases if c.policy_file == policy_file),
                           f"case-{i}")  # fmt: skip
    load_case_policies(kmock, all_cases[0], "probe")  # default policy: selects app=vllm
    images = {"sidecar_image": DEFAULTS.sidecar_image, "connector_image": DEFAULTS.connector_image}
    # the goldens are the CLI's (no admin limits): here the admin allows what their policies ask
    allow_all = {
        "allowed_images": "*",
        "allow_privileged": True,
        "allowed_capabilities": "IPC_LOCK,SYS_NICE",
    }
    async with running_operator(kmock, tmp_path, **images, **allow_all) as op:
        await wait_for_index(op, "probe")
        checked = want_injected = want_shell = 0
        for case in all_cases:
            expected_docs = case.expected_docs()
            for doc, expected in zip(case.docs(), expected_docs, strict=True):
                expected_templates = dict(pod_templates(expected))
                size = group_size(doc)
                for path, template in pod_templates(doc):
                    pod = as_pod(template)
                    if size is not None:  # LeaderWorkerSet's controller annotates its pods
                        pod["metadata"].setdefault("annotations", {})[LWS_SIZE] = str(size)
                    response = await review(op, pod, ns[case.name])
                    assert response["allowed"] is True
                    admitted = apply_patch(pod, decoded_patch(response))
                    # the webhook sees the request's namespace; the CLI's templates have none
                    admitted["metadata"].pop("namespace", None)
                    want = as_pod(expected_templates[path])
                    want["metadata"].pop("namespace", None)
                    if size is not None:
                        want["metadata"].setdefault("annotations", {})[LWS_SIZE] = str(size)
                    assert admitted == want, f"{case.name} {path}"
                    was = ann.STATUS in (pod["metadata"].get("annotations") or {})
                    now = ann.STATUS in (want["metadata"].get("annotations") or {})
                    want_injected += now and not was
                    reason = (want["metadata"].get("annotations") or {}).get(ann.SKIP_REASON)
                    want_shell += reason == "shell-wrapper"
                    # reinvocation (reinvocationPolicy: IfNeeded): a second pass changes nothing
                    again = await review(op, admitted, ns[case.name])
                    assert decoded_patch(again) == [], f"{case.name} {path} not idempotent"
                    checked += 1
        assert checked >= 14
        injected = op.metrics.registry.get_sample_value(
            "kvoffload_injections_total", {"outcome": "injected", "reason": "none"}
        )
        skipped = op.metrics.registry.get_sample_value(
            "kvoffload_injections_total", {"outcome": "skipped", "reason": "shell-wrapper"}
        )
        # the probe pods count too; every skipped pod was sent twice (first pass + reinvocation)
        assert injected is not None and injected >= want_injected + 1 and want_injected >= 7
        assert want_shell >= 1 and skipped == 2 * want_shell
        assert (
            op.metrics.registry.get_sample_value("kvoffload_injection_duration_seconds_count")
            >= checked
        )


async def test_never_blocks_dry_run_other_namespaces(kmock: Any, tmp_path: Path) -> None:
    """An injector exception admits the pod unchanged except for the skip annotation; a dry
    run gets the same patch; a namespace without policies gets none."""
    case = cases()[0]
    load_case_policies(kmock, case, "probe")
    async with running_operator(kmock, tmp_path) as op:
        await wait_for_index(op, "probe")
        broken = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "odd", "labels": {"app": "vllm"}},
            "spec": {"containers": "not-a-list"},
        }
        response = await review(op, broken, "probe")
        assert response["allowed"] is True
        admitted = apply_patch(
            {**broken, "metadata": {**broken["metadata"], "namespace": "probe"}},
            decoded_patch(response),
        )
        assert admitted["metadata"]["annotations"] == {ann.SKIP_REASON: "error"}
        assert admitted["spec"] == broken["spec"]
        assert any("injection failed" in w for w in response.get("warnings", []))
        assert (
            op.metrics.registry.get_sample_value(
                "kvoffload_injections_total", {"outcome": "error", "reason": "error"}
            )
            == 1
        )

        # dry run: the same answer (the webhook has no side effects to skip)
        pod = as_pod(next(pod_templates(case.docs()[0]))[1])
        dry = await review(op, pod, "probe", dry_run=True)
        real = await review(op, pod, "probe")
        assert decoded_patch(dry) == decoded_patch(real) != []  # no side effects to skip
        elsewhere = await review(op, pod, "no-policies-here")
        assert elsewhere["allowed"] is True and decoded_patch(elsewhere) == []
