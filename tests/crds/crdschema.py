"""Offline stand-in for the API server's CR validation: defaults, structural schema, CEL.

- defaults: applied as the API server does (a defaulted ``{}`` object gets its fields' defaults);
- schema: ``openAPIV3Schema`` → JSON Schema (``x-kubernetes-*`` dropped, unknown fields rejected
  as ``kubectl apply``'s strict field validation does) checked with ``jsonschema``; ``pattern``
  is matched with RE2 (``google-re2``), as the API server's Go regexp does (Python's ``re``
  would let ``$`` match before a trailing newline); ``x-kubernetes-list-type: set`` refuses
  duplicate items;
- CEL: every ``x-kubernetes-validations`` rule evaluated with ``cel-python`` at its node. The
  Kubernetes quantity library (``quantity()``, ``isQuantity``, ``isInteger``, ``asInteger``,
  ``compareTo``, ``isGreaterThan``, ``isLessThan``), ``replace`` of the extended strings library
  and ``sum`` of the Kubernetes list library are provided here; cel-python has no other k8s
  libraries.
"""

from __future__ import annotations

import copy
import functools
from fractions import Fraction
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import re2
import yaml
from celpy import celtypes
from kvoffload_operator.policy import PolicyError, quantity_value

ROOT = Path(__file__).resolve().parents[2]
CRD_PATH = ROOT / "crds" / "kvoffloadpolicy.yaml"


def load_crd() -> dict[str, Any]:
    return copy.deepcopy(_parsed(str(CRD_PATH), CRD_PATH.stat().st_mtime_ns))


@functools.lru_cache(maxsize=4)
def _parsed(path: str, mtime_ns: int) -> dict[str, Any]:
    return yaml.safe_load(Path(path).read_text())


def openapi_schema(crd: dict[str, Any] | None = None) -> dict[str, Any]:
    crd = crd or _parsed(str(CRD_PATH), CRD_PATH.stat().st_mtime_ns)
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def apply_defaults(value: Any, schema: dict[str, Any]) -> Any:
    if isinstance(value, dict) and schema.get("type") == "object":
        props = schema.get("properties") or {}
        for key, sub in props.items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                value[key] = apply_defaults(value[key], sub)
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key in set(value) - set(props):
                value[key] = apply_defaults(value[key], extra)
    elif isinstance(value, list) and "items" in schema:
        return [apply_defaults(v, schema["items"]) for v in value]
    return value


def to_jsonschema(schema: Any, top: bool = True) -> Any:
    if isinstance(schema, list):
        return [to_jsonschema(s, False) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {
        k: to_jsonschema(v, False)
        for k, v in schema.items()
        if (not k.startswith("x-kubernetes-") or k == "x-kubernetes-list-type")
        and k not in ("format", "description")
    }
    if "properties" in schema:
        out["properties"] = {k: to_jsonschema(v, False) for k, v in schema["properties"].items()}
        if "additionalProperties" not in schema and k8s_strict(schema, top):
            out["additionalProperties"] = False
    return out


def k8s_strict(schema: dict[str, Any], top: bool) -> bool:
    # metadata is validated by the API server itself; everything else is pruned (rejected by
    # kubectl's strict field validation) when unknown.
    return not schema.get("x-kubernetes-preserve-unknown-fields")


# -- the Kubernetes CEL quantity library, enough for our rules ---------------------------------
class Quantity:
    def __init__(self, value: Fraction) -> None:
        self.value = value


def _quantity(text: Any) -> Quantity:
    """The subset of Kubernetes quantities the CRD's patterns admit, exactly (no float)."""
    return Quantity(Fraction(quantity_value(str(text))))


def _is_quantity(text: Any) -> celtypes.BoolType:
    try:
        quantity_value(str(text))
    except PolicyError:
        return celtypes.BoolType(False)
    return celtypes.BoolType(True)


CEL_FUNCTIONS = {
    "quantity": _quantity,
    "isQuantity": _is_quantity,
    "isInteger": lambda q: celtypes.BoolType(q.value.denominator == 1),
    "asInteger": lambda q: celtypes.IntType(int(q.value)),
    "compareTo": lambda a, b: celtypes.IntType((a.value > b.value) - (a.value < b.value)),
    "isGreaterThan": lambda a, b: celtypes.BoolType(a.value > b.value),
    "isLessThan": lambda a, b: celtypes.BoolType(a.value < b.value),
    # the extended strings library (`replace`) and the Kubernetes list library (`sum`)
    "replace": lambda s, old, new: celtypes.StringType(str(s).replace(str(old), str(new))),
    "sum": lambda items: _cel_sum(items),
}


def _cel_sum(items: Any) -> Any:
    """`list.sum()`: ints add up as int, anything with a double as double (Kubernetes)."""
    values = list(items)
    if any(isinstance(v, celtypes.DoubleType) for v in values):
        return celtypes.DoubleType(sum(float(v) for v in values))
    return celtypes.IntType(sum(int(v) for v in values))


_ENV = celpy.Environment()


def _re2_pattern(validator: Any, pattern: str, instance: Any, schema: Any) -> Any:
    if validator.is_type(instance, "string") and not re2.search(pattern, instance):
        yield jsonschema.ValidationError(f"{instance!r} does not match {pattern!r}")


def _list_set(validator: Any, list_type: str, instance: Any, schema: Any) -> Any:
    if list_type == "set" and validator.is_type(instance, "array"):
        seen: list[Any] = []
        for item in instance:
            if item in seen:
                yield jsonschema.ValidationError(f"Duplicate value: {item!r}")
            seen.append(item)


_VALIDATOR = jsonschema.validators.extend(
    jsonschema.Draft7Validator, {"pattern": _re2_pattern, "x-kubernetes-list-type": _list_set}
)


@functools.lru_cache(maxsize=256)
def _program(rule: str) -> Any:
    return _ENV.program(_ENV.compile(rule), functions=CEL_FUNCTIONS)


def cel_errors(value: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    errors: list[str] = []
    for rule in schema.get("x-kubernetes-validations") or []:
        program = _program(rule["rule"])
        result = program.evaluate({"self": celpy.json_to_cel(value)})
        if isinstance(result, Exception) or not bool(result):
            errors.append(f"{path or '<root>'}: Invalid value: {rule['message']}")
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        for key, sub in value.items():
            child = props.get(key) or (
                schema.get("additionalProperties")
                if isinstance(schema.get("additionalProperties"), dict)
                else None
            )
            if child is not None:
                errors += cel_errors(sub, child, f"{path}.{key}" if path else key)
    elif isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            errors += cel_errors(item, schema["items"], f"{path}[{i}]")
    return errors


@functools.lru_cache(maxsize=4)
def _json_schema(path: str, mtime_ns: int) -> Any:
    return to_jsonschema(openapi_schema(_parsed(path, mtime_ns)))


def validate(obj: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """(defaulted object, errors). Schema errors come first; CEL runs only on a valid schema
    (the API server also skips CEL for fields that failed their schema)."""
    schema = openapi_schema()
    obj = apply_defaults(copy.deepcopy(obj), schema)
    validator = _VALIDATOR(_json_schema(str(CRD_PATH), CRD_PATH.stat().st_mtime_ns))
    errors = [
        f"{'.'.join(str(p) for p in e.absolute_path) or '<root>'}: {e.message}"
        for e in sorted(validator.iter_errors(obj), key=lambda e: list(e.absolute_path))
    ]
    if errors:
        return obj, errors
    return obj, cel_errors(obj, schema)
