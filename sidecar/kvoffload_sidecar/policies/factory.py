"""Resolve a policy by name: built-ins by short name (lazily imported), others by module path.

`make_policy("lru", capacity)`, `make_policy("arc", capacity)`, or an out-of-tree class as
`"package.module:ClassName"` taking the capacity (slot count) as its only argument.
"""

from __future__ import annotations

import importlib

from kvoffload_sidecar.policies.base import CachePolicy

__all__ = ["POLICY_NAMES", "make_policy", "resolve_policy"]

_BUILTIN = {
    "lru": "kvoffload_sidecar.policies.lru:LRUPolicy",
    "arc": "kvoffload_sidecar.policies.arc:ARCPolicy",
}
POLICY_NAMES = tuple(_BUILTIN)


def resolve_policy(name: str) -> type:
    """The policy class for `name` (ValueError naming the choices when unknown)."""
    path = _BUILTIN.get(name, name)
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(
            f"unknown eviction policy {name!r}: use one of {', '.join(POLICY_NAMES)} "
            "or 'package.module:ClassName'"
        )
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot load eviction policy {name!r}: {e}") from e
    if not isinstance(cls, type):
        raise ValueError(f"eviction policy {name!r} is not a class")
    return cls


def make_policy(name: str, capacity: int) -> CachePolicy:
    """A new policy instance for a namespace of `capacity` slots."""
    policy = resolve_policy(name)(capacity)
    if not isinstance(policy, CachePolicy):
        raise ValueError(f"eviction policy {name!r} does not implement CachePolicy")
    return policy
