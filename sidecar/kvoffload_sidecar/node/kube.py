"""The node agent's few Kubernetes API calls, over the standard library.

The agent image carries no Kubernetes client: it reads one `KVOffloadNodePool`, watches it, merge
patches its own node's status entry, and reads one CSIDriver. In a pod it uses the service
account token and CA the kubelet mounts; `--api-server URL` (tests) points at a plain URL.
"""

from __future__ import annotations

import json
import os
import ssl
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
GROUP = "kvoffload.io/v1alpha1"
NODE_POOLS = f"/apis/{GROUP}/kvoffloadnodepools"
CSI_DRIVERS = "/apis/storage.k8s.io/v1/csidrivers"
MERGE_PATCH = "application/merge-patch+json"
TIMEOUT = 30.0


class ApiError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"API {status}: {message}")
        self.status = status  # 0: the API could not be reached


@dataclass(frozen=True)
class ApiConfig:
    server: str
    token_file: str | None = None
    ca_file: str | None = None

    @classmethod
    def in_cluster(cls) -> ApiConfig:
        host, port = (
            os.environ.get("KUBERNETES_SERVICE_HOST"),
            os.environ.get("KUBERNETES_SERVICE_PORT", "443"),
        )
        if not host:
            raise ApiError(0, "not in a pod (no KUBERNETES_SERVICE_HOST) and no --api-server")
        host = f"[{host}]" if ":" in host else host
        return cls(f"https://{host}:{port}", f"{SA_DIR}/token", f"{SA_DIR}/ca.crt")


class KubeClient:
    def __init__(self, config: ApiConfig) -> None:
        self._config = config
        self._ssl = (
            ssl.create_default_context(cafile=config.ca_file)
            if config.server.startswith("https")
            else None
        )

    def _request(
        self,
        method: str,
        path: str,
        body: Mapping[str, Any] | None = None,
        *,
        timeout: float = TIMEOUT,
    ):
        headers = {"Accept": "application/json"}
        if self._config.token_file:
            # re-read each time: the kubelet rotates projected tokens
            with open(self._config.token_file) as f:
                headers["Authorization"] = f"Bearer {f.read().strip()}"
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = MERGE_PATCH
        req = urllib.request.Request(
            self._config.server.rstrip("/") + path, data=data, method=method, headers=headers
        )
        try:
            return urllib.request.urlopen(req, timeout=timeout, context=self._ssl)
        except urllib.error.HTTPError as e:
            raise ApiError(e.code, e.read(512).decode(errors="replace")) from None
        except (urllib.error.URLError, OSError) as e:
            raise ApiError(0, str(e)) from None

    def get(self, path: str) -> dict[str, Any] | None:
        """The object at `path`; None when it does not exist."""
        try:
            with self._request("GET", path) as resp:
                return json.loads(resp.read())
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    def merge_patch(self, path: str, body: Mapping[str, Any]) -> None:
        with self._request("PATCH", path, body):
            pass

    def watch(self, collection: str, name: str, timeout_s: int) -> Iterator[dict[str, Any]]:
        """Watch events of the one object `name` of `collection` until the server ends the
        stream (after about `timeout_s`); the name is also checked here."""
        query = urllib.parse.urlencode(
            {
                "watch": "true",
                "fieldSelector": f"metadata.name={name}",
                "timeoutSeconds": str(timeout_s),
            }
        )
        with self._request("GET", f"{collection}?{query}", timeout=timeout_s + 10) as resp:
            for line in resp:
                if not line.strip():
                    continue
                event = json.loads(line)
                obj = event.get("object") or {}
                if (obj.get("metadata") or {}).get("name") == name or event.get("type") == "ERROR":
                    yield event
