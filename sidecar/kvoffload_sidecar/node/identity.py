"""Who a pod is: the fields the kubelet adds to NodePublishVolume (CSIDriver `podInfoOnMount`).

The agent takes a pod's identity only from there, once, when the kubelet publishes the pod's
volume, and binds it to that pod's socket; nothing a pod sends later can change it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

EPHEMERAL = "csi.storage.k8s.io/ephemeral"
POD_NAME = "csi.storage.k8s.io/pod.name"
POD_NAMESPACE = "csi.storage.k8s.io/pod.namespace"
POD_UID = "csi.storage.k8s.io/pod.uid"
SERVICE_ACCOUNT = "csi.storage.k8s.io/serviceAccount.name"
# keys the kubelet may add that this driver does not use (tokens only with tokenRequests)
KUBELET_OTHER = ("csi.storage.k8s.io/serviceAccount.tokens",)
TENANT = "tenant"  # the one key a pod spec writes (volumeAttributes): a request, not a credential

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
_UID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


class IdentityError(ValueError):
    """The volume context does not name one pod of an inline ephemeral volume."""


@dataclass(frozen=True)
class PodIdentity:
    namespace: str
    name: str
    uid: str
    service_account: str

    def describe(self) -> str:
        return f"{self.namespace}/{self.name} (uid {self.uid}, sa {self.service_account})"


@dataclass(frozen=True)
class VolumeRequest:
    """A NodePublishVolume's context, checked: the pod and the tenant it asks for."""

    pod: PodIdentity
    tenant: str


def parse_volume_context(context: Mapping[str, str]) -> VolumeRequest:
    """Raise `IdentityError` naming the first problem; unknown keys are refused (a typo in a
    pod spec's volumeAttributes must not be silently ignored)."""
    if context.get(EPHEMERAL) != "true":
        raise IdentityError(
            f"{EPHEMERAL} is {context.get(EPHEMERAL)!r}: this driver serves only inline ephemeral "
            "volumes (CSIDriver volumeLifecycleModes: [Ephemeral], podInfoOnMount: true)"
        )
    known = {EPHEMERAL, POD_NAME, POD_NAMESPACE, POD_UID, SERVICE_ACCOUNT, TENANT, *KUBELET_OTHER}
    unknown = sorted(set(context) - known)
    if unknown:
        raise IdentityError(f"unknown volumeAttributes {unknown}: only {TENANT!r} is read")
    values = {}
    for key, pattern in (
        (POD_NAMESPACE, _DNS_LABEL),
        (POD_NAME, _DNS_SUBDOMAIN),
        (POD_UID, _UID),
        (SERVICE_ACCOUNT, _DNS_SUBDOMAIN),
    ):
        value = context.get(key, "")
        if not value:
            raise IdentityError(f"{key} is missing (the CSIDriver must say podInfoOnMount: true)")
        if not pattern.match(value):
            raise IdentityError(f"{key}={value!r} is not a valid Kubernetes value")
        values[key] = value
    tenant = context.get(TENANT, "")
    if not tenant or not _DNS_LABEL.match(tenant):
        raise IdentityError(f"volumeAttributes {TENANT!r} must name a tenant, got {tenant!r}")
    pod = PodIdentity(
        namespace=values[POD_NAMESPACE],
        name=values[POD_NAME],
        uid=values[POD_UID],
        service_account=values[SERVICE_ACCOUNT],
    )
    return VolumeRequest(pod=pod, tenant=tenant)
