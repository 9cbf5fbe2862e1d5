"""Whether a published pod may have the tenant its volume names, and if not, why.

NodePublishVolume publishes every volume the kubelet sends for a real pod, granted or not: a
mount the agent refused would hold the pod in ContainerCreating, a pod made worse by kvoffload.
What a grant decides is what the pod's sockets serve. A binding made with the grant
(`Binding.granted`) keeps it until the pod unpublishes, whatever later grants say; a binding
made without it is granted when the agent accepts grants that admit it (csi.py
`NodeAgent.reconsider`), and until then its `memory.sock` sends no memfd and its `pool.sock`
serves no Pool: every call answers the refusal below.

Codes (the names are the gRPC status codes and `memory.sock`'s answer codes alike):
UNAVAILABLE while the agent cannot decide (the CSIDriver or the grants are not read or not
good: the pod may get its tenant later without a restart), PERMISSION_DENIED for a tenant not
granted to the pod's namespace and service account, one message whether the tenant exists or
not (a pod's user learns no tenant names).
"""

from __future__ import annotations

from collections.abc import Callable

from kvoffload_sidecar.node.bindings import Binding
from kvoffload_sidecar.node.grants import NodePoolSpec

PERMISSION_DENIED = "PERMISSION_DENIED"
UNAVAILABLE = "UNAVAILABLE"

Refusal = tuple[str, str]  # (code, message)


def not_granted(binding: Binding) -> Refusal:
    """What a socket of an ungranted binding answers with no agent state to ask (tests)."""
    return PERMISSION_DENIED, f"tenant {binding.tenant!r} is not granted to this pod"


class Access:
    """The grants in force (`spec()`) and what holds every grant back (`precondition()`)."""

    def __init__(
        self,
        spec: Callable[[], NodePoolSpec],
        precondition: Callable[[], str | None] = lambda: None,
    ) -> None:
        self._spec = spec
        self._precondition = precondition

    def spec(self) -> NodePoolSpec:
        return self._spec()

    def admits(self, binding: Binding) -> bool:
        """Whether the grants in force give `binding`'s pod its tenant now."""
        return self._precondition() is None and self._spec().admits(binding.pod, binding.tenant)

    def refusal(self, binding: Binding) -> Refusal:
        """Why an ungranted binding's sockets refuse, asked at every request (it changes as the
        agent reads its CSIDriver and grants)."""
        problem = self._precondition()
        if problem is not None:
            return UNAVAILABLE, f"the node agent grants no tenant yet: {problem}"
        spec = self._spec()
        pod = binding.pod
        if not spec.admits(pod, binding.tenant):
            return (
                PERMISSION_DENIED,
                f"tenant {binding.tenant!r} is not granted to namespace {pod.namespace} service "
                f"account {pod.service_account} on node pool {spec.name}",
            )
        return UNAVAILABLE, f"tenant {binding.tenant!r} is being granted to this pod: ask again"
