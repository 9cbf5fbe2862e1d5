"""`spec.tenants` from the policy to the sidecar: typed, hashed, rendered as `--tenants`, and
parsed by the real sidecar flag parser into the same shares (the CRD's own checks and their
Python twins are in tests/crds: the tenants-*.yaml bad examples)."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import pytest
import yaml
from kvoffload_operator.inject import inject_pod
from kvoffload_operator.policy import PolicyError, policy_from_resource
from kvoffload_operator.tenants import TenantSpec

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "crds" / "examples" / "tenants.yaml"
VLLM = {"name": "vllm", "image": "vllm/vllm-openai:v0.11.0", "args": ["--model", "m"]}


def example() -> dict:
    return yaml.safe_load(EXAMPLE.read_text())


def sidecar_args(policy) -> list[str]:
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "labels": {"app": "vllm"}},
           "spec": {"containers": [dict(VLLM)]}}  # fmt: skip
    out = inject_pod(pod, [policy]).pod
    (sidecar,) = [c for c in out["spec"]["initContainers"] if c["name"] == "kvoffload-sidecar"]
    return sidecar["args"]


def test_tenants_are_typed_with_their_defaults() -> None:
    policy = policy_from_resource(example())
    assert policy.tenants == (
        TenantSpec("team-a", ("team-a", "team-a-batch"), "40%", "70%"),
        TenantSpec("team-b", ("team-b",), "0%", "50%"),
        TenantSpec("default", (), "10%", "100%"),
    )


def test_the_sidecar_parses_the_rendered_flag_into_the_same_shares() -> None:
    from kvoffload_sidecar.config import parse_config

    args = sidecar_args(policy_from_resource(example()))
    (flag,) = [a for a in args if a.startswith("--tenants=")]
    tenants = parse_config(args, environ={}).tenants
    assert tenants is not None, flag
    shares = {t.name: (t.cache_salts, t.guaranteed, t.max) for t in tenants.tenants}
    assert shares == {
        "team-a": (("team-a", "team-a-batch"), Fraction(2, 5), Fraction(7, 10)),
        "team-b": (("team-b",), Fraction(0), Fraction(1, 2)),
        "default": ((), Fraction(1, 10), Fraction(1)),
    }


def test_without_tenants_no_flag_and_the_same_hash() -> None:
    raw = example()
    with_tenants = policy_from_resource(raw)
    del raw["spec"]["tenants"]
    plain = policy_from_resource(raw)
    assert not any(a.startswith("--tenants") for a in sidecar_args(plain))
    assert plain.spec_hash != with_tenants.spec_hash  # changing quotas rolls the workloads
    raw["spec"]["tenants"] = []
    assert policy_from_resource(raw).spec_hash == plain.spec_hash  # [] is no quotas


@pytest.mark.parametrize(
    ("tenants", "message"),
    [
        ("nope", "spec.tenants: must be a list of tenants"),
        ([{"name": "a", "cacheSalts": ["x", "x"]}], "must not repeat a salt"),
        ([{"name": "a", "cacheSalts": ["x"], "weight": 1}], "unknown field(s) 'weight'"),
        ([{"name": f"t{i}", "cacheSalts": [f"s{i}"]} for i in range(17)], "too many (at most 16)"),
    ],
)
def test_what_only_the_schema_catches_is_rejected_in_python_too(tenants, message) -> None:
    raw = example()
    raw["spec"]["tenants"] = tenants
    with pytest.raises(PolicyError) as exc:
        policy_from_resource(raw)
    assert message in str(exc.value)
