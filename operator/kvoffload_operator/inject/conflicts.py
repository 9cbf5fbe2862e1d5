"""What in a pod conflicts with kvoffload (pure): another KV connector, KV offloading or KV cache
(args, shell text, env), a ``--config`` file the spec does not carry, kvoffload wired by hand,
an engine whose other ranks run in other pods (multi-node: pool regions are per pod), and a
name, path or port of the pod's own that the injection would add again (`clashes`)."""

from __future__ import annotations

import posixpath
import re
from collections.abc import Mapping
from typing import Any

from kvoffload_operator.inject import shell
from kvoffload_operator.inject.container import (
    argv,
    config_texts,
    env_names,
    env_values,
    shell_script,
    who_of,
)
from kvoffload_operator.inject.reserved import (
    GRPC_PORT,
    KVOFFLOAD_DIR,
    METRICS_PORT,
    NODE_DIR,
    NODE_DRIVER,
    reserved,
)
from kvoffload_operator.inject.site import Problem, Site
from kvoffload_operator.policy import Policy

LWS_SIZE_ANNOTATION = "leaderworkerset.sigs.k8s.io/size"
RAY_NODE_TYPE_LABEL = "ray.io/node-type"

# flags, and their keys in a --config YAML file the script writes (``kv-transfer-config: ...``)
_KV_TRANSFER_RE = re.compile(
    r"--kv[-_]transfer[-_]config(?![\w-])|\bkv_connector\b|--kv-connector"
    r"|(?<![\w-])kv[-_]transfer[-_]config\s*:"
)
_KV_OFFLOAD_RE = re.compile(
    r"--kv[-_]offloading[-_](?:size|backend)(?![\w-])|(?<![\w-])kv[-_]offloading[-_]size\s*:"
)
_CONFIG_RE = re.compile(r"(?<![\w-])--config(?:=|\s+)(['\"]?)([^\s'\";&|]+)\1")
_KVOFFLOAD_RE = re.compile(r"kvoffload_connector|KVOffloadConnector")
_MULTI_NODE_RE = re.compile(
    r"LWS_GROUP_SIZE|ray_cluster_size|multi-node-serving\.sh|\bray\s+start\b[^\n;&|]*--address"
)
_NNODES_RE = re.compile(r"--nnodes[=\s]+(\d+)")
_FALSY = frozenset({"", "0", "false", "no", "off"})

# Environment that turns on another stack's KV cache or KV transfer (each with its source):
# (name or prefix, whether a prefix, whether only a truthy value counts, what it is)
OTHER_KV_ENV: tuple[tuple[str, bool, bool, str], ...] = (
    # AIBrix's vLLM fork: Vineyard KV cache (samples/kvcache/vineyard in vllm-project/aibrix)
    ("VLLM_USE_VINEYARD_CACHE", False, True, "AIBrix's Vineyard KV cache"),
    ("VINEYARD_CACHE_", True, False, "AIBrix's Vineyard KV cache"),
    ("AIBRIX_LLM_KV_CACHE", True, False, "AIBrix's distributed KV cache"),
    # AIBrix KV cache offloading framework (python/aibrix_kvcache: AIBRIX_KV_CACHE_OL_*)
    ("AIBRIX_KV_CACHE_OL_", True, False, "AIBrix's KV cache offloading"),
    # LMCache's configuration by environment (LMCACHE_LOCAL_CPU, LMCACHE_CONFIG_FILE, ...)
    ("LMCACHE_", True, False, "LMCache's KV cache"),
    # NVIDIA Dynamo's KV block manager (DYN_KVBM_CPU_CACHE_GB, DYN_KVBM_DISK_CACHE_GB)
    ("DYN_KVBM_", True, False, "Dynamo's KV block manager (KVBM)"),
    # vLLM's NixlConnector side channel (vllm/envs.py), set by llm-d's P/D pods
    ("VLLM_NIXL_SIDE_CHANNEL_", True, False, "vLLM's NIXL KV transfer"),
    # Mooncake's transfer engine and store (vllm/envs.py VLLM_MOONCAKE_*, MOONCAKE_CONFIG_PATH)
    ("VLLM_MOONCAKE_", True, False, "Mooncake KV transfer"),
    ("MOONCAKE_", True, False, "Mooncake KV transfer"),
)
# LMCACHE_* names that configure nothing by themselves (KServe's huggingfaceserver runtime sets
# LMCACHE_USE_EXPERIMENTAL on every pod; LMCache runs only once a connector loads it)
NEUTRAL_ENV = frozenset({"LMCACHE_USE_EXPERIMENTAL", "LMCACHE_LOG_LEVEL", "LMCACHE_TRACK_USAGE"})


def other_kv_env(container: Mapping[str, Any]) -> Site | None:
    """A skip when the environment turns on another stack's KV cache (`OTHER_KV_ENV`)."""
    values = env_values(container)
    for name in env_names(container):
        if name in NEUTRAL_ENV:
            continue
        for key, prefix, truthy, what in OTHER_KV_ENV:
            if not (name.startswith(key) if prefix else name == key):
                continue
            if truthy and values.get(name, "1").strip().lower() in _FALSY:
                continue
            return Site(
                False,
                problem=Problem.OTHER_KV_CACHE,
                message=f"{who_of(container)} sets {name} ({what}): kvoffload beside another KV "
                "cache would keep the same blocks twice and fight over loads",
            )
    return None


def conflicts(container: Mapping[str, Any]) -> Site | None:
    """A skip when the container already configures KV transfer, offloading or another KV
    cache (args, shell text or env), else None: two connectors, or ours beside vLLM's own
    offloading, would fight."""
    who = who_of(container)
    env = env_values(container)
    texts = config_texts(container)
    for pattern, problem, what in (
        (_KV_TRANSFER_RE, Problem.HAS_KV_TRANSFER_CONFIG, "already configures a KV connector"),
        (_KV_OFFLOAD_RE, Problem.HAS_KV_OFFLOADING, "already uses vLLM's KV offloading"),
    ):
        for text in texts:
            m = pattern.search(text)
            if m:
                return Site(False, problem=problem, message=f"{who} {what} ({m.group(0)})")
    simple = env.get("VLLM_USE_SIMPLE_KV_OFFLOAD")
    if simple is not None and simple.strip().lower() not in _FALSY:
        return Site(
            False,
            problem=Problem.HAS_KV_OFFLOADING,
            message=f"{who} sets VLLM_USE_SIMPLE_KV_OFFLOAD={simple}",
        )
    connector_env = sorted(
        k for k in env_names(container) if "KV_CONNECTOR" in k or "KV_TRANSFER" in k
    )
    if connector_env:
        return Site(
            False,
            problem=Problem.HAS_KV_TRANSFER_CONFIG,
            message=f"{who} sets {connector_env[0]}",
        )
    return other_kv_env(container)


def _config_path(container: Mapping[str, Any]) -> tuple[str, str] | None:
    """(path, the text it was found in) of vLLM's ``--config FILE``, or None."""
    words = argv(container)
    script = shell_script(container)
    if script is not None:
        text = shell.blank_reads(words[script])
        m = _CONFIG_RE.search(text)
        if m:
            return m.group(2), text
        words = words[script + 2 :]  # the script's arguments, which `exec "$@"` runs
    for i, w in enumerate(words):
        if w == "--config" and i + 1 < len(words):
            return words[i + 1], ""
        if w.startswith("--config="):
            return w.split("=", 1)[1], ""
    return None


def config_file(container: Mapping[str, Any]) -> Site | None:
    """A skip when vLLM reads a ``--config`` YAML file the pod spec does not carry: it may set
    ``kv-transfer-config`` or ``kv-offloading-*``, and a flag on the command line would silently
    replace what it says (vLLM: command line > config file > defaults). A file the script
    writes itself was read with the script (`conflicts`)."""
    found = _config_path(container)
    if found is None:
        return None
    path, text = found
    if text and re.search(rf"(?:>\s*|\btee\s+(?:-a\s+)?){re.escape(path)}", text):
        return None
    return Site(
        False,
        problem=Problem.CONFIG_FILE,
        message=f"{who_of(container)} starts vLLM with --config {path}, a file not in the pod "
        "spec (a ConfigMap?): it may already set kv-transfer-config or kv-offloading, which "
        "a flag on the command line would silently replace. If it sets neither, set "
        "kvoffload.io/inject-via: args",
    )


def hand_wired(pod: Mapping[str, Any], container: Mapping[str, Any] | None) -> Site | None:
    """A skip when the pod already runs kvoffload without the injector (README: ``kvoffload
    sidecar`` beside vLLM, the connector configured by flag, env or ``--config``): a second
    sidecar and the same mount paths twice would make the API server reject the pod."""
    spec = pod.get("spec") or {}
    for c in (spec.get("initContainers") or []) + (spec.get("containers") or []):
        words = argv(c)
        image = str(c.get("image", "")).split("@")[0].rsplit(":", 1)[0]
        runs_sidecar = any(
            posixpath.basename(w) == "kvoffload" and words[i + 1 : i + 2] == ["sidecar"]
            for i, w in enumerate(words)
        )
        if runs_sidecar or image.endswith("/kvoffload") or image == "kvoffload":
            return Site(
                False,
                problem=Problem.HAND_WIRED,
                message=f"{who_of(c)} already runs the kvoffload sidecar "
                f"({' '.join(words[:2]) or image}): the pod wires kvoffload by hand",
            )
    for v in spec.get("volumes") or []:
        csi = v.get("csi") if isinstance(v, Mapping) else None
        if isinstance(csi, Mapping) and csi.get("driver") == NODE_DRIVER:
            return Site(
                False,
                problem=Problem.HAND_WIRED,
                message=f"volume {v.get('name')!r} is already the kvoffload node agent's "
                f"({NODE_DRIVER}): the pod wires kvoffload by hand",
            )
    targets = [container] if container is not None else list(spec.get("containers") or [])
    for c in targets:
        for mount in c.get("volumeMounts") or []:
            path = posixpath.normpath(str(mount.get("mountPath", "")))
            if any(path == d or path.startswith(d + "/") for d in (KVOFFLOAD_DIR, NODE_DIR)):
                return Site(
                    False,
                    problem=Problem.HAND_WIRED,
                    message=f"{who_of(c)} already mounts {path}: the pod wires kvoffload by hand",
                )
        for text in config_texts(c):
            m = _KVOFFLOAD_RE.search(text)
            if m:
                return Site(
                    False,
                    problem=Problem.HAND_WIRED,
                    message=f"{who_of(c)} already configures {m.group(0)}: the pod wires "
                    "kvoffload by hand",
                )
    return None


def multi_node(
    pod: Mapping[str, Any], container: Mapping[str, Any], group_size: int | None
) -> Site | None:
    """A skip when the engine's other ranks run in other pods (LeaderWorkerSet groups, Ray
    clusters): pool regions are per pod, so ranks elsewhere could never share this pod's pool."""
    meta = pod.get("metadata") or {}
    size = group_size
    raw = (meta.get("annotations") or {}).get(LWS_SIZE_ANNOTATION)
    if size is None and raw is not None and str(raw).isdigit():
        size = int(raw)
    env_size = env_values(container).get("LWS_GROUP_SIZE", "")
    if size is None and env_size.isdigit():
        size = int(env_size)
    why = None
    if size is not None and size > 1:
        why = f"a group of {size} pods (LeaderWorkerSet)"
    elif (meta.get("labels") or {}).get(RAY_NODE_TYPE_LABEL):
        why = "a Ray cluster node (label ray.io/node-type)"
    else:
        text = "\n".join(config_texts(container)[: len(argv(container))])
        m = _MULTI_NODE_RE.search(text)
        nnodes = _NNODES_RE.search(text)
        if m:
            why = f"a multi-node launcher ({m.group(0)})"
        elif nnodes and int(nnodes.group(1)) > 1:
            why = f"--nnodes {nnodes.group(1)}"
    if why is None:
        return None
    return Site(
        False,
        problem=Problem.MULTI_NODE,
        message=f"{who_of(container)} is part of {why}: the engine's other ranks run in other "
        "pods, and pool regions are per pod",
    )


_PORTS = (GRPC_PORT, METRICS_PORT)
_PORT_FLAG_RE = re.compile(
    r"(?<![\w-])(?:-{1,2}[\w.-]*port[\w.-]*(?:=|\s+)['\"]?"
    r"|-{1,2}[\w.-]*(?:listen|bind|addr|address)[\w.-]*=['\"]?(?:0\.0\.0\.0|\[::\])?:)"
    rf"({GRPC_PORT}|{METRICS_PORT})(?!\d)",
    re.IGNORECASE,
)
_PORT_ENV_RE = re.compile(r"(?:^|_)PORT(?:_|$)")


def _containers(spec: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    return [
        (kind, c)
        for kind in ("initContainers", "containers", "ephemeralContainers")
        for c in spec.get(kind) or []
        if isinstance(c, Mapping)
    ]


def _beside_the_sidecar(spec: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """Containers running while the sidecar does: the native sidecars (a plain init container
    has exited before ours starts, appended after them) and the app containers."""
    return [
        c
        for kind, c in _containers(spec)
        if kind == "containers" or (kind == "initContainers" and c.get("restartPolicy") == "Always")
    ]


def _binds(container: Mapping[str, Any]) -> str | None:
    """How ``container`` would bind a port of the sidecar's, or None."""
    for port in container.get("ports") or []:
        if isinstance(port, Mapping) and port.get("containerPort") in _PORTS:
            return f"declares containerPort {port['containerPort']}"
    m = _PORT_FLAG_RE.search(" ".join(config_texts(container)))
    if m:
        return f"binds {m.group(0)}"
    for name, value in env_values(container).items():
        if _PORT_ENV_RE.search(name.upper()) and value.strip() in {str(p) for p in _PORTS}:
            return f"sets {name}={value.strip()}"
    return None


def clashes(pod: Mapping[str, Any], container: Mapping[str, Any], policy: Policy) -> Site | None:
    """A skip when the pod already has a name, path or port that ``policy``'s rendering adds
    (`reserved`): a second container or volume of one name, or a mount where the vLLM container
    has a device, the API server refuses; a second listener on the sidecar's port fails. A
    container of ours in a pod the injector did not record (no status annotation) that runs
    kvoffload is `hand_wired`, found first."""
    spec = pod.get("spec") or {}
    ours = reserved(policy)
    for kind, c in _containers(spec):
        if c.get("name") in ours.containers:
            what = " ".join(argv(c)[:2]) or f"image {c.get('image', '?')}"
            return Site(
                False,
                problem=Problem.NAME_CLASH,
                message=f"container {c['name']!r} ({kind[:-1]}, running {what}) has a name "
                "kvoffload adds, but the injector did not add it (the pod carries no "
                "kvoffload.io/status): the API server would refuse two containers of one name. "
                "Rename it to inject",
            )
    for v in spec.get("volumes") or []:
        if isinstance(v, Mapping) and v.get("name") in ours.volumes:
            return Site(
                False,
                problem=Problem.NAME_CLASH,
                message=f"the pod already has a volume {v['name']!r}, a name kvoffload adds: the "
                "API server would refuse two volumes of one name. Rename it to inject",
            )
    who = who_of(container)
    for name in env_names(container):
        if name in ours.env:
            return Site(
                False,
                problem=Problem.NAME_CLASH,
                message=f"{who} already sets env {name}, a name kvoffload adds. Rename it to "
                "inject",
            )
    for device in container.get("volumeDevices") or []:
        path = posixpath.normpath(str(device.get("devicePath", "")))
        for mount in ours.paths:
            if path == mount or mount.startswith(path + "/") or path.startswith(mount + "/"):
                return Site(
                    False,
                    problem=Problem.PATH_CLASH,
                    message=f"{who} has a volumeDevice at {path}, where kvoffload mounts "
                    f"{mount}: the API server refuses a device and a mount at one path, and "
                    "a mount cannot go under a device. Move the device to inject",
                )
    if ours.ports:
        for c in _beside_the_sidecar(spec):
            how = _binds(c)
            if how is not None:
                return Site(
                    False,
                    problem=Problem.PORT_CLASH,
                    message=f"{who_of(c)} {how}, a port kvoffload's sidecar binds on the pod's "
                    f"IP ({GRPC_PORT} gRPC health, {METRICS_PORT} metrics): one of the two "
                    "would fail to start. Move it to another port to inject",
                )
    return None
