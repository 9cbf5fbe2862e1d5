"""Template unit tests (vault-helm style): render with --show-only, assert one field each.

Every test runs the real helm binary (`helm template`); renders are cached per value set.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.process

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "kvoffload"

NS = "kvoffload-system"
WEBHOOK = "templates/mutatingwebhook.yaml"
DEPLOY = "templates/deployment.yaml"
RBAC = "templates/rbac.yaml"
CERT_MANAGER = ("--set", "webhook.certManager.enabled=true")


def one(objs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [o for o in objs if o["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, got {[o['metadata']['name'] for o in found]}"
    return found[0]


def webhook(render, *args: str) -> dict[str, Any]:
    (mwc,) = render(*args, show_only=WEBHOOK)
    assert mwc["kind"] == "MutatingWebhookConfiguration"
    (hook,) = mwc["webhooks"]
    return hook


def operator_container(render, *args: str) -> dict[str, Any]:
    (deploy,) = render(*args, show_only=DEPLOY)
    (container,) = deploy["spec"]["template"]["spec"]["containers"]
    return container


def flags(container: dict[str, Any]) -> dict[str, str | None]:
    """`--name=value` / `--name` args as a dict (value None for bare switches)."""
    out: dict[str, str | None] = {}
    for arg in container["args"]:
        name, sep, value = arg.partition("=")
        out[name] = value if sep else None
    return out


# --- the MutatingWebhookConfiguration ------------------------------------------------------------


def test_webhook_failure_policy_defaults_to_ignore(render):
    assert webhook(render)["failurePolicy"] == "Ignore"


def test_webhook_reinvocation_policy_is_if_needed(render):
    assert webhook(render)["reinvocationPolicy"] == "IfNeeded"


def test_webhook_has_no_side_effects(render):
    assert webhook(render)["sideEffects"] == "None"


def test_webhook_timeout_is_short(render):
    assert webhook(render)["timeoutSeconds"] == 5


def test_webhook_speaks_admission_review_v1_only(render):
    assert webhook(render)["admissionReviewVersions"] == ["v1"]


def test_webhook_intercepts_pod_creation_only(render):
    assert webhook(render)["rules"] == [
        {
            "apiGroups": [""],
            "apiVersions": ["v1"],
            "operations": ["CREATE"],
            "resources": ["pods"],
            "scope": "Namespaced",
        }
    ]


def test_webhook_namespace_selector_is_the_opt_in_label(render):
    assert webhook(render)["namespaceSelector"] == {
        "matchLabels": {"kvoffload.io/injection": "enabled"}
    }


def test_webhook_object_selector_excludes_the_operators_own_pods(render):
    (deploy,) = render(show_only=DEPLOY)
    pod_name_label = deploy["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"]
    expressions = webhook(render)["objectSelector"]["matchExpressions"]
    assert {
        "key": "app.kubernetes.io/name",
        "operator": "NotIn",
        "values": [pod_name_label],
    } in expressions


def test_webhook_object_selector_follows_name_override(render):
    expressions = webhook(render, "--set", "nameOverride=kvo")["objectSelector"]["matchExpressions"]
    assert {"key": "app.kubernetes.io/name", "operator": "NotIn", "values": ["kvo"]} in expressions


def test_webhook_object_selector_honours_the_pod_opt_out_label(render):
    expressions = webhook(render)["objectSelector"]["matchExpressions"]
    assert {"key": "kvoffload.io/inject", "operator": "NotIn", "values": ["false"]} in expressions


def test_webhook_calls_the_kopf_handler_path_on_the_chart_service(render):
    (service,) = render(show_only="templates/service.yaml")
    client = webhook(render)["clientConfig"]["service"]
    assert (client["name"], client["namespace"], client["path"]) == (
        service["metadata"]["name"],
        NS,
        "/mutate-pods",
    )


def test_webhook_service_port_reaches_the_container_webhook_port(render):
    (service,) = render(show_only="templates/service.yaml")
    port = webhook(render)["clientConfig"]["service"]["port"]
    (svc_port,) = [p for p in service["spec"]["ports"] if p["port"] == port]
    (container_port,) = [
        p for p in operator_container(render)["ports"] if p["name"] == svc_port["targetPort"]
    ]
    assert (port, container_port["containerPort"]) == (443, 9443)


def test_webhook_failure_policy_is_configurable(render):
    assert webhook(render, "--set", "webhook.failurePolicy=Fail")["failurePolicy"] == "Fail"


def test_namespace_scoped_webhook_only_intercepts_the_watched_namespace(render):
    selector = webhook(render, "--set", "operator.watchNamespace=inference")["namespaceSelector"]
    assert {
        "key": "kubernetes.io/metadata.name",
        "operator": "In",
        "values": ["inference"],
    } in selector["matchExpressions"]


# --- TLS: self-signed (operator-managed) vs cert-manager ---------------------------------------


def test_self_signed_mode_leaves_ca_bundle_to_the_operator(render):
    (mwc,) = render(show_only=WEBHOOK)
    assert "caBundle" not in mwc["webhooks"][0]["clientConfig"]
    assert "cert-manager.io/inject-ca-from" not in mwc["metadata"].get("annotations", {})


def test_self_signed_mode_names_the_secret_its_role_reaches_and_both_webhook_configs(render):
    objs = render()
    args = flags(operator_container(render))
    role = one(objs, "Role")
    assert rules_of(role)[("", "secrets#named")]["resourceNames"] == [args["--cert-secret"]]
    assert args["--webhook-config"] == one(objs, "MutatingWebhookConfiguration")["metadata"]["name"]
    assert (
        args["--policy-webhook-config"]
        == one(objs, "ValidatingWebhookConfiguration")["metadata"]["name"]
    )


def test_the_chart_ships_no_webhook_secret_the_first_operator_creates_it(render):
    # replicas agree on one pair by creating the Secret (the API server accepts one create);
    # a chart-made empty Secret would leave them to race on filling it
    assert "Secret" not in {o["kind"] for o in render()}


def test_self_signed_mode_passes_the_switch(render):
    assert "--self-signed-certs" in flags(operator_container(render))


def test_cert_manager_mode_injects_the_ca_from_the_certificate(render):
    objs = render(*CERT_MANAGER)
    cert = one(objs, "Certificate")
    annotation = one(objs, "MutatingWebhookConfiguration")["metadata"]["annotations"][
        "cert-manager.io/inject-ca-from"
    ]
    assert annotation == f"{NS}/{cert['metadata']['name']}"


def test_cert_manager_certificate_covers_the_service_dns_name(render):
    objs = render(*CERT_MANAGER)
    service = one(objs, "Service")["metadata"]["name"]
    assert f"{service}.{NS}.svc" in one(objs, "Certificate")["spec"]["dnsNames"]


def test_cert_manager_secret_is_what_the_operator_mounts(render):
    objs = render(*CERT_MANAGER)
    volumes = one(objs, "Deployment")["spec"]["template"]["spec"]["volumes"]
    (certs,) = [v for v in volumes if v["name"] == "webhook-certs"]
    assert certs["secret"]["secretName"] == one(objs, "Certificate")["spec"]["secretName"]


def test_cert_manager_mode_drops_the_self_signed_parts(render):
    objs = render(*CERT_MANAGER)
    kinds = {o["kind"] for o in objs}
    assert "--self-signed-certs" not in flags(operator_container(render, *CERT_MANAGER))
    assert "Secret" not in kinds and "Role" not in kinds


def test_cert_manager_creates_a_self_signed_issuer_unless_one_is_named(render):
    own = one(render(*CERT_MANAGER), "Certificate")["spec"]["issuerRef"]
    named = render(
        *CERT_MANAGER,
        "--set",
        "webhook.certManager.issuerRef.name=corp-ca",
        "--set",
        "webhook.certManager.issuerRef.kind=ClusterIssuer",
    )
    assert own["kind"] == "Issuer" and one(render(*CERT_MANAGER), "Issuer")["spec"] == {
        "selfSigned": {}
    }
    assert one(named, "Certificate")["spec"]["issuerRef"] == {
        "name": "corp-ca",
        "kind": "ClusterIssuer",
    }
    assert "Issuer" not in {o["kind"] for o in named}


# --- RBAC ------------------------------------------------------------------------------------


def rules_of(obj: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    """(apiGroup, resource) -> {"verbs": sorted verbs, "resourceNames": names or None}; one entry
    per (group, resource, resourceNames) combination merged by verb."""
    table: dict[tuple[str, str], dict[str, Any]] = {}
    for rule in obj["rules"]:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                key = (
                    (group, resource)
                    if "resourceNames" not in rule
                    else (group, resource + "#named")
                )
                entry = table.setdefault(
                    key, {"verbs": set(), "resourceNames": rule.get("resourceNames")}
                )
                entry["verbs"] |= set(rule["verbs"])
    return {
        k: {"verbs": sorted(v["verbs"]), "resourceNames": v["resourceNames"]}
        for k, v in table.items()
    }


POLICY_RULES = {
    ("kvoffload.io", "kvoffloadpolicies"): ["get", "list", "patch", "watch"],
    ("kvoffload.io", "kvoffloadpolicies/status"): ["get", "patch", "update"],
    ("", "events"): ["create", "patch"],
}
NAMESPACE_RULES = {
    ("", "pods"): ["get", "list", "watch"],
    ("", "events"): ["create", "list", "patch"],
    ("", "secrets"): ["create"],
}
ROLLOUT_RULES = {
    ("apps", "deployments"): ["get", "list", "patch"],
    ("apps", "statefulsets"): ["get", "list", "patch"],
}
CLUSTER_READS = {
    ("", "namespaces"): ["get", "list", "watch"],
    ("apiextensions.k8s.io", "customresourcedefinitions"): ["list", "watch"],
    # a placement-node policy's status reads the node pool it names: get, never list or watch
    ("kvoffload.io", "kvoffloadnodepools"): ["get"],
    # and prunes the status entries of nodes that no longer exist (a node read by name)
    ("kvoffload.io", "kvoffloadnodepools/status"): ["patch"],
    ("", "nodes"): ["get"],
}
WEBHOOK_CA = {
    ("admissionregistration.k8s.io", "mutatingwebhookconfigurations#named"): ["get", "patch"],
    ("admissionregistration.k8s.io", "validatingwebhookconfigurations#named"): ["get", "patch"],
}
WORKLOAD_RESOURCES = {("", "pods"), ("apps", "deployments"), ("apps", "statefulsets")}


def verbs(obj: dict[str, Any]) -> dict[tuple[str, str], list[str]]:
    return {k: v["verbs"] for k, v in rules_of(obj).items()}


def cluster_wide_rules(objs: list[dict[str, Any]]) -> dict[tuple[str, str], list[str]]:
    """What the ClusterRoleBindings grant: the rules of every ClusterRole one of them binds."""
    bound = {o["roleRef"]["name"] for o in objs if o["kind"] == "ClusterRoleBinding"}
    out: dict[tuple[str, str], list[str]] = {}
    for o in objs:
        if o["kind"] == "ClusterRole" and o["metadata"]["name"] in bound:
            for key, v in verbs(o).items():
                out[key] = sorted(set(out.get(key, [])) | set(v))
    return out


def namespace_role(objs: list[dict[str, Any]]) -> dict[str, Any]:
    bound = {o["roleRef"]["name"] for o in objs if o["kind"] == "ClusterRoleBinding"}
    (role,) = [o for o in objs if o["kind"] == "ClusterRole" and o["metadata"]["name"] not in bound]
    return role


def rolebindings_to(objs: list[dict[str, Any]], role: dict[str, Any]) -> list[str]:
    return sorted(
        o["metadata"]["namespace"]
        for o in objs
        if o["kind"] == "RoleBinding" and o["roleRef"]["name"] == role["metadata"]["name"]
    )


def test_default_install_grants_no_workload_verb_cluster_wide(render):
    objs = render(show_only=RBAC)
    granted = cluster_wide_rules(objs)
    assert not WORKLOAD_RESOURCES & set(granted), granted
    # and with nothing listed in rbac.namespaces, no binding grants them anywhere
    assert rolebindings_to(objs, namespace_role(objs)) == []
    assert not [o for o in objs if o["kind"] == "Role" and rules_of(o).keys() & WORKLOAD_RESOURCES]


def test_cluster_role_verbs_are_exactly_the_contract(render):
    assert cluster_wide_rules(render(show_only=RBAC)) == {
        **POLICY_RULES,
        **CLUSTER_READS,
        ("kopf.dev", "clusterkopfpeerings"): ["get", "list", "patch", "watch"],
        **WEBHOOK_CA,
    }


def test_listed_namespaces_get_pod_reads_by_rolebinding_and_rollouts_only_when_enabled(render):
    objs = render("--set", "rbac.namespaces={inference,batch}", show_only=RBAC)
    role = namespace_role(objs)
    assert verbs(role) == NAMESPACE_RULES
    assert rolebindings_to(objs, role) == ["batch", "inference"]
    assert not WORKLOAD_RESOURCES & set(cluster_wide_rules(objs))
    rolling = render(
        "--set", "rbac.namespaces={inference}", "--set", "operator.rollouts.enabled=true"
    )
    assert verbs(namespace_role(rolling)) == {**NAMESPACE_RULES, **ROLLOUT_RULES}
    assert "--rollouts" in flags(
        operator_container(render, "--set", "operator.rollouts.enabled=true")
    )
    assert "--rollouts" not in flags(operator_container(render))


def test_every_rbac_rule_says_why():
    """Each rule in rbac.yaml is preceded by a comment line giving its reason (template
    directives such as ``{{- if }}`` between the two are skipped)."""
    lines = (CHART / "templates" / "rbac.yaml").read_text().splitlines()
    rules = [n for n, line in enumerate(lines) if line.strip().startswith("- apiGroups:")]
    assert len(rules) >= 10
    for n in rules:
        above = [t.strip() for t in lines[:n] if t.strip()]
        while above and above[-1].startswith("{{"):
            above.pop()
        assert above and above[-1].startswith("#"), f"rbac.yaml:{n + 1}: a rule without a reason"


def test_webhook_config_patch_is_limited_to_the_charts_own(render):
    objs = render()
    rules = rules_of(next(o for o in objs if o["kind"] == "ClusterRole"))
    rule = rules[("admissionregistration.k8s.io", "mutatingwebhookconfigurations#named")]
    assert rule["resourceNames"] == [one(objs, "MutatingWebhookConfiguration")["metadata"]["name"]]
    rule = rules[("admissionregistration.k8s.io", "validatingwebhookconfigurations#named")]
    assert rule["resourceNames"] == [
        one(objs, "ValidatingWebhookConfiguration")["metadata"]["name"]
    ]


def test_secret_access_is_namespaced_and_limited_to_the_webhook_secret(render):
    objs = render()
    role = one(objs, "Role")
    table = rules_of(role)
    assert role["metadata"]["namespace"] == NS
    assert table[("", "secrets#named")] == {
        "verbs": ["get", "patch", "update"],
        "resourceNames": [flags(operator_container(render))["--cert-secret"]],
    }
    assert table[("", "secrets")] == {"verbs": ["create"], "resourceNames": None}


def test_cert_manager_mode_grants_no_secret_or_webhook_rights(render):
    assert cluster_wide_rules(render(*CERT_MANAGER, show_only=RBAC)) == {
        **POLICY_RULES,
        **CLUSTER_READS,
        ("kopf.dev", "clusterkopfpeerings"): ["get", "list", "patch", "watch"],
    }


def test_single_replica_needs_no_peering_rights(render):
    granted = cluster_wide_rules(render("--set", "operator.replicas=1", show_only=RBAC))
    assert not [key for key in granted if key[0] == "kopf.dev"]


def test_namespace_scoped_rbac_moves_policy_rules_into_a_role(render):
    objs = render("--set", "operator.watchNamespace=inference", show_only=RBAC)
    roles = [o for o in objs if o["kind"] == "Role" and o["metadata"]["namespace"] == "inference"]
    assert len(roles) == 1
    assert verbs(roles[0]) == {
        **POLICY_RULES,
        ("kopf.dev", "kopfpeerings"): ["get", "list", "patch", "watch"],
    }
    assert set(cluster_wide_rules(objs)) == set(CLUSTER_READS) | set(WEBHOOK_CA)
    assert rolebindings_to(objs, namespace_role(objs)) == ["inference"]


def test_bindings_name_the_operator_service_account(render):
    objs = render("--set", "rbac.namespaces={inference}")
    account = one(objs, "ServiceAccount")["metadata"]["name"]
    subjects = [s for o in objs if o["kind"].endswith("Binding") for s in o["subjects"]]
    assert subjects and all(
        s == {"kind": "ServiceAccount", "name": account, "namespace": NS} for s in subjects
    )


def test_no_rbac_when_disabled(render):
    assert not [o for o in render("--set", "rbac.create=false") if "Role" in o["kind"]]


# --- policy guardrails and the sidecars' NetworkPolicy ----------------------------------------


def test_guardrail_values_become_operator_flags(render):
    assert not {"--allowed-images", "--allow-privileged", "--allowed-capabilities"} & set(
        flags(operator_container(render))
    )
    args = flags(
        operator_container(
            render,
            "--set",
            "policyGuardrails.allowedImages={registry.corp/,ghcr.io/org/side}",
            "--set",
            "policyGuardrails.allowPrivileged=true",
            "--set",
            "policyGuardrails.allowedCapabilities={IPC_LOCK}",
        )
    )
    assert args["--allowed-images"] == "registry.corp/,ghcr.io/org/side"
    assert "--allow-privileged" in args and args["--allowed-capabilities"] == "IPC_LOCK"


def test_policy_webhook_validates_policies_at_the_operators_path(render):
    vwc = one(render(), "ValidatingWebhookConfiguration")
    (hook,) = vwc["webhooks"]
    assert hook["clientConfig"]["service"]["path"] == "/validate-policies"
    assert hook["rules"][0]["resources"] == ["kvoffloadpolicies"]
    assert hook["sideEffects"] == "None"


def test_network_policy_keeps_the_sidecar_ports_to_the_operator_and_prometheus(render):
    assert "NetworkPolicy" not in {o["kind"] for o in render()}
    objs = render("--set", "networkPolicy.enabled=true", "--set", "rbac.namespaces={inference}")
    netpol = one(objs, "NetworkPolicy")
    assert netpol["metadata"]["namespace"] == "inference"
    open_rule, operator_rule, metrics_rule = netpol["spec"]["ingress"]
    assert "from" not in open_rule
    spans = [(p["port"], p.get("endPort")) for p in open_rule["ports"] if p["protocol"] == "TCP"]
    assert spans == [(1, 9399), (9402, 65535)]  # every port but the sidecar's
    assert [p["port"] for p in operator_rule["ports"]] == [9400, 9401]
    assert [p["port"] for p in metrics_rule["ports"]] == [9401]


# --- the operator Deployment ------------------------------------------------------------------


def test_operator_runs_the_console_script(render):
    assert operator_container(render)["command"] == ["kvoffload", "operator"]


def test_operator_flags_match_the_contract(render):
    args = flags(operator_container(render))
    assert {
        k: args[k] for k in ("--webhook-port", "--cert-dir", "--metrics-port", "--health-port")
    } == {
        "--webhook-port": "9443",
        "--cert-dir": "/etc/kvoffload/webhook-certs",
        "--metrics-port": "8080",
        "--health-port": "8081",
    }


def test_operator_passes_default_images_for_injected_pods(render):
    args = flags(operator_container(render))
    assert (args["--sidecar-image"], args["--connector-image"]) == (
        "ghcr.io/kvoffload/kvoffload:0.1.0",
        "ghcr.io/kvoffload/kvoffload-connector:0.1.0",
    )


def test_operator_image_overrides_reach_the_sidecar_default(render):
    args = flags(
        operator_container(
            render, "--set", "image.repository=registry.local/kvo", "--set", "image.tag=dev"
        )
    )
    assert args["--sidecar-image"] == "registry.local/kvo:dev"


def test_operator_gets_its_namespace_from_the_downward_api(render):
    env = {e["name"]: e for e in operator_container(render)["env"]}
    assert env["POD_NAMESPACE"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}


def test_two_replicas_use_peering(render):
    args = flags(operator_container(render))
    assert "--peering" in args and "--standalone" not in args


def test_one_replica_runs_standalone_with_recreate(render):
    (deploy,) = render("--set", "operator.replicas=1", show_only=DEPLOY)
    (container,) = deploy["spec"]["template"]["spec"]["containers"]
    assert "--standalone" in flags(container) and deploy["spec"]["strategy"] == {"type": "Recreate"}


def test_namespace_scoped_operator_watches_one_namespace(render):
    assert (
        flags(operator_container(render, "--set", "operator.watchNamespace=inference"))[
            "--namespace"
        ]
        == "inference"
    )


def test_operator_security_context_is_restricted(render):
    (deploy,) = render(show_only=DEPLOY)
    pod = deploy["spec"]["template"]["spec"]
    container = pod["containers"][0]["securityContext"]
    assert (
        pod["securityContext"]["runAsNonRoot"],
        pod["securityContext"]["seccompProfile"],
        container["allowPrivilegeEscalation"],
        container["capabilities"],
        container["readOnlyRootFilesystem"],
    ) == (True, {"type": "RuntimeDefault"}, False, {"drop": ["ALL"]}, True)
    # no uid pinned: OpenShift's restricted SCC refuses one outside the namespace's range; the
    # image's numeric USER (test_chart_dockerfiles.py) satisfies runAsNonRoot elsewhere
    assert not {"runAsUser", "runAsGroup", "fsGroup"} & set(pod["securityContext"])
    assert "runAsUser" not in container


def test_a_uid_can_still_be_pinned(render):
    (deploy,) = render("--set", "operator.podSecurityContext.runAsUser=1001", show_only=DEPLOY)
    assert deploy["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == 1001


def test_operator_liveness_probe_is_kopfs_healthz(render):
    probe = operator_container(render)["livenessProbe"]["httpGet"]
    ports = {p["name"]: p["containerPort"] for p in operator_container(render)["ports"]}
    assert (probe["path"], ports[probe["port"]]) == ("/healthz", 8081)


def test_scheduling_values_reach_the_pod(render):
    (deploy,) = render(
        "--set",
        "operator.priorityClassName=system-cluster-critical",
        "--set",
        "imagePullSecrets[0].name=regcred",
        "--set",
        "operator.nodeSelector.kubernetes\\.io/os=linux",
        "--set",
        "operator.tolerations[0].key=dedicated",
        "--set",
        "operator.tolerations[0].operator=Exists",
        show_only=DEPLOY,
    )
    pod = deploy["spec"]["template"]["spec"]
    assert (
        pod["priorityClassName"],
        pod["imagePullSecrets"],
        pod["nodeSelector"],
        pod["tolerations"],
    ) == (
        "system-cluster-critical",
        [{"name": "regcred"}],
        {"kubernetes.io/os": "linux"},
        [{"key": "dedicated", "operator": "Exists"}],
    )


def test_digest_wins_over_tag(render):
    digest = "sha256:" + "b" * 64
    image = operator_container(render, "--set", f"image.digest={digest}")["image"]
    assert image == f"ghcr.io/kvoffload/kvoffload@{digest}"


# --- PodDisruptionBudget, monitoring, dashboard, policies --------------------------------------


def test_pdb_keeps_one_replica_when_there_are_two(render):
    pdb = one(render(), "PodDisruptionBudget")
    assert pdb["spec"]["minAvailable"] == 1


def test_pdb_selects_the_operator_pods(render):
    objs = render()
    labels = one(objs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    selector = one(objs, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"]
    assert selector.items() <= labels.items()


def test_no_pdb_with_a_single_replica(render):
    assert "PodDisruptionBudget" not in {o["kind"] for o in render("--set", "operator.replicas=1")}


def test_pdb_that_would_block_every_drain_is_refused(helm):
    result = helm(
        "template",
        "kv",
        str(CHART),
        "--set",
        "operator.replicas=2",
        "--set",
        "operator.podDisruptionBudget.minAvailable=2",
    )
    assert (
        result.returncode != 0 and "minAvailable must be below operator.replicas" in result.stderr
    )


def test_no_service_monitor_unless_enabled(render):
    kinds = {o["kind"] for o in render()}
    assert not kinds & {"ServiceMonitor", "PodMonitor"}


def test_service_monitor_scrapes_the_operator_metrics_port(render):
    objs = render("--set", "monitoring.serviceMonitor.enabled=true")
    monitor, service = one(objs, "ServiceMonitor"), one(objs, "Service")
    (endpoint,) = monitor["spec"]["endpoints"]
    (port,) = [p for p in service["spec"]["ports"] if p["name"] == endpoint["port"]]
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    assert port["port"] == 8080


def test_pod_monitor_scrapes_injected_sidecars_metrics_port(render):
    monitor = one(render("--set", "monitoring.podMonitor.enabled=true"), "PodMonitor")
    assert (monitor["spec"]["selector"], monitor["spec"]["podMetricsEndpoints"][0]["port"]) == (
        {"matchLabels": {"kvoffload.io/injected": "true"}},
        "metrics",
    )


def test_dashboard_configmap_carries_the_grafana_label_and_the_file(render):
    (cm,) = render(show_only="templates/dashboard.yaml")
    source = (CHART / "files" / "dashboards" / "kvoffload-sidecar.json").read_text()
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["data"]["kvoffload-sidecar.json"] == source.rstrip("\n")
    rendered = json.loads(cm["data"]["kvoffload-sidecar.json"])  # loads as rendered, too
    assert rendered["uid"] == "kvoffload-sidecar" and rendered["panels"]


def test_policies_from_values_render_as_custom_resources(render):
    objs = render(
        "--set",
        "policies[0].name=llama",
        "--set",
        "policies[0].namespace=inference",
        "--set",
        "policies[0].spec.selector.matchLabels.app=vllm",
        "--set-string",
        "policies[0].spec.pool.size=16Gi",
        show_only="templates/policies.yaml",
    )
    (policy,) = objs
    assert (
        policy["apiVersion"],
        policy["kind"],
        policy["metadata"]["namespace"],
        policy["spec"],
    ) == (
        "kvoffload.io/v1alpha1",
        "KVOffloadPolicy",
        "inference",
        {"selector": {"matchLabels": {"app": "vllm"}}, "pool": {"size": "16Gi"}},
    )


def test_rendered_policies_satisfy_the_crd_schema(render):
    jsonschema = pytest.importorskip("jsonschema")
    crd_file = REPO / "crds" / "kvoffloadpolicy.yaml"
    if not crd_file.exists():
        pytest.skip("crds/kvoffloadpolicy.yaml not written yet")
    import yaml

    crd = yaml.safe_load(crd_file.read_text())
    schema = _plain_json_schema(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"])
    (policy,) = render(
        "--set",
        "policies[0].name=llama",
        "--set",
        "policies[0].spec.selector.matchLabels.app=vllm",
        "--set-string",
        "policies[0].spec.pool.size=16Gi",
        show_only="templates/policies.yaml",
    )
    jsonschema.validate(policy, schema)
    policy["spec"]["pool"]["size"] = 16  # a number where the CRD wants a quantity string
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(policy, schema)


def _plain_json_schema(node: Any) -> Any:
    """Drop the x-kubernetes-* extensions (CEL etc.): what remains is plain JSON Schema."""
    if isinstance(node, dict):
        return {
            k: _plain_json_schema(v) for k, v in node.items() if not k.startswith("x-kubernetes-")
        }
    if isinstance(node, list):
        return [_plain_json_schema(v) for v in node]
    return node


# --- names ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "override", [("--set", "fullnameOverride=" + "x" * 63), ("--set", "nameOverride=" + "y" * 60)]
)
def test_long_names_are_truncated_to_63_and_keep_their_suffix(render, override):
    objs = render(*override)
    names = {o["kind"] + "/" + o["metadata"]["name"]: o["metadata"]["name"] for o in objs}
    assert all(len(n) <= 63 and not n.endswith("-") for n in names.values()), names
    assert one(objs, "Service")["metadata"]["name"].endswith("-webhook")


# --- kopf peering (replicas > 1) ----------------------------------------------------------------

PEERING = "templates/kopf-peering.yaml"


def test_peering_crds_ship_with_several_replicas_and_survive_uninstall(render):
    crds = [o for o in render(show_only=PEERING) if o["kind"] == "CustomResourceDefinition"]
    assert sorted(c["metadata"]["name"] for c in crds) == [
        "clusterkopfpeerings.kopf.dev",
        "kopfpeerings.kopf.dev",
    ]
    assert all(c["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep" for c in crds)


def test_peering_object_is_a_hook_named_like_the_peering_flag(render):
    objs = render()
    peering = one(objs, "ClusterKopfPeering")
    assert peering["metadata"]["annotations"]["helm.sh/hook"] == "post-install,post-upgrade"
    assert (
        flags(one(objs, "Deployment")["spec"]["template"]["spec"]["containers"][0])["--peering"]
        == (peering["metadata"]["name"])
    )


def test_namespace_scoped_peering_is_a_kopfpeering_in_the_watched_namespace(render):
    peering = one(render("--set", "operator.watchNamespace=inference"), "KopfPeering")
    assert peering["metadata"]["namespace"] == "inference"


def test_peering_crds_can_be_left_to_another_release(render):
    kinds = [o["kind"] for o in render("--set", "operator.peering.installCRDs=false")]
    assert "CustomResourceDefinition" not in kinds and "ClusterKopfPeering" in kinds


def test_single_replica_renders_no_peering(render):
    kinds = {o["kind"] for o in render("--set", "operator.replicas=1")}
    assert not kinds & {"CustomResourceDefinition", "ClusterKopfPeering", "KopfPeering"}


# --- the chart against the operator's own code --------------------------------------------------


@pytest.mark.parametrize(
    "extra",
    [
        (),
        ("--set", "operator.replicas=1"),
        CERT_MANAGER,
        ("--set", "operator.watchNamespace=inference"),
    ],
    ids=["default", "single-replica", "cert-manager", "namespace-scoped"],
)
def test_operator_parses_the_charts_arguments_into_the_charts_names(render, extra):
    """The operator's real argument parser reads the rendered args; each name it will use
    (Service, Secret, webhook configuration, ports, peering mode) is an object the chart renders."""
    settings = pytest.importorskip("kvoffload_operator.settings")
    objs = render(*extra)
    deploy = one(objs, "Deployment")
    container = deploy["spec"]["template"]["spec"]["containers"][0]
    config = settings.parse_operator_args(container["args"], environ={"POD_NAMESPACE": NS})
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert (
        config.service,
        config.webhook_port,
        config.metrics_port,
        config.health_port,
        str(config.cert_dir),
    ) == (
        one(objs, "Service")["metadata"]["name"],
        ports["webhook"],
        ports["metrics"],
        ports["health"],
        "/etc/kvoffload/webhook-certs",
    )
    assert config.standalone == (deploy["spec"]["replicas"] == 1)
    assert config.namespace == (None if not extra or "inference" not in extra[-1] else "inference")
    assert config.self_signed_certs == (extra != CERT_MANAGER)
    if config.self_signed_certs:  # the names it writes to must be the chart's objects
        tls_role = next(o for o in objs if o["kind"] == "Role" and "webhook-tls" in str(o))
        assert (config.cert_secret, config.webhook_config, config.policy_webhook_config) == (
            rules_of(tls_role)[("", "secrets#named")]["resourceNames"][0],
            one(objs, "MutatingWebhookConfiguration")["metadata"]["name"],
            one(objs, "ValidatingWebhookConfiguration")["metadata"]["name"],
        )


def test_chart_default_images_are_the_operators_defaults(render):
    inject = pytest.importorskip("kvoffload_operator.inject")
    args = flags(operator_container(render))
    defaults = inject.RenderDefaults()
    assert (args["--sidecar-image"], args["--connector-image"]) == (
        defaults.sidecar_image,
        defaults.connector_image,
    )


def test_app_version_is_the_package_version():
    tomllib = pytest.importorskip("tomllib")
    import yaml

    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert chart["appVersion"] == project["version"]


# --- NOTES.txt ----------------------------------------------------------------------------------


def _notes(helm, *args: str) -> str:
    result = helm("install", "kv", str(CHART), "--namespace", NS, "--dry-run=client", *args)
    assert result.returncode == 0, result.stderr
    return result.stdout.split("NOTES:", 1)[1]


def test_notes_name_the_deployment_and_the_opt_in_label(helm, render):
    notes = _notes(helm)
    deploy = one(render(), "Deployment")["metadata"]["name"]
    assert f"rollout status deployment/{deploy}" in notes
    assert "kubectl label namespace <your-namespace> kvoffload.io/injection=enabled" in notes


def test_notes_example_policy_satisfies_the_crd_schema(helm):
    jsonschema = pytest.importorskip("jsonschema")
    import yaml

    crd_file = REPO / "crds" / "kvoffloadpolicy.yaml"
    if not crd_file.exists():
        pytest.skip("crds/kvoffloadpolicy.yaml not written yet")
    crd = yaml.safe_load(crd_file.read_text())
    schema = _plain_json_schema(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"])
    body = _notes(helm).split("<<'POLICY'", 1)[1].split("POLICY\n", 2)[0]
    policy = yaml.safe_load("\n".join(line[5:] for line in body.splitlines()[1:]))
    assert policy["kind"] == "KVOffloadPolicy"
    jsonschema.validate(policy, schema)


def test_notes_say_which_tls_mode_is_active(helm):
    assert "TLS from cert-manager" in _notes(helm, "--set", "webhook.certManager.enabled=true")


def test_extra_object_selector_expressions_keep_the_built_in_exclusions(render):
    extra = {"key": "team", "operator": "In", "values": ["ml"]}
    hook = webhook(
        render,
        "--set", "webhook.objectSelectorExpressions[0].key=team",
        "--set", "webhook.objectSelectorExpressions[0].operator=In",
        "--set", "webhook.objectSelectorExpressions[0].values[0]=ml",
    )  # fmt: skip
    keys = [e["key"] for e in hook["objectSelector"]["matchExpressions"]]
    assert keys == ["app.kubernetes.io/name", "kvoffload.io/inject", "team"]
    assert hook["objectSelector"]["matchExpressions"][-1] == extra
