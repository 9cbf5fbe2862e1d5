"""Status building, conditions, settings/flags, rollout planning, certificates, admission."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import kopf
import pytest
from cryptography import x509
from kvoffload_operator import annotations as ann
from kvoffload_operator import certs
from kvoffload_operator.admission import admit_pod
from kvoffload_operator.handlers import plan_rollouts
from kvoffload_operator.inject import SIDECAR_NAME, RenderDefaults
from kvoffload_operator.metrics import OperatorMetrics
from kvoffload_operator.policy import policy_from_resource
from kvoffload_operator.settings import OperatorConfig, configure, parse_operator_args
from kvoffload_operator.status import build_status, set_condition
from kvoffload_operator.workloads import hash_patch
from prometheus_client import CollectorRegistry


def policy(name: str, priority: int = 0, generation: int = 4, **selector: str):
    return policy_from_resource(
        {
            "kind": "KVOffloadPolicy",
            "metadata": {"name": name, "namespace": "ns", "generation": generation},
            "spec": {
                "selector": {"matchLabels": selector or {"app": "vllm"}},
                "pool": {"size": "1Gi"},
                "priority": priority,
            },
        }
    )


def pod(
    name: str, labels: dict, by: str | None = None, ready: bool = False, phase: str = "Running"
) -> dict:
    meta: dict = {"name": name, "labels": labels}
    status: dict = {"phase": phase}
    if by:
        meta["annotations"] = {ann.STATUS: json.dumps({"policy": by})}
        status["initContainerStatuses"] = [{"name": SIDECAR_NAME, "started": True, "ready": ready}]
    return {"metadata": meta, "status": status}


def test_set_condition_keeps_transition_time_while_status_holds() -> None:
    c1 = set_condition([], "Ready", "True", "Applied", "m1", 1, "t1")
    c2 = set_condition(c1, "Ready", "True", "Applied", "m2", 2, "t2")
    c3 = set_condition(c2, "Ready", "False", "InvalidSpec", "bad", 3, "t3")
    assert c2[0]["lastTransitionTime"] == "t1" and c2[0]["message"] == "m2"
    assert c3[0]["lastTransitionTime"] == "t3" and c3[0]["observedGeneration"] == 3
    assert len(set_condition(c3, "Conflicting", "False", "NoConflict", "", 3, "t4")) == 2


def test_build_status_counts_and_conflicts() -> None:
    mine, gold = policy("mine"), policy("gold", priority=5, tier="gold")
    pods = [
        pod("a", {"app": "vllm"}, by="mine", ready=True),
        pod("b", {"app": "vllm"}, by="mine"),
        pod("c", {"app": "vllm"}),
        pod("done", {"app": "vllm"}, by="mine", ready=True, phase="Succeeded"),
        pod("d", {"app": "vllm", "tier": "gold"}, by="gold", ready=True),
        pod("e", {"app": "web"}),
    ]
    status = build_status(mine, pods, [mine, gold], namespace_enabled=True, now="t")
    assert (status["matchedPods"], status["injectedPods"], status["readySidecars"]) == (4, 2, 1)
    assert status["observedGeneration"] == 4
    conds = {c["type"]: c for c in status["conditions"]}
    assert conds["Ready"]["status"] == "True"
    assert (conds["Conflicting"]["status"], conds["Conflicting"]["reason"]) == (
        "True",
        "LowerPriority",
    )
    off = build_status(mine, pods, [mine], namespace_enabled=False, now="t")
    assert {c["type"]: c["reason"] for c in off["conditions"]} == {
        "Ready": "InjectionDisabled",
        "Conflicting": "NoConflict",
        "Degraded": "SidecarsRunning",
        "Limited": "NoLimits",
    }


def test_plan_rollouts_only_templates_this_policy_would_inject() -> None:
    mine, other = policy("a-mine"), policy("b-other")

    def dep(name: str, labels: dict, command: list[str], stamped: str | None = None) -> dict:
        meta: dict = {"labels": labels}
        if stamped:
            meta["annotations"] = {ann.POLICY_HASH: stamped}
        return {
            "kind": "Deployment",
            "metadata": {"name": name},
            "spec": {
                "template": {
                    "metadata": meta,
                    "spec": {"containers": [{"name": "c", "image": "i", "command": command}]},
                }
            },
        }

    workloads = [
        dep("roll", {"app": "vllm"}, ["vllm", "serve", "m"]),
        dep("done", {"app": "vllm"}, ["vllm", "serve", "m"], stamped=mine.spec_hash),
        dep("shell", {"app": "vllm"}, ["sh", "-c", "vllm serve a & vllm serve b"]),
        dep("web", {"app": "web"}, ["vllm", "serve", "m"]),
        {"kind": "DaemonSet", "metadata": {"name": "ds"}},
    ]
    names = [w["metadata"]["name"] for w in plan_rollouts(mine, workloads, [mine, other])]
    assert names == ["roll"]
    assert plan_rollouts(other, workloads, [mine, other]) == []  # mine wins the tie by name
    assert hash_patch("h") == {
        "spec": {"template": {"metadata": {"annotations": {ann.POLICY_HASH: "h"}}}}
    }


def test_flags_and_env() -> None:
    env = {
        "KVOFFLOAD_OPERATOR_WEBHOOK_PORT": "10443",
        "POD_NAMESPACE": "kvo",
        "KVOFFLOAD_OPERATOR_SELF_SIGNED_CERTS": "true",
    }
    cfg = parse_operator_args(["--namespace", "team", "--standalone", "--priority", "7"], env)
    assert (cfg.namespace, cfg.webhook_port, cfg.pod_namespace) == ("team", 10443, "kvo")
    assert cfg.self_signed_certs and cfg.standalone and cfg.priority == 7
    assert parse_operator_args(["--webhook-port", "9"], env).webhook_port == 9  # flag wins
    assert 1 <= parse_operator_args([], {}).priority < 10000
    with pytest.raises(SystemExit):
        parse_operator_args(["--webhook-port", "many"], {})


def test_injection_label_check() -> None:
    cfg = OperatorConfig()
    assert cfg.injection_enabled({ann.NAMESPACE_INJECTION: "enabled"})
    assert not cfg.injection_enabled({}) and not cfg.injection_enabled(None)
    assert OperatorConfig(injection_label="").injection_enabled(None)


def test_configure_sets_timeouts_and_leaves_the_webhook_config_to_the_chart() -> None:
    settings = kopf.OperatorSettings()
    configure(settings, OperatorConfig(namespace="team", standalone=True, priority=3))
    assert settings.watching.server_timeout == 300 and settings.watching.client_timeout == 330
    assert settings.networking.request_timeout == 60
    assert settings.admission.managed is None
    assert settings.peering.standalone and settings.peering.priority == 3
    assert not settings.peering.clusterwide
    assert settings.persistence.finalizer == "kvoffload.io/finalizer"


def test_certificates(tmp_path: Path) -> None:
    names = certs.service_dns_names("kvoffload-webhook", "kvo")
    bundle = certs.generate(names)
    cert = x509.load_pem_x509_certificate(bundle.cert_pem)
    ca = x509.load_pem_x509_certificate(bundle.ca_pem)
    cert.verify_directly_issued_by(ca)
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "kvoffload-webhook.kvo.svc" in sans.get_values_for_type(x509.DNSName)
    assert certs.still_valid(bundle.cert_pem, names)
    assert not certs.still_valid(bundle.cert_pem, [*names, "other.svc"])
    old = certs.generate(names, now=datetime.datetime(2020, 1, 1, tzinfo=datetime.timezone.utc))
    assert not certs.still_valid(old.cert_pem, names)
    crt, key = bundle.write(tmp_path)
    assert crt.read_bytes() == bundle.cert_pem and key.stat().st_mode & 0o777 == 0o600


def test_admission_counts_outcomes() -> None:
    metrics = OperatorMetrics.create(CollectorRegistry())
    mine = policy("mine")
    ok = admit_pod(
        {
            "metadata": {"labels": {"app": "vllm"}},
            "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai"}]},
        },
        [mine],
        RenderDefaults(),
        metrics,
    )
    skipped = admit_pod(
        {
            "metadata": {"labels": {"app": "vllm"}},
            "spec": {"containers": [{"name": "x", "image": "nginx"}]},
        },
        [mine],
        RenderDefaults(),
        metrics,
    )
    assert (ok.outcome, skipped.outcome, skipped.reason) == (
        "injected",
        "skipped",
        "no-vllm-container",
    )
    assert skipped.warnings and "no-vllm-container" in skipped.warnings[0]
    get = metrics.registry.get_sample_value
    assert get("kvoffload_injections_total", {"outcome": "injected", "reason": "none"}) == 1
    assert get("kvoffload_injection_duration_seconds_count") == 2
