"""The only module that talks to the Kubernetes API (besides kopf itself).

Synchronous `kubernetes` client calls with a timeout on every request (kopf runs sync handlers
in its thread pool). Objects come back as plain dicts in API (camelCase) form.
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kubernetes import client, config
from kubernetes.client.rest import ApiException

REQUEST_TIMEOUT = (5.0, 30.0)  # (connect, read) seconds
MERGE_PATCH = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"
ApiError = ApiException  # what callers catch, so they need not import the client
NODE_POOL_GROUP, NODE_POOL_VERSION, NODE_POOL_PLURAL = (
    "kvoffload.io",
    "v1alpha1",
    "kvoffloadnodepools",
)


def make_api_client(server: str | None = None) -> client.ApiClient:
    """In-cluster config, else the kubeconfig; ``server`` (tests) points at a plain URL."""
    if server:
        cfg = client.Configuration()
        cfg.host = server.rstrip("/")
        return client.ApiClient(cfg)
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.ApiClient()


def _json(response: Any) -> Any:
    return json.loads(response.data)


@dataclass
class KubeApi:
    api: client.ApiClient

    def __post_init__(self) -> None:
        self.core = client.CoreV1Api(self.api)
        self.apps = client.AppsV1Api(self.api)
        self.admission = client.AdmissionregistrationV1Api(self.api)

    def list_pods(self, namespace: str, label_selector: str = "") -> list[dict[str, Any]]:
        resp = self.core.list_namespaced_pod(
            namespace,
            label_selector=label_selector,
            _preload_content=False,
            _request_timeout=REQUEST_TIMEOUT,
        )
        return list(_json(resp).get("items") or [])

    def list_failed_mounts(self, namespace: str) -> list[dict[str, Any]]:
        """The kubelet's FailedMount events on pods of ``namespace`` (the caller filters again:
        a field selector is a hint an emulator may ignore)."""
        resp = self.core.list_namespaced_event(
            namespace,
            field_selector="reason=FailedMount,involvedObject.kind=Pod",
            _preload_content=False,
            _request_timeout=REQUEST_TIMEOUT,
        )
        return list(_json(resp).get("items") or [])

    def list_workloads(self, namespace: str) -> list[dict[str, Any]]:
        """Deployments and StatefulSets of ``namespace``, each with ``kind`` set."""
        out = []
        for kind, fn in (
            ("Deployment", self.apps.list_namespaced_deployment),
            ("StatefulSet", self.apps.list_namespaced_stateful_set),
        ):
            resp = fn(namespace, _preload_content=False, _request_timeout=REQUEST_TIMEOUT)
            out += [{**item, "kind": kind} for item in _json(resp).get("items") or []]
        return out

    def patch_workload(self, kind: str, namespace: str, name: str, body: Mapping[str, Any]) -> None:
        fn = (
            self.apps.patch_namespaced_deployment
            if kind == "Deployment"
            else self.apps.patch_namespaced_stateful_set
        )
        fn(
            name,
            namespace,
            dict(body),
            _content_type=MERGE_PATCH,
            _preload_content=False,
            _request_timeout=REQUEST_TIMEOUT,
        )

    def get_node_pool(self, name: str) -> dict[str, Any] | None:
        """The cluster-scoped KVOffloadNodePool ``name`` (spec and status); None when it does
        not exist. Other errors (403: no RBAC for it) raise."""
        try:
            resp = client.CustomObjectsApi(self.api).get_cluster_custom_object(
                NODE_POOL_GROUP,
                NODE_POOL_VERSION,
                NODE_POOL_PLURAL,
                name,
                _preload_content=False,
                _request_timeout=REQUEST_TIMEOUT,
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return dict(_json(resp))

    def patch_node_pool_status(self, name: str, body: Mapping[str, Any]) -> None:
        """A JSON merge patch of the KVOffloadNodePool's status subresource."""
        client.CustomObjectsApi(self.api).patch_cluster_custom_object_status(
            NODE_POOL_GROUP,
            NODE_POOL_VERSION,
            NODE_POOL_PLURAL,
            name,
            dict(body),
            _content_type=MERGE_PATCH,
            _preload_content=False,
            _request_timeout=REQUEST_TIMEOUT,
        )

    def node_exists(self, name: str) -> bool:
        """Whether the Node ``name`` exists (404: it does not; other errors raise)."""
        try:
            self.core.read_node(name, _preload_content=False, _request_timeout=REQUEST_TIMEOUT)
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise
        return True

    def read_daemonset(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The DaemonSet ``name``; None when it does not exist."""
        try:
            resp = self.apps.read_namespaced_daemon_set(
                name, namespace, _preload_content=False, _request_timeout=REQUEST_TIMEOUT
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return dict(_json(resp))

    def json_patch_pod(self, namespace: str, name: str, ops: list[dict[str, Any]]) -> None:
        """A JSON patch (RFC 6902) of a pod: its ``test`` operations make it all or nothing."""
        self.core.patch_namespaced_pod(
            name,
            namespace,
            ops,
            _content_type=JSON_PATCH,
            _preload_content=False,
            _request_timeout=REQUEST_TIMEOUT,
        )

    def namespace_labels(self, namespace: str) -> dict[str, str] | None:
        """The namespace's labels; None when it cannot be read (403/404)."""
        try:
            resp = self.core.read_namespace(
                namespace, _preload_content=False, _request_timeout=REQUEST_TIMEOUT
            )
        except ApiException as exc:
            if exc.status in (403, 404):
                return None
            raise
        return dict((_json(resp).get("metadata") or {}).get("labels") or {})

    def read_secret(self, namespace: str, name: str) -> dict[str, bytes] | None:
        try:
            resp = self.core.read_namespaced_secret(
                name, namespace, _preload_content=False, _request_timeout=REQUEST_TIMEOUT
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        data = _json(resp).get("data") or {}
        return {k: base64.b64decode(v) for k, v in data.items()}

    def read_secret_versioned(
        self, namespace: str, name: str
    ) -> tuple[dict[str, bytes], str] | None:
        """(data, resourceVersion) of a Secret; None when it does not exist."""
        try:
            resp = self.core.read_namespaced_secret(
                name, namespace, _preload_content=False, _request_timeout=REQUEST_TIMEOUT
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        obj = _json(resp)
        data = obj.get("data") or {}
        version = str((obj.get("metadata") or {}).get("resourceVersion") or "")
        return {k: base64.b64decode(v) for k, v in data.items()}, version

    def create_secret(
        self,
        namespace: str,
        name: str,
        data: Mapping[str, bytes],
        *,
        type_: str = "Opaque",
        labels: Mapping[str, str] | None = None,
        owner: Mapping[str, Any] | None = None,
    ) -> bool:
        """Create a Secret; False when one of that name exists (409: someone else won)."""
        meta: dict[str, Any] = {"name": name, "namespace": namespace}
        if labels:
            meta["labels"] = dict(labels)
        if owner:
            meta["ownerReferences"] = [dict(owner)]
        body = {
            "apiVersion": "v1",
            "kind": "Secret",
            "type": type_,
            "metadata": meta,
            "data": {k: base64.b64encode(v).decode() for k, v in data.items()},
        }
        try:
            self.core.create_namespaced_secret(
                namespace, body, _preload_content=False, _request_timeout=REQUEST_TIMEOUT
            )
        except ApiException as exc:
            if exc.status == 409:
                return False
            raise
        return True

    def replace_secret_data(
        self, namespace: str, name: str, data: Mapping[str, bytes], resource_version: str
    ) -> bool:
        """Replace a Secret's data if it is still at ``resource_version``; False on 409 (another
        writer got there first: re-read)."""
        body = {
            "metadata": {"resourceVersion": resource_version},
            "data": {k: base64.b64encode(v).decode() for k, v in data.items()},
        }
        try:
            self.core.patch_namespaced_secret(
                name,
                namespace,
                body,
                _content_type=MERGE_PATCH,
                _preload_content=False,
                _request_timeout=REQUEST_TIMEOUT,
            )
        except ApiException as exc:
            if exc.status == 409:
                return False
            raise
        return True

    def webhook_owner(self, config_name: str) -> dict[str, Any] | None:
        """An ownerReference to the chart's MutatingWebhookConfiguration (uninstall deletes it,
        and the garbage collector then the Secrets that name it); None when unreadable."""
        try:
            resp = self.admission.read_mutating_webhook_configuration(
                config_name, _preload_content=False, _request_timeout=REQUEST_TIMEOUT
            )
        except ApiException as exc:
            if exc.status in (403, 404):
                return None
            raise
        meta = _json(resp).get("metadata") or {}
        if not meta.get("uid"):
            return None
        return {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "MutatingWebhookConfiguration",
            "name": config_name,
            "uid": meta["uid"],
        }

    def post_pod_event(
        self,
        namespace: str,
        pod: str,
        uid: str,
        field_path: str,
        reason: str,
        message: str,
        now: str,
    ) -> None:
        """A Warning Event on a pod (``kubectl describe pod`` and ``kubectl get events``)."""
        involved = {"apiVersion": "v1", "kind": "Pod", "name": pod, "uid": uid,
                    "fieldPath": field_path}  # fmt: skip
        self.post_event(namespace, involved, "Warning", reason, message, now, named=False)

    def post_event(
        self,
        namespace: str,
        involved: Mapping[str, Any],
        type_: str,
        reason: str,
        message: str,
        now: str,
        *,
        named: bool = True,
    ) -> None:
        """An Event (``type_`` Normal or Warning) on the object ``involved`` (apiVersion, kind,
        name, uid; in ``namespace``), named ``<object>.<hex nanoseconds>`` as client-go's
        recorder names its events (``named=False``: the API server picks the name)."""
        meta = (
            {"name": f"{involved['name']}.{time.time_ns():x}"}
            if named
            else {"generateName": f"{involved['name']}.kvoffload-"}
        )
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {**meta, "namespace": namespace},
            "involvedObject": {**involved, "namespace": namespace},
            "type": type_,
            "reason": reason,
            "message": message[:1024],
            "source": {"component": "kvoffload-operator"},
            "reportingComponent": "kvoffload.io/operator",
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        self.core.create_namespaced_event(
            namespace, body, _preload_content=False, _request_timeout=REQUEST_TIMEOUT
        )

    def patch_webhook_ca(
        self, config_name: str, ca_pem: bytes, *, validating: bool = False
    ) -> None:
        """Set ``caBundle`` on every webhook of the Mutating- (or Validating-) WebhookConfiguration
        (only where it differs: replicas patching the same CA write nothing)."""
        read, patch_fn = (
            (
                self.admission.read_validating_webhook_configuration,
                self.admission.patch_validating_webhook_configuration,
            )
            if validating
            else (
                self.admission.read_mutating_webhook_configuration,
                self.admission.patch_mutating_webhook_configuration,
            )
        )
        resp = read(config_name, _preload_content=False, _request_timeout=REQUEST_TIMEOUT)
        webhooks = _json(resp).get("webhooks") or []
        bundle = base64.b64encode(ca_pem).decode()
        # strategic merge: webhooks merge by name, so only caBundle changes
        changed = [
            {"name": w.get("name"), "clientConfig": {"caBundle": bundle}}
            for w in webhooks
            if (w.get("clientConfig") or {}).get("caBundle") != bundle
        ]
        if changed:
            patch_fn(
                config_name,
                {"webhooks": changed},
                _content_type="application/strategic-merge-patch+json",
                _preload_content=False,
                _request_timeout=REQUEST_TIMEOUT,
            )
