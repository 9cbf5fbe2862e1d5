"""JSON patch = diff(original, mutated) (RFC 6902), as the admission response carries it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jsonpatch


def json_patch(original: Mapping[str, Any], mutated: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The operations that turn ``original`` into ``mutated`` (empty when equal)."""
    return list(jsonpatch.make_patch(dict(original), dict(mutated)).patch)


def apply_patch(original: Mapping[str, Any], ops: list[dict[str, Any]]) -> dict[str, Any]:
    """Apply ``ops`` to a copy of ``original`` (what the API server does with our response)."""
    return dict(jsonpatch.apply_patch(dict(original), ops, in_place=False))
