"""Admin guardrails on policies, policy namespace scope, the hash seed and the weak-hash warning
(pure: no API server). The API-level behaviour is in test_security_operator.py."""

from __future__ import annotations

import json
from typing import Any

import pytest
from kvoffload_operator import annotations as ann
from kvoffload_operator import hashseed
from kvoffload_operator.admission import admit_pod
from kvoffload_operator.guardrails import Guardrails, repository
from kvoffload_operator.policy import policy_from_resource
from kvoffload_operator.settings import OperatorConfig, parse_operator_args
from kvoffload_operator.status import build_status

DEFAULT = OperatorConfig()


def policy(namespace: str = "team", **sidecar: Any) -> Any:
    spec: dict[str, Any] = {"selector": {"matchLabels": {"app": "vllm"}}, "pool": {"size": "8Gi"}}
    if sidecar:
        spec["sidecar"] = sidecar
    return policy_from_resource(
        {"kind": "KVOffloadPolicy", "metadata": {"name": "p", "namespace": namespace}, "spec": spec}
    )


def vllm_pod(namespace: str = "team", args: list[str] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "v", "namespace": namespace, "labels": {"app": "vllm"}},
        "spec": {
            "containers": [
                {"name": "vllm", "image": "vllm/vllm-openai:v0.11", "args": args or ["--model=m"]}
            ]
        },
    }


@pytest.mark.parametrize(
    ("sidecar", "words"),
    [
        ({"securityProfile": "privileged"}, "privileged is not allowed"),
        ({"extraCapabilities": ["IPC_LOCK"]}, "IPC_LOCK not allowed"),
        ({"image": "evil.example/kvoffload:1"}, "'evil.example/kvoffload:1' is not in the images"),
        # the default repository's name as a prefix of another one is not that repository
        ({"image": "ghcr.io/kvoffload/kvoffload-evil:1"}, "is not in the images"),
    ],
    ids=["privileged", "capability", "foreign-image", "look-alike"],
)
def test_default_settings_refuse_what_a_policy_should_not_get_alone(
    sidecar: dict[str, Any], words: str
) -> None:
    message = DEFAULT.guardrails().message(policy(**sidecar))
    assert message is not None and words in message
    assert "policyGuardrails" in message  # says which helm value would allow it


def test_default_settings_allow_the_default_images_by_tag_or_digest() -> None:
    guard = DEFAULT.guardrails()
    assert guard.message(policy()) is None
    assert guard.message(policy(image="ghcr.io/kvoffload/kvoffload:9.9")) is None
    assert guard.message(policy(image="ghcr.io/kvoffload/kvoffload@sha256:" + "a" * 64)) is None


def test_the_admin_widens_them_by_flag() -> None:
    config = parse_operator_args(
        [
            "--allowed-images=registry.corp/,ghcr.io/x/y@sha256:" + "b" * 64,
            "--allow-privileged",
            "--allowed-capabilities=IPC_LOCK",
        ],
        {},
    )
    guard = config.guardrails()
    assert guard.message(policy(securityProfile="privileged")) is None
    assert guard.message(policy(extraCapabilities=["IPC_LOCK"])) is None
    assert guard.message(policy(image="registry.corp/team/side:1")) is None
    assert guard.message(policy(image="ghcr.io/x/y@sha256:" + "b" * 64)) is None
    assert guard.message(policy(image="ghcr.io/x/y:latest")) is not None  # digest-pinned only
    assert Guardrails(("*",)).image_allowed("anything/at:all")


def test_repository_strips_tags_and_digests_but_not_registry_ports() -> None:
    assert repository("reg:5000/a/b:1@sha256:x") == "reg:5000/a/b"
    assert repository("reg:5000/a/b") == "reg:5000/a/b"


def test_a_policy_injects_pods_of_its_own_namespace_only() -> None:
    """The webhook's policies for a pod are its namespace's (the index's key); the operator
    over HTTPS is in test_security_operator.py."""
    from kvoffload_operator.handlers import _namespace_policies

    mine = policy(namespace="team")
    index = {"team": [mine]}
    assert _namespace_policies(index, "other") == []
    assert _namespace_policies(index, "team") == [mine]


def injected_env(pod: dict[str, Any]) -> dict[str, Any]:
    out = admit_pod(pod, [policy()], DEFAULT.render_defaults()).pod
    return {e["name"]: e for e in out["spec"]["containers"][0]["env"]}


def test_the_hash_seed_is_the_policys_secret_never_a_public_constant() -> None:
    seed = injected_env(vllm_pod())[hashseed.KEY]
    assert "value" not in seed
    assert seed["valueFrom"]["secretKeyRef"] == {
        "name": "kvoffload-hashseed-p",
        "key": "PYTHONHASHSEED",
        "optional": True,  # no Secret yet (no RoleBinding there): the pod still starts
    }
    seeds = {hashseed.new_seed() for _ in range(50)}
    assert len(seeds) == 50 and all(0 < int(s) <= 4294967295 for s in seeds)


def test_seed_secret_names_fit_the_api_limit() -> None:
    assert len(hashseed.secret_name("x" * 253)) == 253
    assert hashseed.secret_name("x" * 253) != hashseed.secret_name("x" * 252 + "y")


def test_a_weak_prefix_hash_with_a_shared_seed_is_flagged_on_status() -> None:
    pod = admit_pod(
        vllm_pod(args=["--model=m", "--prefix-caching-hash-algo", "xxhash"]),
        [policy()],
        DEFAULT.render_defaults(),
    ).pod
    pod["status"] = {"phase": "Running"}
    status = build_status(policy(), [pod], [policy()], namespace_enabled=True, now="t")
    weak = [c for c in status["conditions"] if c["type"] == "WeakPrefixHash"]
    assert weak and weak[0]["status"] == "True" and "xxhash" in weak[0]["message"]
    plain = admit_pod(vllm_pod(), [policy()], DEFAULT.render_defaults()).pod
    plain["status"] = {"phase": "Running"}
    status = build_status(policy(), [plain], [policy()], namespace_enabled=True, now="t")
    assert not [c for c in status["conditions"] if c["type"] == "WeakPrefixHash"]
    assert json.loads(plain["metadata"]["annotations"][ann.STATUS])["policy"] == "p"


def test_status_without_pod_access_says_so() -> None:
    status = build_status(
        policy(), [], [policy()], namespace_enabled=True, now="t", pods_visible=False
    )
    (cond,) = [c for c in status["conditions"] if c["type"] == "PodsVisible"]
    assert cond["status"] == "False" and "rbac.namespaces" in cond["message"]
