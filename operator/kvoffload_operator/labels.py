"""Kubernetes label selectors (pure): parsed from a spec, matched against labels.

A module of its own so that `policy` (which parses selectors) and `selection` (which picks the
winning `Policy`) share these types without importing each other.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

_OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist")


@dataclass(frozen=True)
class Requirement:
    key: str
    operator: str
    values: tuple[str, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        if self.operator == "In":
            return self.key in labels and labels[self.key] in self.values
        if self.operator == "NotIn":
            return self.key not in labels or labels[self.key] not in self.values
        if self.operator == "Exists":
            return self.key in labels
        return self.key not in labels  # DoesNotExist


@dataclass(frozen=True)
class LabelSelector:
    """A ``metav1.LabelSelector``; empty selects everything (as in Kubernetes)."""

    match_labels: tuple[tuple[str, str], ...] = ()
    match_expressions: tuple[Requirement, ...] = ()

    def matches(self, labels: Mapping[str, str] | None) -> bool:
        labels = labels or {}
        return all(labels.get(k) == v for k, v in self.match_labels) and all(
            r.matches(labels) for r in self.match_expressions
        )

    def to_query(self) -> str:
        """The ``labelSelector=`` query string form, for server-side filtering."""
        parts = [f"{k}={v}" for k, v in self.match_labels]
        for r in self.match_expressions:
            if r.operator in ("In", "NotIn"):
                parts.append(f"{r.key} {r.operator.lower()} ({','.join(r.values)})")
            else:
                parts.append(r.key if r.operator == "Exists" else f"!{r.key}")
        return ",".join(parts)


def selector_from_spec(
    raw: Any, path: str, error: Callable[[str], Exception] = ValueError
) -> LabelSelector:
    """A ``LabelSelector`` dict → `LabelSelector`; ``error(message)`` is raised on bad input."""
    if raw is None:
        return LabelSelector()
    if not isinstance(raw, Mapping):
        raise error(f"{path}: must be a label selector object")
    labels = raw.get("matchLabels") or {}
    if not isinstance(labels, Mapping):
        raise error(f"{path}.matchLabels: must be a map of strings")
    reqs = []
    for i, expr in enumerate(raw.get("matchExpressions") or ()):
        op = expr.get("operator")
        values = tuple(str(v) for v in expr.get("values") or ())
        if op not in _OPERATORS:
            raise error(
                f"{path}.matchExpressions[{i}].operator: {op!r} is not one of "
                + ", ".join(_OPERATORS)
            )
        if (op in ("In", "NotIn")) != bool(values):  # the CRD's rule, in its words
            raise error(
                f"{path}.matchExpressions[{i}]: values must be non-empty for In/NotIn and empty "
                f"for Exists/DoesNotExist (operator {op})"
            )
        reqs.append(Requirement(str(expr.get("key", "")), op, values))
    return LabelSelector(tuple(sorted((str(k), str(v)) for k, v in labels.items())), tuple(reqs))
