"""`KVOffloadPolicy` spec → typed, validated `Policy` (pure: no kopf, no Kubernetes client).

`policy_from_resource` applies the CRD's defaults and re-checks its schema bounds (the table of
`policy_limits`) and its CEL rules in Python, so the offline CLI (no API server) rejects exactly
what the API server would, with the same messages (tests/crds/test_policy_offline.py holds it to
that).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from enum import Enum
from typing import Any

from kvoffload_operator.labels import LabelSelector, selector_from_spec
from kvoffload_operator.policy_limits import check_bounds, check_keys
from kvoffload_operator.tenants import TenantSpec, tenants_from_spec

API_GROUP = "kvoffload.io"
API_VERSION = "v1alpha1"
KIND = "KVOffloadPolicy"
PLURAL = "kvoffloadpolicies"

MIB = 1 << 20
HUGEPAGE_BYTES = 2 * MIB
MAX_POOL_BYTES = 4 << 40  # 4Ti: more than any one node's host memory we expect to see
CHUNK_ALIGN = 16  # tokens; vLLM's default block size, so a chunk is whole GPU blocks
MAX_CHUNK_TOKENS = 8192
ALLOWED_CAPABILITIES = ("IPC_LOCK", "SYS_NICE")
DEFAULT_STARTUP_TIMEOUT = 5  # seconds vLLM waits for the sidecar at most (then runs without)
MAX_STARTUP_TIMEOUT = 300


class PolicyError(ValueError):
    """A spec the API server would reject (schema or CEL); the message names the field."""


class Eviction(str, Enum):
    LRU = "lru"
    ARC = "arc"


class Mode(str, Enum):
    EAGER = "eager"
    LAZY = "lazy"


class LoadMode(str, Enum):
    LAYERED = "layered"
    ASYNC = "async"
    ADAPTIVE = "adaptive"  # opt-in: layered while the engine keeps up, async while it queues


class SecurityProfile(str, Enum):
    MINIMAL = "minimal"
    PRIVILEGED = "privileged"


class InjectVia(str, Enum):
    """How the connector config reaches vLLM: ``auto`` where detection says (args, or into the
    ``sh -c`` script); ``args``: appended to the container's args (its script passes ``"$@"``
    to vllm); ``env``: as ``KVOFFLOAD_KV_TRANSFER_CONFIG`` (its script passes that on)."""

    AUTO = "auto"
    ARGS = "args"
    ENV = "env"


class Delivery(str, Enum):
    PREINSTALLED = "preinstalled"
    INIT_CONTAINER = "initContainer"


class Placement(str, Enum):
    """Where the pool is: ``pod``, a sidecar's pool in each pod; ``node``, a tenant of the node
    agent's pool, reached through its CSI volume (docs/NODE.md)."""

    POD = "pod"
    NODE = "node"


@dataclass(frozen=True)
class PoolSpec:
    size: str  # the quantity as written, for messages ("" with placement node and no size)
    size_bytes: int  # 0 with placement node and no size: the node pool's tenant share counts
    eviction: Eviction = Eviction.LRU
    hugepages: bool = False
    numa_node: int | None = None
    placement: Placement = Placement.POD
    node_pool: str | None = None  # placement node: the KVOffloadNodePool's name
    tenant: str | None = None  # placement node: its tenant, asked for in the CSI volume

    @property
    def node(self) -> bool:
        return self.placement is Placement.NODE


@dataclass(frozen=True)
class OffloadSpec:
    mode: Mode = Mode.EAGER
    # tokens per pool slot; None: not injected, so the connector picks one that fits the engine's
    # block size (a value we set could conflict with a --block-size we cannot see)
    chunk_size: int | None = None
    load_mode: LoadMode = LoadMode.LAYERED  # the connector's default too


@dataclass(frozen=True)
class SidecarSpec:
    image: str | None = None  # None: the operator's --sidecar-image
    resources: Mapping[str, Any] = field(default_factory=dict, hash=False)  # merged over sizing
    security_profile: SecurityProfile = SecurityProfile.MINIMAL
    extra_capabilities: tuple[str, ...] = ()
    # the longest vLLM waits for the pool sidecar at pod start (the startup probe's deadline)
    startup_timeout_seconds: int = 5


@dataclass(frozen=True)
class ConnectorSpec:
    # initContainer by default: stock vLLM images carry no kvoffload_connector
    delivery: Delivery = Delivery.INIT_CONTAINER
    image: str | None = None  # None: the operator's --connector-image
    extra_config: Mapping[str, Any] = field(default_factory=dict, hash=False)


@dataclass(frozen=True)
class Policy:
    name: str
    namespace: str
    generation: int
    selector: LabelSelector
    pool: PoolSpec
    offload: OffloadSpec = OffloadSpec()
    sidecar: SidecarSpec = SidecarSpec()
    connector: ConnectorSpec = ConnectorSpec()
    vllm_container: str | None = None
    inject_via: InjectVia = InjectVia.AUTO  # spec.vllmContainer.injectVia
    rollout_enabled: bool = True
    priority: int = 0
    tenants: tuple[TenantSpec, ...] = ()  # per-tenant quotas of the pool (tenants.py)
    spec_hash: str = ""  # policy_hash() of the raw spec; stamped on workload templates


_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]+)?)([KMGTPE]i?|k|m|[eE][0-9]+)?$")
_SUFFIX = {
    "": 1,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
    "Ki": 1 << 10,
    "Mi": 1 << 20,
    "Gi": 1 << 30,
    "Ti": 1 << 40,
    "Pi": 1 << 50,
    "Ei": 1 << 60,
}


def parse_quantity(text: str | int) -> int:
    """A Kubernetes byte quantity (``"64Gi"``, ``"1.5G"``, ``1024``) → whole bytes."""
    if isinstance(text, bool):
        raise PolicyError(f"not a quantity: {text!r}")
    if isinstance(text, int):
        return text
    value = quantity_value(text)
    if value != value.to_integral_value():
        raise PolicyError(f"quantity {text!r} is not a whole number of bytes")
    return int(value)


def quantity_value(text: str | int) -> Decimal:
    """Any Kubernetes quantity (``"250m"`` CPU, ``"64Gi"``) as an exact number."""
    if isinstance(text, bool):
        raise PolicyError(f"not a quantity: {text!r}")
    if isinstance(text, int):
        return Decimal(text)
    m = _QUANTITY.match(str(text).strip())
    if not m:
        raise PolicyError(f"not a quantity: {text!r} (use e.g. 64Gi)")
    number, suffix = m.group(1), m.group(2) or ""
    try:
        if suffix[:1] in ("e", "E") and suffix not in ("E", "Ei"):
            value = Decimal(number) * (Decimal(10) ** int(suffix[1:]))
        elif suffix == "m":
            value = Decimal(number) / 1000
        else:
            value = Decimal(number) * _SUFFIX[suffix]
    except (InvalidOperation, KeyError) as exc:
        raise PolicyError(f"not a quantity: {text!r}") from exc
    return value


def policy_hash(policy: Policy) -> str:
    """Hash of everything that changes injected pods, after defaulting (so a spec written with
    or without its defaults hashes the same); ``rollout``, ``priority`` and names do not count."""
    pool = dataclasses.asdict(policy.pool) | {"size": policy.pool.size_bytes}
    # only with node: hashes of pod-placement policies stay as they were; with node, the size
    # is not used, so writing one rolls nothing
    for key in ("size", "size_bytes") if policy.pool.node else ("placement", "node_pool", "tenant"):
        del pool[key]
    relevant = {
        "selector": dataclasses.asdict(policy.selector),
        "vllmContainer": policy.vllm_container,
        "pool": pool,
        "offload": dataclasses.asdict(policy.offload),
        "sidecar": dataclasses.asdict(policy.sidecar),
        "connector": dataclasses.asdict(policy.connector),
    }
    if policy.tenants:  # only when set: hashes of policies without tenants stay as they were
        relevant["tenants"] = [t.to_json() for t in policy.tenants]
    if policy.inject_via is not InjectVia.AUTO:  # likewise
        relevant["injectVia"] = policy.inject_via.value
    blob = json.dumps(relevant, sort_keys=True, separators=(",", ":"), default=_enum_value)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _enum_value(value: Any) -> Any:
    if isinstance(value, Enum):
        return value.value
    raise TypeError(f"cannot hash {value!r}")


def _enum(cls: type[Enum], value: Any, path: str) -> Any:
    try:
        return cls(value)
    except ValueError:
        allowed = ", ".join(str(m.value) for m in cls)  # type: ignore[attr-defined]
        raise PolicyError(f"{path}: {value!r} is not one of: {allowed}") from None


def _int(value: Any, path: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise PolicyError(f"{path}: must be an integer, got {value!r}")
    if not lo <= value <= hi:
        raise PolicyError(f"{path}: must be between {lo} and {hi}, got {value}")
    return value


_REQUEST_ABOVE_LIMIT = (
    "sidecar.resources: a request must not be above the limit set for the same resource"
)


def _sidecar_resources(value: Any) -> Mapping[str, Any]:
    """``spec.sidecar.resources``: quantities that parse, and no request above the limit the
    policy sets beside it (the API server would refuse every injected pod)."""
    path = "spec.sidecar.resources"
    res = _map(value, path, ("requests", "limits"))
    requests = _map(res.get("requests"), f"{path}.requests")
    limits = _map(res.get("limits"), f"{path}.limits")
    for kind, values in (("requests", requests), ("limits", limits)):
        for name, q in values.items():
            try:
                quantity_value(q)
            except PolicyError as exc:
                raise PolicyError(f"{path}.{kind}.{name}: {exc}") from None
    for name in set(requests) & set(limits):
        if quantity_value(requests[name]) > quantity_value(limits[name]):
            raise PolicyError(
                f"spec.{_REQUEST_ABOVE_LIMIT} (requests.{name} {requests[name]} is above "
                f"limits.{name} {limits[name]})"
            )
    return res


def _map(value: Any, path: str, known: tuple[str, ...] | None = None) -> Mapping[str, Any]:
    """``value`` as a mapping; with ``known``, unknown keys are rejected (as kubectl's strict
    field validation does), so a typo is an error rather than a silently ignored setting."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise PolicyError(f"{path}: must be an object")
    if known is not None:
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise PolicyError(
                f"{path}: unknown field(s) {', '.join(map(repr, unknown))}; "
                f"expected: {', '.join(known)}"
            )
    return value


_SPEC_KEYS = (
    "selector",
    "vllmContainer",
    "pool",
    "offload",
    "sidecar",
    "connector",
    "rollout",
    "priority",
    "tenants",
)
# the CRD's pattern for spec.pool.size (a subset of quantities: no milli, no exponents)
_SIZE_PATTERN = re.compile(r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$")
_POOL_KEYS = ("placement", "nodePool", "tenant", "size", "eviction", "hugepages", "numaNode")


def pool_from_spec(raw: Mapping[str, Any]) -> PoolSpec:
    """``spec.pool`` → `PoolSpec`; the same checks as the CRD's CEL rules."""
    placement = _enum(Placement, raw.get("placement", "pod"), "spec.pool.placement")
    eviction = _enum(Eviction, raw.get("eviction", "lru"), "spec.pool.eviction")
    node_pool, tenant = raw.get("nodePool"), raw.get("tenant")
    for key, value in (("nodePool", node_pool), ("tenant", tenant)):
        if value is not None and not isinstance(value, str):
            raise PolicyError(f"spec.pool.{key}: must be a string, got {value!r}")
    if placement is Placement.NODE:
        if node_pool is None or tenant is None:
            raise PolicyError("spec.pool.nodePool and pool.tenant are required with placement node")
        if (
            raw.get("hugepages", False)
            or raw.get("numaNode") is not None
            or eviction is Eviction.ARC
        ):
            raise PolicyError(
                "spec.pool.hugepages, pool.numaNode and pool.eviction arc are for placement pod "
                "(with node, the node agent owns the pool's memory)"
            )
        if "size" not in raw:  # the node pool's tenant share is the memory: size is not used
            return PoolSpec(
                size="", size_bytes=0, placement=placement, node_pool=node_pool, tenant=tenant
            )
    elif node_pool is not None or tenant is not None:
        raise PolicyError("spec.pool.nodePool and pool.tenant are used only with placement node")
    if "size" not in raw:
        raise PolicyError("spec.pool.size is required with placement pod (e.g. 64Gi)")
    size = raw["size"]
    if not isinstance(size, str) or not _SIZE_PATTERN.match(size):
        raise PolicyError(
            f"spec.pool.size: {size!r} should match {_SIZE_PATTERN.pattern!r} "
            "(a quantity string such as 64Gi)"
        )
    value = quantity_value(size)
    if value != value.to_integral_value():
        raise PolicyError("spec.pool.size must be a whole number of bytes")
    size_bytes = int(value)
    if size_bytes <= 0:
        raise PolicyError("spec.pool.size must be greater than 0")
    if size_bytes > MAX_POOL_BYTES:
        raise PolicyError("spec.pool.size must be at most 4Ti")
    hugepages = bool(raw.get("hugepages", False))
    if hugepages and size_bytes % HUGEPAGE_BYTES:
        raise PolicyError("spec.pool.size must be a multiple of 2Mi when hugepages is true")
    numa = raw.get("numaNode")
    return PoolSpec(
        size=str(size),
        size_bytes=size_bytes,
        eviction=eviction,
        hugepages=hugepages,
        numa_node=None if numa is None else _int(numa, "spec.pool.numaNode", 0, 1023),
        placement=placement,
        node_pool=node_pool,
        tenant=tenant,
    )


_OFFLOAD_KEYS = ("mode", "chunkSize", "loadMode")
_VLLM_KEYS = ("name", "injectVia")


def _offload(raw: Mapping[str, Any]) -> OffloadSpec:
    chunk = raw.get("chunkSize")
    if chunk is not None:
        chunk = _int(chunk, "spec.offload.chunkSize", CHUNK_ALIGN, MAX_CHUNK_TOKENS)
    if chunk is not None and chunk % CHUNK_ALIGN:
        raise PolicyError("spec.offload.chunkSize must be a multiple of 16 tokens")
    return OffloadSpec(
        mode=_enum(Mode, raw.get("mode", "eager"), "spec.offload.mode"),
        chunk_size=chunk,
        load_mode=_enum(LoadMode, raw.get("loadMode", "layered"), "spec.offload.loadMode"),
    )


def _sidecar(raw: Mapping[str, Any]) -> SidecarSpec:
    profile = _enum(
        SecurityProfile, raw.get("securityProfile", "minimal"), "spec.sidecar.securityProfile"
    )
    caps = tuple(raw.get("extraCapabilities") or ())
    for cap in caps:
        if cap not in ALLOWED_CAPABILITIES:
            raise PolicyError(
                f"spec.sidecar.extraCapabilities: {cap!r} is not one of: "
                + ", ".join(ALLOWED_CAPABILITIES)
            )
    if len(set(caps)) != len(caps):
        raise PolicyError("spec.sidecar.extraCapabilities: must not repeat a capability")
    if caps and profile is SecurityProfile.PRIVILEGED:
        raise PolicyError(
            "spec.sidecar.extraCapabilities is redundant with securityProfile "
            "privileged (a privileged container has every capability)"
        )
    return SidecarSpec(
        image=raw.get("image") or None,
        resources=_sidecar_resources(raw.get("resources")),
        security_profile=profile,
        extra_capabilities=caps,
        startup_timeout_seconds=_int(
            raw.get("startupTimeoutSeconds", DEFAULT_STARTUP_TIMEOUT),
            "spec.sidecar.startupTimeoutSeconds",
            1,
            MAX_STARTUP_TIMEOUT,
        ),
    )


def _connector(raw: Mapping[str, Any]) -> ConnectorSpec:
    extra = _map(raw.get("extraConfig"), "spec.connector.extraConfig")
    reserved = sorted(set(extra) & {"socket", "chunk_size", "mode", "load_mode", "placement"})
    if reserved:
        raise PolicyError(
            "spec.connector.extraConfig must not set socket, chunk_size, mode, load_mode or "
            f"placement (they come from the policy): {', '.join(reserved)}"
        )
    delivery = _enum(Delivery, raw.get("delivery", "initContainer"), "spec.connector.delivery")
    if raw.get("image") and delivery is not Delivery.INIT_CONTAINER:
        raise PolicyError(
            "spec.connector: connector.image is used only with delivery initContainer"
        )
    for key, value in extra.items():
        if not isinstance(value, str):
            raise PolicyError(f"spec.connector.extraConfig.{key}: must be a string, got {value!r}")
    return ConnectorSpec(delivery=delivery, image=raw.get("image") or None, extra_config=extra)


_NODE_SIDECAR = (
    "spec.sidecar.image, sidecar.resources, sidecar.extraCapabilities and securityProfile "
    "privileged are for placement pod (placement node injects no pool sidecar)"
)
_NODE_TENANTS = (
    "spec.tenants are for placement pod (with placement node, the node pool's tenant is the "
    "pods' share)"
)


def _check_node_placement(spec: Mapping[str, Any], pool: PoolSpec) -> None:
    """The CRD's rules on ``spec`` for placement node: nothing that only a sidecar would use."""
    if not pool.node:
        return
    sidecar = _map(spec.get("sidecar"), "spec.sidecar")
    if (
        sidecar.get("image")
        or "resources" in sidecar
        or sidecar.get("extraCapabilities")
        or sidecar.get("securityProfile") == SecurityProfile.PRIVILEGED.value
    ):
        raise PolicyError(_NODE_SIDECAR)
    if spec.get("tenants"):
        raise PolicyError(_NODE_TENANTS)


def policy_from_resource(obj: Mapping[str, Any]) -> Policy:
    """A whole ``KVOffloadPolicy`` object (as read from YAML or the API) → `Policy`.

    Raises `PolicyError` for anything the CRD's schema or CEL rules reject.
    """
    if obj.get("kind", KIND) != KIND:
        raise PolicyError(f"kind: expected {KIND}, got {obj.get('kind')!r}")
    meta = _map(obj.get("metadata"), "metadata")
    if not meta.get("name"):
        raise PolicyError("metadata.name: required")
    spec = _map(obj.get("spec"), "spec", _SPEC_KEYS)
    check_bounds(spec, PolicyError)  # the schema's bounds first: the API server's order
    check_keys(spec, PolicyError)
    if "pool" not in spec:
        raise PolicyError("spec.pool: required")
    if "selector" not in spec:
        raise PolicyError("spec.selector: required (use {} to match every pod)")
    selector = selector_from_spec(spec["selector"], "spec.selector", PolicyError)
    pool = pool_from_spec(_map(spec["pool"], "spec.pool", _POOL_KEYS))
    policy = Policy(
        name=str(meta["name"]),
        namespace=str(meta.get("namespace") or "default"),
        generation=int(meta.get("generation") or 1),
        selector=selector,
        pool=pool,
        offload=_offload(_map(spec.get("offload"), "spec.offload", _OFFLOAD_KEYS)),
        sidecar=_sidecar(
            _map(
                spec.get("sidecar"),
                "spec.sidecar",
                (
                    "image",
                    "resources",
                    "securityProfile",
                    "extraCapabilities",
                    "startupTimeoutSeconds",
                ),
            )
        ),
        connector=_connector(
            _map(spec.get("connector"), "spec.connector", ("delivery", "image", "extraConfig"))
        ),
        vllm_container=_map(spec.get("vllmContainer"), "spec.vllmContainer", _VLLM_KEYS).get("name")
        or None,
        inject_via=_enum(
            InjectVia,
            _map(spec.get("vllmContainer"), "spec.vllmContainer").get("injectVia", "auto"),
            "spec.vllmContainer.injectVia",
        ),
        rollout_enabled=bool(
            _map(spec.get("rollout"), "spec.rollout", ("enabled",)).get("enabled", True)
        ),
        priority=_int(spec.get("priority", 0), "spec.priority", -1000, 1000),
        tenants=tenants_from_spec(spec.get("tenants"), PolicyError),
    )
    _check_node_placement(spec, pool)
    return dataclasses.replace(policy, spec_hash=policy_hash(policy))


def policies_from_documents(docs: Sequence[Mapping[str, Any]]) -> list[Policy]:
    """All ``KVOffloadPolicy`` documents of a YAML stream (other kinds are ignored)."""
    return [policy_from_resource(d) for d in docs if d and d.get("kind") == KIND]
