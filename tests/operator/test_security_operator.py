"""The operator against the kmock API emulator: one webhook certificate for two replicas started
at once (and renewal by the same CA), policies outside the admin's guardrails refused at apply
over real HTTPS and reported NotAllowed when they got in, the hash-seed Secret, and a pod
webhook that never blocks a pod whatever the AdmissionReview holds."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime
import json
import ssl
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvoffload_operator import certs, hashseed

from tests.operator.harness import POLICIES, eventually, put, running_operator

pytestmark = pytest.mark.process

NS = "team"
MWC = "admissionregistration.k8s.io/v1/mutatingwebhookconfigurations"
SECRETS = "v1/secrets"
TLS_NAME = "kvoffload-webhook.default.svc"


def declare_webhook_config(kmock: Any) -> None:
    res = kmock.resources[MWC]
    res.kind, res.namespaced = "MutatingWebhookConfiguration", False
    res.verbs = {"get", "patch", "list", "watch"}
    kmock.objects[MWC, None, "kvoffload-webhook"] = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": "kvoffload-webhook", "uid": str(uuid.uuid4())},
        "webhooks": [{"name": "pods.kvoffload.io", "clientConfig": {"service": {"name": "s"}}}],
    }


def secret_data(kmock: Any) -> dict[str, bytes]:
    raw = kmock.objects[SECRETS, "default", "kvoffload-webhook-tls"].raw
    return {k: base64.b64decode(v) for k, v in raw["data"].items()}


def served_cert(port: int) -> bytes:
    """The certificate the server at ``port`` presents (DER)."""
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    with ctx.wrap_socket(__import__("socket").create_connection(("127.0.0.1", port), 5)) as s:
        return s.getpeercert(binary_form=True)


def der(pem: bytes) -> bytes:
    from cryptography.hazmat.primitives.serialization import Encoding

    return x509.load_pem_x509_certificate(pem).public_bytes(Encoding.DER)


SELF_SIGNED = dict(self_signed_certs=True, injection_label="")


async def test_two_replicas_starting_at_once_serve_one_pair_and_one_ca_bundle(
    kmock: Any, tmp_path: Path
) -> None:
    declare_webhook_config(kmock)
    async with contextlib.AsyncExitStack() as stack:
        a, b = await asyncio.gather(
            *(
                stack.enter_async_context(
                    running_operator(
                        kmock, tmp_path / name, cert_dir=tmp_path / name / "certs", **SELF_SIGNED
                    )
                )
                for name in ("a", "b")
            )
        )
        stored = secret_data(kmock)
        # both serve the one pair in the Secret (one create won; the other read it back)
        assert served_cert(a.config.webhook_port) == der(stored["tls.crt"])
        assert served_cert(b.config.webhook_port) == der(stored["tls.crt"])
        bundle = kmock.objects[MWC, None, "kvoffload-webhook"].raw["webhooks"][0]
        assert base64.b64decode(bundle["clientConfig"]["caBundle"]) == stored["ca.crt"]
        assert certs.issued_by(stored["tls.crt"], stored["ca.crt"]) and stored["ca.key"]
        owner = kmock.objects[SECRETS, "default", "kvoffload-webhook-tls"].raw["metadata"]
        assert owner["ownerReferences"][0]["kind"] == "MutatingWebhookConfiguration"


async def test_a_certificate_due_for_renewal_is_renewed_by_the_same_ca_and_served_live(
    kmock: Any, tmp_path: Path
) -> None:
    declare_webhook_config(kmock)
    names = certs.service_dns_names("kvoffload-webhook", "default")
    soon = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(
        days=certs.CERT_DAYS - 5
    )
    old = certs.generate(names, now=soon)  # expires in 5 days: inside the 30-day window
    put(
        kmock,
        SECRETS,
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "kvoffload-webhook-tls", "namespace": "default"},
            "data": {k: base64.b64encode(v).decode() for k, v in old.secret_data().items()},
        },
    )
    async with running_operator(kmock, tmp_path, cert_check_interval=0.5, **SELF_SIGNED) as op:
        stored = secret_data(kmock)
        assert stored["tls.crt"] != old.cert_pem and stored["ca.crt"] == old.ca_pem
        assert served_cert(op.config.webhook_port) == der(stored["tls.crt"])
        # another replica renews while this one runs: served without a restart (kopf re-reads)
        newer = certs.renew(old, names)
        kmock.objects[SECRETS, "default", "kvoffload-webhook-tls"].patch(
            {"data": {k: base64.b64encode(v).decode() for k, v in newer.secret_data().items()}}
        )
        await eventually(
            lambda: served_cert(op.config.webhook_port) == der(newer.cert_pem), timeout=90
        )


def stored(kmock: Any, name: str) -> dict[str, Any] | None:
    try:
        return dict(kmock.objects[SECRETS, NS, name].raw)
    except KeyError:
        return None


def policy_review(port: int, cafile: Path, obj: dict[str, Any]) -> dict[str, Any]:
    body = {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": str(uuid.uuid4()),
            "kind": {"group": "kvoffload.io", "version": "v1alpha1", "kind": "KVOffloadPolicy"},
            "resource": {
                "group": "kvoffload.io",
                "version": "v1alpha1",
                "resource": "kvoffloadpolicies",
            },
            "namespace": NS,
            "name": obj["metadata"]["name"],
            "operation": "CREATE",
            "userInfo": {"username": "alice"},
            "object": obj,
            "dryRun": False,
        },
    }
    req = urllib.request.Request(
        f"https://localhost:{port}/validate-policies",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    ctx = ssl.create_default_context(cafile=str(cafile))
    with urllib.request.urlopen(req, context=ctx, timeout=10) as resp:
        return dict(json.loads(resp.read())["response"])


def a_policy(name: str, **sidecar: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {"selector": {"matchLabels": {"app": "vllm"}}, "pool": {"size": "8Gi"}}
    if sidecar:
        spec["sidecar"] = sidecar
    return {
        "apiVersion": "kvoffload.io/v1alpha1",
        "kind": "KVOffloadPolicy",
        "metadata": {"name": name, "namespace": NS},
        "spec": spec,
    }


async def test_policies_outside_the_guardrails_are_refused_at_apply(
    kmock: Any, tmp_path: Path
) -> None:
    async with running_operator(kmock, tmp_path, injection_label="") as op:
        port, ca = op.config.webhook_port, op.ca_file
        for sidecar, words in (
            ({"securityProfile": "privileged"}, "privileged is not allowed"),
            ({"extraCapabilities": ["IPC_LOCK"]}, "IPC_LOCK not allowed"),
            ({"image": "evil.example/side:1"}, "is not in the images"),
        ):
            answer = await asyncio.to_thread(policy_review, port, ca, a_policy("x", **sidecar))
            assert answer["allowed"] is False and words in answer["status"]["message"]
        fine = await asyncio.to_thread(policy_review, port, ca, a_policy("ok"))
        assert fine["allowed"] is True
        broken = a_policy("bad")
        broken["spec"]["pool"]["size"] = "lots"
        answer = await asyncio.to_thread(policy_review, port, ca, broken)
        assert answer["allowed"] is False and "spec.pool.size" in answer["status"]["message"]


async def test_a_policy_that_got_in_is_not_allowed_never_injected_and_gets_a_seed(
    kmock: Any, tmp_path: Path
) -> None:
    put(kmock, POLICIES, a_policy("priv", securityProfile="privileged"))
    put(kmock, POLICIES, a_policy("plain"))
    async with running_operator(kmock, tmp_path, injection_label="", status_interval=0.5) as op:

        def ready(name: str) -> dict[str, Any]:
            st_ = kmock.objects[POLICIES, NS, name].raw.get("status") or {}
            return next((c for c in st_.get("conditions") or [] if c["type"] == "Ready"), {})

        cond = await eventually(lambda: ready("priv"))
        assert cond["status"] == "False" and cond["reason"] == "NotAllowed"
        seed = await eventually(lambda: stored(kmock, hashseed.secret_name("plain")))
        value = base64.b64decode(seed["data"]["PYTHONHASHSEED"])
        assert value != b"0" and 0 < int(value) <= 4294967295
        assert stored(kmock, hashseed.secret_name("priv")) is None
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "v", "labels": {"app": "vllm"}},
            "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v1"}]},
        }
        answer = await asyncio.to_thread(op.review, pod, NS)
        patch = json.loads(base64.b64decode(answer.get("patch", "W10=")))
        assert '"plain"' in json.dumps(patch) and '"priv"' not in json.dumps(patch)
        assert '"privileged": true' not in json.dumps(patch)
        # the same pod in another namespace: no policy of that namespace, left alone
        other = await asyncio.to_thread(op.review, pod, "elsewhere")
        assert other["allowed"] is True and "patch" not in other


# -- hostile AdmissionReviews ------------------------------------------------------------------

_text = st.text(st.characters(codec="utf-8"), max_size=40)
_leaf = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | _text
_json = st.recursive(
    _leaf, lambda c: st.lists(c, max_size=4) | st.dictionaries(_text, c, max_size=4), max_leaves=30
)
_container = st.fixed_dictionaries(
    {"name": st.sampled_from(["vllm", "", "kvoffload-sidecar", "\u202e"]) | _text},
    optional={
        "image": st.sampled_from(["vllm/vllm-openai:v1", ""]) | _text,
        "command": st.lists(_text, max_size=5) | _json,
        "args": st.lists(
            st.sampled_from(
                ["--model=m", "--kv-transfer-config={}", "--prefix-caching-hash-algo", "xxhash"]
            )
            | _text,
            max_size=6,
        ),
        "env": st.lists(
            st.fixed_dictionaries({"name": _text}, optional={"value": _json, "valueFrom": _json}),
            max_size=4,
        )
        | _json,
        "envFrom": _json,
        "resources": _json,
    },
)
_pod = st.fixed_dictionaries(
    {
        "apiVersion": st.just("v1"),
        "kind": st.just("Pod"),
        "metadata": st.fixed_dictionaries(
            {"labels": st.just({"app": "vllm"}) | st.dictionaries(_text, _text, max_size=3)},
            optional={
                "annotations": st.dictionaries(
                    st.sampled_from(
                        [
                            "kvoffload.io/inject",
                            "kvoffload.io/inject-via",
                            "kvoffload.io/status",
                            "kvoffload.io/policy",
                            "kvoffload.io/pool-size",
                        ]
                    )
                    | _text,
                    _text,
                    max_size=4,
                ),
                "name": _text,
            },
        ),
        "spec": st.fixed_dictionaries(
            {"containers": st.lists(_container, max_size=3)},
            optional={"initContainers": st.lists(_container, max_size=2) | _json, "volumes": _json},
        )
        | _json,
    }
)


def raw_review(port: int, body: bytes, timeout: float) -> tuple[int, bytes]:
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    req = urllib.request.Request(
        f"https://127.0.0.1:{port}/mutate-pods",
        data=body,
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, context=ctx, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _review_of(pod: Any) -> bytes:
    """A review as the API server sends it (every field it always sets), around ``pod``."""
    gvk = {"group": "", "version": "v1", "kind": "Pod"}
    gvr = {"group": "", "version": "v1", "resource": "pods"}
    return json.dumps(
        {
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": str(uuid.uuid4()),
                "kind": gvk,
                "resource": gvr,
                "requestKind": gvk,
                "requestResource": gvr,
                "namespace": NS,
                "operation": "CREATE",
                "userInfo": {"username": "system:serviceaccount:kube-system:replicaset-controller"},
                "object": pod,
                "oldObject": None,
                "dryRun": False,
            },
        }
    ).encode()


async def test_the_pod_webhook_never_blocks_a_pod_over_https(kmock: Any, tmp_path: Path) -> None:
    """Hostile pod specs (hypothesis) and malformed reviews: every well-formed review is allowed,
    within the webhook's 5 s timeout; a malformed one gets an error answer, never a hang."""
    put(kmock, POLICIES, a_policy("plain"))
    async with running_operator(kmock, tmp_path, injection_label="") as op:
        port = op.config.webhook_port
        pods: list[Any] = []

        @settings(
            max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None
        )
        @given(_pod)
        def collect(pod: Any) -> None:
            pods.append(pod)

        collect()
        deep: Any = {"containers": []}
        for _ in range(400):  # deeply nested
            deep = {"x": deep}
        pods += [
            {"metadata": {"labels": {"app": "vllm"}}, "spec": deep},
            {
                "metadata": {"labels": {"app": "vllm"}, "annotations": {"a" * 200: "b" * 200_000}},
                "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v1"}] * 200},
            },
        ]
        for pod in pods:
            start = time.monotonic()
            code, body = await asyncio.to_thread(raw_review, port, _review_of(pod), 5.0)
            assert time.monotonic() - start < 5.0
            assert code == 200, (body[:300], json.dumps(pod)[:600])
            assert json.loads(body)["response"]["allowed"] is True, body[:300]
        for junk in (
            b"",
            b"{",
            b"[]",
            b'{"request": null}',
            b'{"request": {"object": 7}}',
            "\udcff".encode("utf-8", "surrogatepass"),
        ):
            start = time.monotonic()
            code, body = await asyncio.to_thread(raw_review, port, junk, 5.0)
            assert time.monotonic() - start < 5.0 and code in (200, 400, 422, 500)
        # and it still serves afterwards
        code, body = await asyncio.to_thread(raw_review, port, _review_of(pods[0]), 5.0)
        assert code == 200
