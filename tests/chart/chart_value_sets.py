"""Value sets the chart tests lint, render and validate (one list of helm flags each).

A plain module (not conftest) so test files can import it by a name no other suite uses.
"""

from __future__ import annotations

# Value sets rendered and linted; each is a list of `--set` arguments (string values use
# --set-string where the schema wants a string).
VALUE_SETS: dict[str, list[str]] = {
    "default": [],
    "cert-manager": ["--set", "webhook.certManager.enabled=true"],
    "cert-manager-cluster-issuer": [
        "--set",
        "webhook.certManager.enabled=true",
        "--set",
        "webhook.certManager.issuerRef.name=corp-ca",
        "--set",
        "webhook.certManager.issuerRef.kind=ClusterIssuer",
    ],
    "monitoring": [
        "--set",
        "monitoring.serviceMonitor.enabled=true",
        "--set",
        "monitoring.podMonitor.enabled=true",
        "--set-string",
        "monitoring.serviceMonitor.labels.release=prometheus",
    ],
    "single-replica": ["--set", "operator.replicas=1"],
    "node-agent": [
        "--set",
        "nodeAgent.enabled=true",
        "--set",
        "nodeAgent.pool.tenants[0].name=team-a",
        "--set",
        "nodeAgent.pool.tenants[0].shareBytes=68719476736",
        "--set",
        "nodeAgent.pool.tenants[0].namespaces[0]=team-a",
        "--set",
        "nodeAgent.pool.tenants[1].name=team-b",
        "--set",
        "nodeAgent.pool.tenants[1].shareBytes=1099511627776",
        "--set",
        "nodeAgent.pool.tenants[1].namespaces[0]=team-b",
        "--set",
        "nodeAgent.pool.tenants[1].serviceAccounts[0]=vllm",
    ],
    "namespace-scoped": ["--set", "operator.watchNamespace=inference"],
    "everything": [
        "--set",
        "operator.replicas=3",
        "--set",
        "webhook.certManager.enabled=true",
        "--set",
        "monitoring.serviceMonitor.enabled=true",
        "--set",
        "monitoring.podMonitor.enabled=true",
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
        "--set",
        "image.digest=sha256:" + "a" * 64,
        "--set",
        "policies[0].name=llama",
        "--set",
        "policies[0].namespace=inference",
        "--set",
        "policies[0].spec.selector.matchLabels.app=vllm",
        "--set-string",
        "policies[0].spec.pool.size=16Gi",
    ],
}
