"""Run the real operator (kopf, our handlers, its HTTPS admission server) in-process against the
kmock API emulator, and talk AdmissionReview v1 to it over real TLS.

kopf runs on its own event loop in its own thread (kopf's documented embedding): kmock serves on
the test's loop, and a kopf that is slow to stop (or never does) cannot hang the test loop's
teardown; the test still fails when the operator does not stop in time.

kmock fidelity limits (k8s-conventions.md §5): no validation/defaulting, PATCH is a dict merge,
``resourceVersion`` never changes, label selectors are ignored by LIST (the operator filters
again itself). Tests therefore assert final state, not call counts.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import json
import socket
import ssl
import threading
import urllib.request
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import kopf
from kvoffload_operator import certs
from kvoffload_operator.handlers import register
from kvoffload_operator.k8s import KubeApi, make_api_client
from kvoffload_operator.metrics import OperatorMetrics
from kvoffload_operator.policy import API_GROUP, API_VERSION, PLURAL
from kvoffload_operator.settings import OperatorConfig

POLICIES = f"{API_GROUP}/{API_VERSION}/{PLURAL}"
NODE_POOLS = f"{API_GROUP}/{API_VERSION}/kvoffloadnodepools"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def declare_resources(kmock: Any) -> None:
    """Discovery for everything the operator lists or watches (kopf starts no watch without
    ``v1/namespaces`` and the CRD resource being declared)."""
    res = kmock.resources
    res[POLICIES].kind = "KVOffloadPolicy"
    res[POLICIES].namespaced = True
    res[POLICIES].verbs = {"list", "watch", "get", "patch"}
    res[POLICIES].subresources = {"status"}
    res[NODE_POOLS].subresources = {"status"}  # a node pool's entries of gone nodes pruned
    for key, kind, namespaced in (
        ("v1/pods", "Pod", True),
        ("v1/namespaces", "Namespace", False),
        ("apps/v1/deployments", "Deployment", True),
        ("apps/v1/statefulsets", "StatefulSet", True),
        ("apiextensions.k8s.io/v1/customresourcedefinitions", "CustomResourceDefinition", False),
        ("v1/events", "Event", True),
        ("v1/secrets", "Secret", True),  # hash seeds, the self-signed webhook pair
        (NODE_POOLS, "KVOffloadNodePool", False),  # read by name for node policies' status
        ("v1/nodes", "Node", False),  # whether a node a pool's status names still exists
    ):
        res[key].kind = kind
        res[key].namespaced = namespaced
        res[key].verbs = {"list", "watch", "get", "patch", "create"}


@dataclass
class Running:
    config: OperatorConfig
    metrics: OperatorMetrics
    ca_file: Path
    api: KubeApi

    def review(self, pod: dict[str, Any], namespace: str, **kw: Any) -> dict[str, Any]:
        return admission_review(self.config.webhook_port, self.ca_file, pod, namespace, **kw)


def admission_review(
    port: int,
    ca_file: Path,
    pod: dict[str, Any],
    namespace: str,
    *,
    dry_run: bool = False,
    timeout: float = 10.0,
) -> dict[str, Any]:
    """POST one AdmissionReview v1 (CREATE pod) over HTTPS, verifying the server against
    ``ca_file``; returns the response part."""
    body = {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": str(uuid.uuid4()),
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
            "requestResource": {"group": "", "version": "v1", "resource": "pods"},
            "name": pod.get("metadata", {}).get("name", ""),
            "namespace": namespace,
            "operation": "CREATE",
            "userInfo": {"username": "system:serviceaccount:kube-system:replicaset-controller"},
            "object": pod,
            "oldObject": None,
            "dryRun": dry_run,
            "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"},
        },
    }
    ctx = ssl.create_default_context(cafile=str(ca_file))
    req = urllib.request.Request(
        f"https://localhost:{port}/mutate-pods",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, context=ctx, timeout=timeout) as resp:
        review = json.loads(resp.read())
    assert review["kind"] == "AdmissionReview" and review["apiVersion"] == "admission.k8s.io/v1"
    assert review["response"]["uid"] == body["request"]["uid"]
    return dict(review["response"])


def decoded_patch(response: dict[str, Any]) -> list[dict[str, Any]]:
    if "patch" not in response:
        return []
    assert response["patchType"] == "JSONPatch"
    return list(json.loads(base64.b64decode(response["patch"])))


@contextlib.asynccontextmanager
async def running_operator(kmock: Any, tmp_path: Path, **overrides: Any) -> AsyncIterator[Running]:
    declare_resources(kmock)
    bundle = certs.generate(["localhost"], ("127.0.0.1",))
    bundle.write(tmp_path / "certs")
    options: dict[str, Any] = dict(
        webhook_port=free_port(),
        webhook_addr="127.0.0.1",
        cert_dir=tmp_path / "certs",
        api_server=str(kmock.url),
        standalone=True,
        metrics_port=0,
        health_port=0,
    )
    config = replace(OperatorConfig(), **{**options, **overrides})
    registry = kopf.OperatorRegistry()
    register(registry, config)
    metrics = OperatorMetrics.create()
    api = KubeApi(make_api_client(config.api_server))
    memo = kopf.Memo(config=config, metrics=metrics, api=api)
    settings = kopf.OperatorSettings()
    settings.posting.enabled = False  # kmock has no events resource worth asserting on
    stop = threading.Event()
    failure: list[BaseException] = []

    def run_kopf() -> None:
        try:
            asyncio.run(
                kopf.operator(
                    registry=registry,
                    settings=settings,
                    memo=memo,
                    clusterwide=True,
                    standalone=True,
                    stop_flag=stop,
                )
            )
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            failure.append(exc)

    thread = threading.Thread(target=run_kopf, name="kopf-operator", daemon=True)
    thread.start()
    try:
        if config.webhook_port:
            await _wait_for_port(config.webhook_port, thread, failure)
        yield Running(config, metrics, tmp_path / "certs" / "ca.crt", api)
    finally:
        stop.set()
        await asyncio.to_thread(thread.join, STOP_TIMEOUT_S)
    if thread.is_alive():  # left behind as a daemon thread; the test loop stays clean
        raise AssertionError(f"the operator did not stop within {STOP_TIMEOUT_S} s")
    if failure and not isinstance(failure[0], asyncio.CancelledError):
        raise failure[0]


STOP_TIMEOUT_S = 30.0


async def _wait_for_port(
    port: int, thread: threading.Thread, failure: list[BaseException], timeout: float = 20.0
) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        if not thread.is_alive():
            if failure:
                raise failure[0]
            raise AssertionError("the operator exited before serving")
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            return
        except OSError:
            await asyncio.sleep(0.1)
    raise AssertionError(f"webhook port {port} not open after {timeout} s")


async def eventually(check: Any, timeout: float = 15.0, interval: float = 0.2) -> Any:
    """Poll ``check()`` (sync or async) until it returns a truthy value; fail after ``timeout``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    last: Any = None
    while loop.time() < deadline:
        last = check()
        if asyncio.iscoroutine(last):
            last = await last
        if last:
            return last
        await asyncio.sleep(interval)
    raise AssertionError(f"condition not met within {timeout} s (last: {last!r})")


def put(kmock: Any, resource: str, obj: dict[str, Any]) -> dict[str, Any]:
    """Store ``obj`` in kmock with the metadata a real API server would add (kopf's patches
    ``test`` the resourceVersion)."""
    obj = copy.deepcopy(obj)
    meta = obj.setdefault("metadata", {})
    meta.setdefault("resourceVersion", "1")
    meta.setdefault("uid", str(uuid.uuid4()))
    meta.setdefault("generation", 1)
    meta.setdefault("creationTimestamp", "2026-01-01T00:00:00Z")
    kmock.objects[resource, meta.get("namespace"), meta["name"]] = obj
    return obj
