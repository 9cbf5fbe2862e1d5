"""Every annotation and label key the operator reads or writes, in one place.

Keys on pods (written by the injector):
- ``STATUS``: JSON ``{"policy", "generation", "version", "vllmContainer", "initContainers",
  "volumes", "env"}``: what was injected, so a second pass is a no-op.
- ``POLICY`` / ``POLICY_GENERATION``: the policy that injected the pod and its generation.
- ``SKIP_REASON``: set when a matching policy left the pod alone (a ``SkipReason`` value).
- label ``INJECTED_LABEL: "true"`` on injected pods (label selectors find them).

Keys users may set on pods (or pod templates):
- label or annotation ``INJECT: "false"``: opt out (the chart's objectSelector also honours
  the label).
- ``POOL_SIZE``: per-pod pool size override (a quantity, e.g. ``"32Gi"``).
- ``VLLM_CONTAINER``: the vLLM container's name when detection would guess wrong.
- ``INJECT_VIA``: ``args`` | ``env`` | ``auto``: how the connector config reaches a vLLM that the
  injector cannot see start (a script file, an unknown image entrypoint, a ``--config`` file):
  appended to args, or as env ``KVOFFLOAD_KV_TRANSFER_CONFIG`` (docs/INJECTION.md).

Key on workload pod templates (written by the operator): ``POLICY_HASH`` (rollouts).
Key on namespaces: ``NAMESPACE_INJECTION: "enabled"`` opts the namespace in (chart webhook).
"""

from __future__ import annotations

PREFIX = "kvoffload.io/"

STATUS = PREFIX + "status"
POLICY = PREFIX + "policy"
POLICY_GENERATION = PREFIX + "policy-generation"
SKIP_REASON = PREFIX + "skip-reason"
POLICY_HASH = PREFIX + "policy-hash"
INJECTED_LABEL = PREFIX + "injected"

INJECT = PREFIX + "inject"
POOL_SIZE = PREFIX + "pool-size"
VLLM_CONTAINER = PREFIX + "vllm-container"
INJECT_VIA = PREFIX + "inject-via"

NAMESPACE_INJECTION = PREFIX + "injection"
