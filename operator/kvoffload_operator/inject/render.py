"""Build the injected pod from a positive `Decision` (pure; returns a new dict).

What is added (the operator ↔ chart contract in docs/ARCHITECTURE.md):
- init container ``kvoffload-connector-install`` (connector delivery ``initContainer`` only);
- native sidecar ``kvoffload-sidecar`` (``restartPolicy: Always``, bounded exec startup probe: see
  `startup_probe`), appended
  after the user's init containers so theirs (e.g. a model download) run first;
- volumes ``kvoffload-pool`` (memory or hugepages emptyDir), ``kvoffload-run`` (the socket),
  ``kvoffload-python`` (connector payload, initContainer delivery only); every name, path and
  port added is in `reserved`, which the decision checks the pod against first;
- in the vLLM container: ``--kv-transfer-config=<json>`` appended to ``args`` (first among the
  engine's arguments where they hold a bare ``--``; or, in a ``sh -c`` script,
  ``--kv-transfer-config '<json>'`` right after the engine invocation), mounts,
  ``PYTHONHASHSEED`` from the policy's seed Secret (`hashseed`) when unset and no ``envFrom`` may
  set it (block hashes must agree across processes), ``PYTHONPATH``;
- annotations ``kvoffload.io/status|policy|policy-generation`` and label ``kvoffload.io/injected``;
- in a Guaranteed pod, limits equal to requests on what is added, and with pod-level resources
  the sidecar's share added to them (`qos.py`: the pod keeps its QoS class and its budget).
With ``spec.pool.placement: node`` (docs/NODE.md) there is no sidecar and neither the pool nor
the socket emptyDir: the volume ``kvoffload-node`` is a CSI inline volume of the node agent's
driver (``node.kvoffload.io``, read-write, ``volumeAttributes: {tenant: T}``) mounted at
``/var/run/kvoffload`` in the vLLM container, and the connector's config names the socket there
and ``placement: node``; the installer, ``PYTHONPATH`` and ``PYTHONHASHSEED`` are as above.
Nothing else the user wrote is removed or replaced (a user's ``/dev/shm`` mount stays as it is).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvoffload_operator import annotations as ann
from kvoffload_operator import hashseed
from kvoffload_operator.inject.decide import Decision, SkipReason
from kvoffload_operator.inject.engine import insert_flag
from kvoffload_operator.inject.qos import (
    GUARANTEED_INSTALLER_CPU,
    GUARANTEED_SIDECAR_CPU,
    grow_pod_level,
    guaranteed_resources,
    is_guaranteed,
    within_limits,
)
from kvoffload_operator.inject.reserved import (
    GRPC_PORT,
    INSTALLER_NAME,
    METRICS_PORT,
    NODE_DIR,
    NODE_DRIVER,
    NODE_VOLUME,
    POOL_DIR,
    POOL_VOLUME,
    PYTHON_DIR,
    PYTHON_VOLUME,
    RUN_DIR,
    RUN_VOLUME,
    SIDECAR_NAME,
    USER_PYTHONPATH_ENV,
)
from kvoffload_operator.inject.site import Edit, EnvEdit
from kvoffload_operator.policy import Delivery, Policy, SecurityProfile, SidecarSpec
from kvoffload_operator.sizing import PYTHON_DIR_LIMIT, RUN_DIR_LIMIT, size_pool
from kvoffload_operator.tenants import sidecar_flag

SOCKET = RUN_DIR + "/pool.sock"
NODE_SOCKET = NODE_DIR + "/pool.sock"
POD_IP_ENV = "KVOFFLOAD_POD_IP"  # the sidecar's listeners bind it (`$(...)` in its args)
CONNECTOR_CLASS = "KVOffloadConnector"
CONNECTOR_MODULE = "kvoffload_connector.connector"
MINIMAL_INSTALLER = SidecarSpec()


@dataclass(frozen=True)
class RenderDefaults:
    """Operator-wide values a policy may leave out (``--sidecar-image``, ``--connector-image``)."""

    sidecar_image: str = "ghcr.io/kvoffload/kvoffload:0.1.0"
    connector_image: str = "ghcr.io/kvoffload/kvoffload-connector:0.1.0"
    version: str = "0.1.0"  # recorded in the status annotation


def kv_transfer_config(policy: Policy) -> dict[str, Any]:
    """The connector's config. Only keys the connector alone reads go in, and ``chunk_size`` only
    when the policy sets it: a value we picked could disagree with engine settings we cannot see
    (``--block-size``), so by default the connector derives it from the engine's block size."""
    extra: dict[str, Any] = {
        **policy.connector.extra_config,
        "socket": NODE_SOCKET if policy.pool.node else SOCKET,
        "mode": policy.offload.mode.value,
        "load_mode": policy.offload.load_mode.value,
    }
    if policy.pool.node:  # the connector expects no pool file path, and says so in its status
        extra["placement"] = policy.pool.placement.value
    if policy.offload.chunk_size is not None:
        extra["chunk_size"] = policy.offload.chunk_size
    return {
        "kv_connector": CONNECTOR_CLASS,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }


def security_context(sidecar: SidecarSpec) -> dict[str, Any]:
    """``minimal``: Pod Security "restricted"-compatible; ``privileged``: what it says.

    No ``runAsUser``/``runAsGroup``: the images' USER is the numeric 65532, which satisfies
    ``runAsNonRoot``, and a pinned uid would make OpenShift's restricted SCC (uids from the
    namespace's range) reject the whole pod, vLLM included."""
    if sidecar.security_profile is SecurityProfile.PRIVILEGED:
        return {"privileged": True}
    caps: dict[str, Any] = {"drop": ["ALL"]}
    if sidecar.extra_capabilities:
        caps["add"] = list(sidecar.extra_capabilities)
    return {
        "runAsNonRoot": True,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": caps,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _resources(policy: Policy, pool_bytes: int, guaranteed: bool) -> dict[str, Any]:
    sizing = size_pool(policy.pool, pool_bytes)
    out: dict[str, Any] = {
        "requests": dict(sizing.sidecar_requests),
        "limits": dict(sizing.sidecar_limits),
    }
    if guaranteed:  # qos.py: the CPU is set below, limit == request
        out["requests"].pop("cpu", None)
    for key in ("requests", "limits"):  # the policy's overrides win, key by key
        out[key].update((policy.sidecar.resources or {}).get(key) or {})
    out = guaranteed_resources(out, GUARANTEED_SIDECAR_CPU) if guaranteed else out
    return within_limits(out)


def startup_probe(deadline: int) -> dict[str, Any]:
    """The native sidecar's startup probe, which gates the vLLM container's start.

    ``kvoffload probe`` exits 0 once the pool socket serves, or ``deadline`` seconds after its
    first run whatever the sidecar's state, so vLLM waits at most about ``deadline`` seconds and
    then starts without the pool (the connector treats it as absent). ``failureThreshold`` leaves
    30 spare periods, so the kubelet never kills the sidecar before the probe's own deadline.
    There is deliberately no readinessProbe: a degraded sidecar must not take the pod out of
    service. The liveness probe's thresholds are generous (a minute of failed health checks).
    What no probe can bypass is a sidecar image that cannot be pulled: the kubelet starts no later
    container; the operator reports it (policy ``Degraded`` condition, a pod Event).
    """
    return {
        "exec": {
            "command": ["kvoffload", "probe", "--socket", SOCKET, "--deadline", str(deadline)]
        },
        "periodSeconds": 1,
        "timeoutSeconds": 3,
        "failureThreshold": deadline + 30,
    }


def sidecar_container(
    policy: Policy, pool_bytes: int, defaults: RenderDefaults, guaranteed: bool = False
) -> dict[str, Any]:
    args = [
        f"--pool-size={pool_bytes}",
        f"--pool-dir={POOL_DIR}",
        f"--socket={SOCKET}",
        # the pod IP only (what the kubelet's gRPC probe, Prometheus and the operator dial): not
        # every interface of a hostNetwork pod's node; a NetworkPolicy limits who reaches it
        f"--listen=$({POD_IP_ENV}):{GRPC_PORT}",
        f"--metrics-listen=$({POD_IP_ENV}):{METRICS_PORT}",
        # the socket and pool file are in the pod's own emptyDirs; vLLM may run as another uid
        "--file-mode=0666",
        f"--eviction={policy.pool.eviction.value}",
        # a pool that cannot be built (no memory, no hugepages) leaves the sidecar up and serving
        # degraded: the connector sees no pool and vLLM runs as without kvoffload
        "--on-pool-error=degrade",
    ]
    if policy.pool.hugepages:
        args.append("--hugepages")
    if policy.pool.numa_node is not None:
        args.append(f"--numa-node={policy.pool.numa_node}")
    if policy.tenants:  # per-tenant quotas of the pool, by the requests' cache_salt
        args.append(f"--tenants={sidecar_flag(policy.tenants)}")
    return {
        "name": SIDECAR_NAME,
        "image": policy.sidecar.image or defaults.sidecar_image,
        "imagePullPolicy": "IfNotPresent",
        "restartPolicy": "Always",
        "command": ["kvoffload", "sidecar"],
        "args": args,
        "env": [{"name": POD_IP_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
        "ports": [
            {"name": "grpc-health", "containerPort": GRPC_PORT, "protocol": "TCP"},
            {"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"},
        ],
        "startupProbe": startup_probe(policy.sidecar.startup_timeout_seconds),
        "livenessProbe": {
            "grpc": {"port": GRPC_PORT},
            "periodSeconds": 10,
            "timeoutSeconds": 5,
            "failureThreshold": 6,
        },
        "resources": _resources(policy, pool_bytes, guaranteed),
        "securityContext": security_context(policy.sidecar),
        "volumeMounts": [
            {"name": POOL_VOLUME, "mountPath": POOL_DIR},
            {"name": RUN_VOLUME, "mountPath": RUN_DIR},
        ],
    }


def installer_container(
    policy: Policy, defaults: RenderDefaults, guaranteed: bool = False
) -> dict[str, Any]:
    resources: dict[str, Any] = {
        "requests": {"cpu": "50m", "memory": "64Mi"},
        "limits": {"memory": "256Mi"},
    }
    if guaranteed:  # an init container's request does not add to the pod's (max, not sum)
        resources = guaranteed_resources({"limits": {"memory": "256Mi"}}, GUARANTEED_INSTALLER_CPU)
    return {
        "name": INSTALLER_NAME,
        "image": policy.connector.image or defaults.connector_image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["cp", "-R", "/payload/.", PYTHON_DIR],
        "resources": resources,
        # copying files needs no privilege and no capability, whatever the sidecar's profile
        "securityContext": security_context(MINIMAL_INSTALLER),
        "volumeMounts": [{"name": PYTHON_VOLUME, "mountPath": PYTHON_DIR}],
    }


def node_volume(policy: Policy) -> dict[str, Any]:
    """The node agent's CSI inline volume. Read-write: the kubelet applies a pod's fsGroup only
    to volumes that are not read-only (the directory is the agent's either way). The tenant is a
    request, never a credential: the agent checks it against the node pool's grants for the
    namespace and service account the kubelet gives it."""
    return {
        "name": NODE_VOLUME,
        "csi": {
            "driver": NODE_DRIVER,
            "readOnly": False,
            "volumeAttributes": {"tenant": str(policy.pool.tenant)},
        },
    }


def _volumes(policy: Policy, pool_bytes: int | None) -> list[dict[str, Any]]:
    if policy.pool.node:
        vols = [node_volume(policy)]
    else:
        assert pool_bytes is not None
        sizing = size_pool(policy.pool, pool_bytes)
        vols = [
            {
                "name": POOL_VOLUME,
                "emptyDir": {"medium": sizing.pool_medium, "sizeLimit": sizing.pool_size_limit},
            },
            {"name": RUN_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": RUN_DIR_LIMIT}},
        ]
    if policy.connector.delivery is Delivery.INIT_CONTAINER:
        vols.append({"name": PYTHON_VOLUME, "emptyDir": {"sizeLimit": PYTHON_DIR_LIMIT}})
    return vols


def _patch_vllm(container: dict[str, Any], policy: Policy, edit: Edit) -> list[str]:
    """Mutate the vLLM container in place; returns the env names it added or changed."""
    config = json.dumps(kv_transfer_config(policy), sort_keys=True, separators=(",", ":"))
    insert_flag(container, edit, "--kv-transfer-config", config)
    touched = [edit.name] if isinstance(edit, EnvEdit) else []  # `inject-via: env`
    mounts = container.setdefault("volumeMounts", [])
    if policy.pool.node:
        mounts.append({"name": NODE_VOLUME, "mountPath": NODE_DIR})
    else:
        mounts += [
            {"name": POOL_VOLUME, "mountPath": POOL_DIR},
            {"name": RUN_VOLUME, "mountPath": RUN_DIR},
        ]
    env = container.setdefault("env", [])
    names = {e.get("name"): e for e in env}
    # an envFrom source may set it, and this webhook cannot read ConfigMaps or Secrets: an env
    # entry would override the user's seed (a KV-aware router hashes with the same one). Left
    # alone, the connector notes it where the seed then turns out to be per process. Ours is
    # the policy's random seed, from the Secret the operator keeps (`hashseed`), never a constant.
    if hashseed.KEY not in names and not container.get("envFrom"):
        env.append(hashseed.env_entry(policy.name))
        touched.append(hashseed.KEY)
    if policy.connector.delivery is Delivery.INIT_CONTAINER:
        mounts.append({"name": PYTHON_VOLUME, "mountPath": PYTHON_DIR, "readOnly": True})
        current = names.get("PYTHONPATH")
        if current is None:
            env.append({"name": "PYTHONPATH", "value": PYTHON_DIR})
        elif "value" in current:
            current["value"] = (
                f"{PYTHON_DIR}:{current['value']}" if current["value"] else PYTHON_DIR
            )
        else:  # valueFrom: keep the user's source; ours goes first through dependent expansion
            env.remove(current)
            env.append({"name": USER_PYTHONPATH_ENV, "valueFrom": current["valueFrom"]})
            env.append({"name": "PYTHONPATH", "value": f"{PYTHON_DIR}:$({USER_PYTHONPATH_ENV})"})
        touched.append("PYTHONPATH")
    return touched


def render(pod: Mapping[str, Any], decision: Decision, defaults: RenderDefaults) -> dict[str, Any]:
    """The injected copy of ``pod``; ``decision`` must say inject."""
    policy, pool_bytes = decision.policy, decision.pool_bytes
    if not decision.inject or policy is None or (pool_bytes is None and not policy.pool.node):
        raise ValueError("render() needs a decision to inject")
    out = copy.deepcopy(dict(pod))
    spec = out.setdefault("spec", {})
    guaranteed = is_guaranteed(spec)  # the user's pod, before anything is added
    inits = []  # after the user's init containers, so theirs (a model download) run first
    if policy.connector.delivery is Delivery.INIT_CONTAINER:
        inits.append(installer_container(policy, defaults, guaranteed))
    grown = None
    if pool_bytes is not None and not policy.pool.node:  # node: the agent's pool, no sidecar
        sidecar = sidecar_container(policy, pool_bytes, defaults, guaranteed)
        inits.append(sidecar)
        grown = grow_pod_level(spec, sidecar["resources"])
    if inits:  # none with a preinstalled connector and node placement
        spec.setdefault("initContainers", []).extend(inits)
    added = [c["name"] for c in inits]
    volumes = _volumes(policy, pool_bytes)
    spec["volumes"] = [*(spec.get("volumes") or []), *volumes]
    vllm = next(c for c in spec["containers"] if c.get("name") == decision.container)
    env = _patch_vllm(vllm, policy, decision.edit)
    meta = out.setdefault("metadata", {})
    status = {
        "policy": policy.name,
        "generation": policy.generation,
        "version": defaults.version,
        "vllmContainer": decision.container,
        "initContainers": added,
        "volumes": [v["name"] for v in volumes],
        "env": env,
    }
    if policy.pool.node:  # only with node: pod-placement status annotations stay as they were
        status |= {
            "placement": policy.pool.placement.value,
            "nodePool": policy.pool.node_pool,
            "tenant": policy.pool.tenant,
        }
    if guaranteed:
        status["qos"] = "Guaranteed"  # kept: the injected containers' limits equal requests
    if grown:
        status["podResources"] = grown  # pod-level quantities grown by the sidecar's
    annotations = meta.setdefault("annotations", {})
    annotations.pop(ann.SKIP_REASON, None)
    annotations[ann.STATUS] = json.dumps(status, sort_keys=True, separators=(",", ":"))
    annotations[ann.POLICY] = policy.name
    annotations[ann.POLICY_GENERATION] = str(policy.generation)
    meta.setdefault("labels", {})[ann.INJECTED_LABEL] = "true"
    return out


def annotate_skip(pod: Mapping[str, Any], reason: SkipReason) -> dict[str, Any]:
    """A copy of ``pod`` carrying the skip reason (when the reason is one to write down)."""
    out = copy.deepcopy(dict(pod))
    if reason.annotated:
        out.setdefault("metadata", {}).setdefault("annotations", {})[ann.SKIP_REASON] = reason.value
    return out
