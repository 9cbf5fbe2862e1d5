"""The bounds the `KVOffloadPolicy` CRD's schema puts on ``spec`` and the grammars of its CEL
rules on map keys, checked in Python so that the offline CLI refuses what the API server would.

A table rather than the CRD read at run time: the CRD is not part of the installed package
(``crds/`` and the chart hold it) and the webhook should not parse 600 lines of YAML to admit a
pod. The CRD stays the one source: tests/crds/test_policy_offline.py fails unless `BOUNDS`
equals the schema's keywords under ``spec``, field by field. Patterns are matched whole
(`re.fullmatch`), as the API server's Go regexp matches ``^...$`` (Python's ``$`` alone would
also match before a trailing newline).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

Error = Callable[[str], Exception]


@dataclass(frozen=True)
class Bound:
    """One schema node's limits (the CRD's keyword names, in snake case)."""

    min_length: int | None = None
    max_length: int | None = None
    pattern: str | None = None
    max_items: int | None = None
    max_properties: int | None = None
    minimum: int | None = None
    maximum: int | None = None
    _regex: re.Pattern[str] | None = field(default=None, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.pattern is not None:
            object.__setattr__(self, "_regex", re.compile(self.pattern))

    def check(self, value: Any, where: str, error: Error) -> None:
        """Raise ``error(message)`` naming ``where`` and the limit ``value`` breaks."""
        if isinstance(value, str):
            if self.min_length is not None and len(value) < self.min_length:
                raise error(f"{where}: {value!r} should be non-empty (at least {self.min_length})")
            if self.max_length is not None and len(value) > self.max_length:
                raise error(f"{where}: {value!r} is too long (at most {self.max_length})")
            if self._regex is not None and not self._regex.fullmatch(value):
                raise error(f"{where}: {value!r} does not match '{self.pattern}'")
        elif isinstance(value, int) and not isinstance(value, bool):
            if self.minimum is not None and value < self.minimum:
                raise error(f"{where}: {value} is less than the minimum of {self.minimum}")
            if self.maximum is not None and value > self.maximum:
                raise error(f"{where}: {value} is greater than the maximum of {self.maximum}")
        elif isinstance(value, list) and len(value) > (self.max_items or len(value)):
            raise error(f"{where}: {len(value)} items is too many (at most {self.max_items})")
        elif isinstance(value, Mapping) and len(value) > (self.max_properties or len(value)):
            raise error(
                f"{where}: {len(value)} keys is too many properties (at most {self.max_properties})"
            )


LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
_DNS = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
# Kubernetes object names: a DNS-1123 label (63 at most) and a DNS-1123 subdomain (253)
DNS_LABEL = rf"^{_DNS}$"
DNS_SUBDOMAIN = rf"^{_DNS}(\.{_DNS})*$"
# a qualified name with an optional DNS-subdomain prefix: label keys and resource names
QUALIFIED_NAME = rf"^({_DNS}(\.{_DNS})*/)?[A-Za-z0-9]([-A-Za-z0-9_.]{{0,61}}[A-Za-z0-9])?$"
PREFIX_AT_MOST_253 = r"^([^/]{1,253}/)?[^/]+$"
_HOST = r"[a-zA-Z0-9]([-a-zA-Z0-9]*[a-zA-Z0-9])?(\.[a-zA-Z0-9]([-a-zA-Z0-9]*[a-zA-Z0-9])?)*"
_PATH = r"[a-z0-9]+(([._]|__|-+)[a-z0-9]+)*"
IMAGE = (
    rf"^((({_HOST}|\[[0-9a-fA-F:]+\])(:[0-9]{{1,5}})?/)?{_PATH}(/{_PATH})*"
    r"(:[A-Za-z0-9_][-A-Za-z0-9_.]{0,127})?"
    r"(@[A-Za-z][A-Za-z0-9]*([-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,})?)?$"
)
_RESOURCE = Bound(
    max_length=32,
    pattern=r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E|m|[eE][0-9]{1,2})?$",
    minimum=0,
    maximum=10**15,
)
_PERCENT = Bound(max_length=7, pattern=r"^([0-9]{1,2}(\.[0-9]{1,2})?|100)%$")

# field path ('.key', '.*' for any key of a map, '[]' for any item) -> its bounds
BOUNDS: dict[str, Bound] = {
    "spec.selector.matchLabels": Bound(max_properties=64),
    "spec.selector.matchLabels.*": Bound(max_length=63, pattern=LABEL_VALUE),
    "spec.selector.matchExpressions": Bound(max_items=32),
    "spec.selector.matchExpressions[].key": Bound(
        min_length=1, max_length=317, pattern=QUALIFIED_NAME
    ),
    "spec.selector.matchExpressions[].values": Bound(max_items=64),
    "spec.selector.matchExpressions[].values[]": Bound(max_length=63, pattern=LABEL_VALUE),
    "spec.vllmContainer.name": Bound(max_length=63, pattern=r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?)?$"),
    "spec.pool.size": Bound(
        max_length=32, pattern=r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$"
    ),
    "spec.pool.numaNode": Bound(minimum=0, maximum=1023),
    "spec.pool.nodePool": Bound(max_length=253, pattern=DNS_SUBDOMAIN),
    "spec.pool.tenant": Bound(max_length=63, pattern=DNS_LABEL),
    "spec.offload.chunkSize": Bound(minimum=16, maximum=8192),
    "spec.sidecar.image": Bound(max_length=512, pattern=IMAGE),
    "spec.sidecar.resources.requests": Bound(max_properties=16),
    "spec.sidecar.resources.requests.*": _RESOURCE,
    "spec.sidecar.resources.limits": Bound(max_properties=16),
    "spec.sidecar.resources.limits.*": _RESOURCE,
    "spec.sidecar.startupTimeoutSeconds": Bound(minimum=1, maximum=300),
    "spec.sidecar.extraCapabilities": Bound(max_items=2),
    "spec.connector.image": Bound(max_length=512, pattern=IMAGE),
    "spec.connector.extraConfig": Bound(max_properties=32),
    "spec.connector.extraConfig.*": Bound(max_length=256, pattern=r"^[^\x00-\x1f\x7f]*$"),
    "spec.tenants": Bound(max_items=16),
    "spec.tenants[].name": Bound(
        min_length=1, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9_]*[a-z0-9])?$"
    ),
    "spec.tenants[].cacheSalts": Bound(max_items=16),
    "spec.tenants[].cacheSalts[]": Bound(
        min_length=1, max_length=128, pattern=r"^[^\x00-\x1f\x7f]+$"
    ),
    "spec.tenants[].guaranteed": _PERCENT,
    "spec.tenants[].max": _PERCENT,
    "spec.priority": Bound(minimum=-1000, maximum=1000),
}
# every path of BOUNDS and every path above one: where the walk goes on
_PREFIXES = frozenset(p[:i] for p in BOUNDS for i, ch in enumerate(p + ".") if ch in ".[")


def check_bounds(spec: Any, error: Error) -> None:
    """Raise ``error(message)`` for the first value of ``spec`` outside its CRD bounds (values
    of the wrong type are left to the typed parse, which names the type it wants)."""
    _walk(spec, "spec", "spec", error)


def _walk(value: Any, path: str, where: str, error: Error) -> None:
    bound = BOUNDS.get(path)
    if bound is not None:
        bound.check(value, where, error)
    if isinstance(value, Mapping):
        for key, sub in value.items():
            child = next((c for c in (f"{path}.{key}", f"{path}.*") if c in _PREFIXES), None)
            if child is not None:
                _walk(sub, child, f"{where}.{key}", error)
    elif isinstance(value, list) and f"{path}[]" in _PREFIXES:
        for i, item in enumerate(value):
            _walk(item, f"{path}[]", f"{where}[{i}]", error)


# The CRD's CEL rules on map keys: (grammar as a predicate, the rule's message).
def _label_key(key: str) -> bool:
    return (
        len(key) <= 317
        and re.fullmatch(QUALIFIED_NAME, key) is not None
        and re.fullmatch(PREFIX_AT_MOST_253, key) is not None
    )


def _resource_name(key: str) -> bool:
    return len(key) <= 317 and re.fullmatch(QUALIFIED_NAME, key) is not None


def _setting_name(key: str) -> bool:
    return len(key) <= 63 and re.fullmatch(r"^[A-Za-z_][A-Za-z0-9_]*$", key) is not None


_RESOURCE_KEYS = "every key must be a resource name (e.g. cpu, memory, ephemeral-storage, hugepages-2Mi, example.com/device)"  # noqa: E501
KEY_RULES: dict[str, tuple[Callable[[str], bool], str]] = {
    "spec.selector.matchLabels": (
        _label_key,
        "selector.matchLabels: every key must be a label key (an optional DNS subdomain prefix "
        "of at most 253 characters and '/', then a name of at most 63 letters, digits, '-', '_' "
        "or '.')",
    ),
    "spec.sidecar.resources.requests": (
        _resource_name,
        f"sidecar.resources.requests: {_RESOURCE_KEYS}",
    ),
    "spec.sidecar.resources.limits": (
        _resource_name,
        f"sidecar.resources.limits: {_RESOURCE_KEYS}",
    ),
    "spec.connector.extraConfig": (
        _setting_name,
        "connector.extraConfig: every key must be a connector setting name (letters, digits "
        "and '_', at most 63)",
    ),
}
EXPRESSION_KEY_PREFIX = (
    "selector.matchExpressions: a label key's prefix (before '/') must be at most 253 characters"
)


def check_keys(spec: Mapping[str, Any], error: Error) -> None:
    """The CEL rules on keys of ``spec``'s maps and on matchExpressions' keys."""
    for path, (ok, message) in KEY_RULES.items():
        node: Any = spec
        for part in path.split(".")[1:]:
            node = node.get(part) if isinstance(node, Mapping) else None
        if isinstance(node, Mapping) and not all(isinstance(k, str) and ok(k) for k in node):
            raise error(f"spec.{message}")
    selector = spec.get("selector")
    exprs = selector.get("matchExpressions") if isinstance(selector, Mapping) else None
    for expr in exprs if isinstance(exprs, list) else ():
        key = expr.get("key") if isinstance(expr, Mapping) else None
        if isinstance(key, str) and not re.fullmatch(PREFIX_AT_MOST_253, key):
            raise error(f"spec.{EXPRESSION_KEY_PREFIX}")
