"""decide (every SkipReason, precedence, detection) and render (what is added, what is kept)."""

from __future__ import annotations

import copy
import json
from typing import Any

import kubernetes_validate
import pytest
from kvoffload_operator import annotations as ann
from kvoffload_operator.inject import SkipReason, apply_patch, decide, inject_pod
from kvoffload_operator.inject.decide import is_shell_wrapper, runs_vllm
from kvoffload_operator.inject.render import render
from kvoffload_operator.policy import policy_from_resource

POLICY = policy_from_resource(
    {
        "kind": "KVOffloadPolicy",
        "metadata": {"name": "p"},
        "spec": {"selector": {"matchLabels": {"app": "vllm"}}, "pool": {"size": "8Gi"}},
    }
)


def pod(*containers: dict[str, Any], **meta: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "x", "labels": {"app": "vllm"}, **meta},
        "spec": {"containers": list(containers)},
    }


VLLM = {"name": "engine", "image": "img", "command": ["vllm", "serve", "m"]}


@pytest.mark.parametrize(
    ("container", "expected"),
    [
        ({"command": ["vllm", "serve", "m"]}, True),
        ({"command": ["/usr/bin/python3.12", "-m", "vllm.entrypoints.openai.api_server"]}, True),
        ({"args": ["vllm", "serve", "m"]}, True),
        ({"image": "docker.io/vllm/vllm-openai:v0.11.0", "args": ["--model", "m"]}, True),
        ({"image": "vllm/vllm-openai", "command": ["python", "app.py"]}, False),
        ({"name": "vllm", "image": "custom"}, False),  # a name is no proof: opaque entrypoint
        ({"name": "vllm", "image": "custom", "command": ["/scripts/start.sh"]}, False),
        ({"command": ["vllm", "run-batch", "-i", "x", "-o", "y"]}, True),
        ({"command": ["argoexec", "emissary", "--", "vllm", "serve", "m"]}, True),
        ({"command": ["bash", "-c", "vllm serve m"]}, True),
        ({"command": ["bash", "-c", "vllm serve a & vllm serve b"]}, False),
        ({"command": ["python", "-m", "http.server"]}, False),
    ],
)
def test_detection(container: dict[str, Any], expected: bool) -> None:
    assert runs_vllm({"name": "c", "image": "x", **container}) is expected


def test_shell_wrapper_forms() -> None:
    assert is_shell_wrapper({"command": ["/bin/sh", "-ec", "vllm serve"]})
    assert is_shell_wrapper({"command": ["bash"], "args": ["-lc", "vllm serve"]})
    assert not is_shell_wrapper({"command": ["bash", "run.sh"]})


@pytest.mark.parametrize(
    ("the_pod", "reason"),
    [
        (pod(VLLM, annotations={ann.INJECT: "false"}), SkipReason.OPTED_OUT),
        (pod(VLLM, labels={ann.INJECT: "false", "app": "vllm"}), SkipReason.OPTED_OUT),
        (pod(VLLM, labels={"app": "web"}), SkipReason.NO_MATCHING_POLICY),
        (
            {**pod(VLLM), "spec": {"hostNetwork": True, "containers": [VLLM]}},
            SkipReason.HOST_NETWORK,
        ),
        (pod(VLLM, annotations={ann.POOL_SIZE: "0"}), SkipReason.INVALID_OVERRIDE),
        (pod({"name": "web", "image": "nginx"}), SkipReason.NO_VLLM_CONTAINER),
        (pod(VLLM, annotations={ann.VLLM_CONTAINER: "missing"}), SkipReason.NO_VLLM_CONTAINER),
        (
            pod({"name": "a", "image": "i", "command": ["sh", "-c", "vllm serve a; vllm serve b"]}),
            SkipReason.SHELL_WRAPPER,
        ),
        (pod({**VLLM, "args": ["--kv_transfer_config={}"]}), SkipReason.HAS_KV_TRANSFER_CONFIG),
        (pod({**VLLM, "args": ["--kv-transfer-config", "{}"]}), SkipReason.HAS_KV_TRANSFER_CONFIG),
        (
            pod({**VLLM, "env": [{"name": "LMCACHE_LOCAL_CPU", "value": "True"}]}),
            SkipReason.OTHER_KV_CACHE,
        ),
        (pod({**VLLM, "args": ["--config", "/etc/v.yaml"]}), SkipReason.CONFIG_FILE),
        (
            pod({"name": "vllm", "image": "i", "command": ["/start.sh"]}),
            SkipReason.OPAQUE_ENTRYPOINT,
        ),
        (
            pod({"name": "k", "image": "kserve/huggingfaceserver", "args": ["--model_id=m"]}),
            SkipReason.BACKEND_AUTO,
        ),
        (
            pod(VLLM, {"name": "p", "image": "ghcr.io/kvoffload/kvoffload:0.1.0"}),
            SkipReason.HAND_WIRED,
        ),
        (pod(VLLM, annotations={ann.INJECT_VIA: "stdin"}), SkipReason.INVALID_OVERRIDE),
    ],
)
def test_skip_reasons(the_pod: dict[str, Any], reason: SkipReason) -> None:
    result = inject_pod(the_pod, [POLICY])
    assert result.decision.reason is reason and not result.decision.inject
    annotations = result.pod["metadata"].get("annotations") or {}
    if reason is SkipReason.NO_MATCHING_POLICY:
        assert result.patch == []  # a pod no policy targets is not touched at all
    else:
        assert annotations[ann.SKIP_REASON] == reason.value
        assert result.pod["spec"] == the_pod["spec"]


def test_already_injected_by_another_policy_conflicts() -> None:
    other = policy_from_resource(
        {
            "kind": "KVOffloadPolicy",
            "metadata": {"name": "q-other"},
            "spec": {"selector": {}, "pool": {"size": "1Gi"}},
        }
    )
    injected = inject_pod(pod(VLLM), [other]).pod
    assert decide(injected, [other]).reason is SkipReason.ALREADY_INJECTED
    assert decide(injected, [POLICY, other]).reason is SkipReason.CONFLICTING_POLICIES


def test_render_keeps_user_parts_and_adds_ours() -> None:
    dshm = {"name": "dshm", "mountPath": "/dev/shm"}
    user = pod(
        {
            **VLLM,
            "volumeMounts": [dshm],
            "env": [
                {
                    "name": "PYTHONPATH",
                    "valueFrom": {"configMapKeyRef": {"name": "cm", "key": "pp"}},
                }
            ],
        },
        {"name": "exporter", "image": "e"},
    )
    user["spec"]["volumes"] = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    policy = policy_from_resource(
        {
            "kind": "KVOffloadPolicy",
            "metadata": {"name": "p"},
            "spec": {
                "selector": {},
                "pool": {"size": "8Gi"},
                "connector": {"delivery": "initContainer"},
            },
        }
    )
    result = inject_pod(user, [policy])
    out = result.pod
    engine = out["spec"]["containers"][0]
    assert engine["volumeMounts"][0] == dshm  # /dev/shm untouched, nothing else there
    assert [m["mountPath"] for m in engine["volumeMounts"]] == [
        "/dev/shm",
        "/kvoffload/pool",
        "/kvoffload/run",
        "/kvoffload/python",
    ]
    env = {e["name"]: e for e in engine["env"]}
    assert env["KVOFFLOAD_USER_PYTHONPATH"]["valueFrom"]["configMapKeyRef"]["name"] == "cm"
    assert env["PYTHONPATH"]["value"] == "/kvoffload/python:$(KVOFFLOAD_USER_PYTHONPATH)"
    assert env["PYTHONHASHSEED"] == {"name": "PYTHONHASHSEED", "valueFrom": SEED_REF}
    assert out["spec"]["containers"][1] == user["spec"]["containers"][1]
    config = json.loads(engine["args"][-1].split("=", 1)[1])
    assert config["kv_connector_extra_config"] == {
        "socket": "/kvoffload/run/pool.sock",
        "mode": "eager",
        "load_mode": "layered",
    }
    assert config["kv_load_failure_policy"] == "recompute" and config["kv_role"] == "kv_both"
    inits = [c["name"] for c in out["spec"]["initContainers"]]
    assert inits == ["kvoffload-connector-install", "kvoffload-sidecar"]
    sidecar = out["spec"]["initContainers"][1]
    assert sidecar["restartPolicy"] == "Always" and "exec" in sidecar["startupProbe"]
    assert sidecar["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert apply_patch(user, result.patch) == out  # the patch is exactly the diff
    status = json.loads(out["metadata"]["annotations"][ann.STATUS])
    assert status["env"] == ["PYTHONHASHSEED", "PYTHONPATH"] and status["policy"] == "p"


SEED_REF = {
    "secretKeyRef": {"name": "kvoffload-hashseed-p", "key": "PYTHONHASHSEED", "optional": True}
}


@pytest.mark.parametrize(
    ("extra", "seed"),
    [
        # nothing says otherwise: the policy's random seed from its Secret (never a public
        # constant), so a restarted engine finds what it stored
        ({}, SEED_REF),
        ({"env": [{"name": "PYTHONHASHSEED", "value": "42"}]}, "42"),  # the user's own
        # envFrom may carry a seed the webhook cannot read: never override it
        ({"envFrom": [{"configMapRef": {"name": "router-env"}}]}, None),
    ],
    ids=["unset", "env", "envFrom"],
)
def test_pythonhashseed_is_set_only_where_no_user_seed_can_be(
    extra: dict[str, Any], seed: Any
) -> None:
    user = pod({**VLLM, **copy.deepcopy(extra)})
    out = inject_pod(user, [POLICY]).pod
    engine = out["spec"]["containers"][0]
    env = {e["name"]: e.get("value") or e.get("valueFrom") for e in engine.get("env", [])}
    assert env.get("PYTHONHASHSEED") == seed
    assert engine.get("envFrom") == extra.get("envFrom")
    status = json.loads(out["metadata"]["annotations"][ann.STATUS])
    assert ("PYTHONHASHSEED" in status["env"]) is (not extra)


def test_render_refuses_a_skip_decision() -> None:
    decision = decide(pod({"name": "web", "image": "nginx"}), [POLICY])
    with pytest.raises(ValueError):
        render(pod(), decision, None)  # type: ignore[arg-type]


@pytest.mark.parametrize("k8s", ["1.29.0", "1.33.0"])
def test_injected_pods_are_valid_kubernetes_objects(k8s: str) -> None:
    for profile in ("minimal", "privileged"):
        policy = policy_from_resource(
            {
                "kind": "KVOffloadPolicy",
                "metadata": {"name": "p"},
                "spec": {
                    "selector": {},
                    "pool": {"size": "4Gi", "hugepages": True},
                    "sidecar": {"securityProfile": profile},
                    "connector": {"delivery": "initContainer"},
                },
            }
        )
        out = inject_pod(copy.deepcopy(pod(VLLM)), [policy]).pod
        kubernetes_validate.validate(out, k8s, strict=True)


@pytest.mark.parametrize("hugepages", [False, True])
def test_injected_settings_parse_in_the_sidecar_and_the_connector(hugepages: bool) -> None:
    """The contract seen from both ends: the real sidecar flag parser and connector config
    parser accept what the injector writes."""
    from kvoffload_connector.common.config import StoreMode, parse_extra_config
    from kvoffload_sidecar.config import parse_config

    policy = policy_from_resource(
        {
            "kind": "KVOffloadPolicy",
            "metadata": {"name": "p"},
            "spec": {
                "selector": {},
                "pool": {"size": "4Gi", "hugepages": hugepages, "numaNode": 1, "eviction": "arc"},
                "offload": {"mode": "lazy", "chunkSize": 512},
                "connector": {"extraConfig": {"lookup_timeout_ms": "150"}},
            },
        }
    )
    out = inject_pod(pod(VLLM), [policy]).pod
    sidecar = next(c for c in out["spec"]["initContainers"] if c["name"] == "kvoffload-sidecar")
    config = parse_config(sidecar["args"], environ={})
    assert config.pool_size == 4 << 30
    engine = out["spec"]["containers"][0]
    kv = json.loads(engine["args"][-1].split("=", 1)[1])
    extra = parse_extra_config(kv["kv_connector_extra_config"], block_size=16)
    assert (extra.chunk_tokens, extra.mode, extra.lookup_timeout_ms) == (512, StoreMode.LAZY, 150)
    assert extra.socket == sidecar["args"][2].split("=", 1)[1]
