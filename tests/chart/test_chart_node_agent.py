"""The node agent's chart objects: off by default; when on, a CSIDriver the agent can trust, a
DaemonSet that registers the plugin the standard way, and memory charged where the pool is
(the holder, which faults it)."""

from __future__ import annotations

from pathlib import Path

import pytest
from chart_value_sets import VALUE_SETS
from kvoffload_operator import agent_upgrade as au
from kvoffload_operator import settings
from kvoffload_sidecar.node.csi import DRIVER_NAME
from kvoffload_sidecar.node.grants import parse_node_pool

from tests.crds.test_node_pool_crd import validate

pytestmark = pytest.mark.process

TEMPLATE = "templates/node-agent.yaml"
ON = VALUE_SETS["node-agent"]
REPO = Path(__file__).resolve().parents[2]


def _kinds(objs) -> dict[str, dict]:
    return {o["kind"]: o for o in objs}


def test_the_default_install_has_no_node_agent(render) -> None:
    kinds = {o["kind"] for o in render()}
    assert not kinds & {"CSIDriver", "DaemonSet"}


def test_the_csidriver_is_ephemeral_only_and_passes_pod_info(render) -> None:
    driver = _kinds(render(*ON, show_only=TEMPLATE))["CSIDriver"]
    assert driver["metadata"]["name"] == DRIVER_NAME
    assert driver["spec"] == {
        "attachRequired": False,
        "podInfoOnMount": True,  # the agent's only source of a pod's identity
        "volumeLifecycleModes": ["Ephemeral"],
        "fsGroupPolicy": "File",
        "requiresRepublish": False,
        "storageCapacity": False,
    }


def test_the_daemonset_registers_the_plugin_and_charges_the_pool_to_the_agent(render) -> None:
    objs = _kinds(render(*ON, show_only=TEMPLATE))
    spec = objs["DaemonSet"]["spec"]["template"]["spec"]
    agent, registrar = spec["containers"]
    assert (agent["name"], registrar["name"]) == ("agent", "node-driver-registrar")
    assert registrar["args"] == [
        "--csi-address=/csi/csi.sock",
        f"--kubelet-registration-path=/var/lib/kubelet/plugins/{DRIVER_NAME}/csi.sock",
    ]
    assert agent["args"][0] == "node-agent"
    assert "--csi-socket=/csi/csi.sock" in agent["args"]
    assert "--attest-peers=cgroup" in agent["args"] and spec["hostPID"] is True
    # the holder faults the pool (64 GiB + 1 TiB of tenants, + 64 MiB of its own), the agent
    # only its own 256 MiB: requests equal limits, so the pool is charged where it is requested
    (holder,) = spec["initContainers"]
    assert holder["restartPolicy"] == "Always"  # a native sidecar: outlives agent restarts
    assert holder["args"][:2] == ["node-holder", "--socket=/run/kvoffload-holder/holder.sock"]
    assert "--prefault" in holder["args"]
    pool = str((64 << 30) + (1 << 40) + (64 << 20))
    assert holder["resources"]["requests"]["memory"] == pool
    assert holder["resources"]["limits"]["memory"] == pool
    assert agent["resources"]["requests"]["memory"] == str(256 << 20)
    assert agent["resources"]["limits"]["memory"] == str(256 << 20)
    assert "--holder-socket=/run/kvoffload-holder/holder.sock" in agent["args"]
    mounts = {m["name"]: m for m in agent["volumeMounts"]}
    assert mounts["pods-dir"]["mountPropagation"] == "Bidirectional"
    paths = {v["name"]: v.get("hostPath", {}).get("path") for v in spec["volumes"]}
    assert paths["registration-dir"] == "/var/lib/kubelet/plugins_registry"
    assert paths["pods-dir"] == "/var/lib/kubelet/pods"


def test_the_node_pool_object_holds_the_grants_the_agent_parses(render) -> None:
    obj = _kinds(render(*ON, show_only=TEMPLATE))["KVOffloadNodePool"]
    pool = parse_node_pool(obj)
    assert [(t.name, t.share_bytes, t.namespaces) for t in pool.tenants] == [
        ("team-a", 64 << 30, ("team-a",)),
        ("team-b", 1 << 40, ("team-b",)),
    ]
    assert pool.tenant("team-b").service_accounts == ("vllm",)
    assert validate(obj) == []  # what the CRD accepts
    agent = _kinds(render(*ON, show_only=TEMPLATE))["DaemonSet"]["spec"]["template"]["spec"]
    args = agent["containers"][0]["args"]
    assert f"--node-pool-name={obj['metadata']['name']}" in args
    assert f"--pool-bytes={(64 << 30) + (1 << 40)}" in args  # the holder's pool, less its own


def test_the_agent_may_read_its_pool_and_driver_and_patch_its_status_only(render) -> None:
    objs = render(*ON, show_only=TEMPLATE)
    kinds = _kinds(objs)
    role, binding, sa = kinds["ClusterRole"], kinds["ClusterRoleBinding"], kinds["ServiceAccount"]
    assert role["rules"] == [
        {
            "apiGroups": ["kvoffload.io"],
            "resources": ["kvoffloadnodepools"],
            "resourceNames": ["node-pool"],
            "verbs": ["get", "watch"],
        },
        {
            "apiGroups": ["kvoffload.io"],
            "resources": ["kvoffloadnodepools/status"],
            "resourceNames": ["node-pool"],
            "verbs": ["patch"],
        },
        {
            "apiGroups": ["storage.k8s.io"],
            "resources": ["csidrivers"],
            "resourceNames": [DRIVER_NAME],
            "verbs": ["get"],
        },
    ]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": "kvoffload-system"}
    ]
    pod = kinds["DaemonSet"]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == sa["metadata"]["name"]
    assert pod["automountServiceAccountToken"] is True


def test_every_node_agent_rule_says_why() -> None:
    lines = (REPO / "charts" / "kvoffload" / TEMPLATE).read_text().splitlines()
    rules = [n for n, line in enumerate(lines) if line.strip().startswith("- apiGroups:")]
    assert len(rules) == 3
    for n in rules:
        assert lines[n - 1].strip().startswith("#"), f"{TEMPLATE}:{n + 1}: a rule without a reason"


def test_a_node_pool_without_tenants_does_not_render(helm) -> None:
    result = helm(
        "template", "kv", str(REPO / "charts" / "kvoffload"), "--set", "nodeAgent.enabled=true"
    )
    assert result.returncode != 0
    assert "at least one tenant" in result.stderr


def test_attestation_off_drops_host_pid(render) -> None:
    objs = _kinds(render(*ON, "--set", "nodeAgent.attestPeers=off", show_only=TEMPLATE))
    spec = objs["DaemonSet"]["spec"]["template"]["spec"]
    assert "hostPID" not in spec
    assert "--attest-peers=off" in spec["containers"][0]["args"]


def test_the_agent_serves_metrics_on_its_port_and_its_pod_monitor_scrapes_it(render) -> None:
    """`nodeAgent.metrics.port` is the agent's `--metrics-listen` and its containerPort
    `metrics`; the node agents' PodMonitor selects the DaemonSet's pods (only them: not the
    operator's, not the injected sidecars') in the release namespace and scrapes that port."""
    objs = render(*ON)
    (ds,) = [o for o in objs if o["kind"] == "DaemonSet"]
    pod = ds["spec"]["template"]
    agent = pod["spec"]["containers"][0]
    assert "--metrics-listen=0.0.0.0:9401" in agent["args"]
    assert agent["ports"] == [{"name": "metrics", "containerPort": 9401, "protocol": "TCP"}]
    monitors = {o["metadata"]["name"]: o for o in objs if o["kind"] == "PodMonitor"}
    monitor = monitors["kv-kvoffload-node-agent"]
    assert monitor["metadata"]["namespace"] == "kvoffload-system"
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["kvoffload-system"]}
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= pod["metadata"]["labels"].items()
    assert selector["app.kubernetes.io/component"] == "node-agent"
    (deployment,) = [o for o in objs if o["kind"] == "Deployment"]
    assert not selector.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert (endpoint["port"], endpoint["path"], endpoint["interval"]) == ("metrics", "/metrics",
                                                                          "15s")  # fmt: skip
    assert "kv-kvoffload-sidecars" not in monitors  # the sidecars' PodMonitor is its own switch


def test_metrics_port_zero_serves_none_and_a_pod_monitor_then_does_not_render(helm, render) -> None:
    off = [
        "--set",
        "nodeAgent.metrics.port=0",
        "--set",
        "monitoring.nodeAgentPodMonitor.enabled=false",
    ]
    agent = _kinds(render(*ON, *off, show_only=TEMPLATE))["DaemonSet"]["spec"]["template"]["spec"][
        "containers"
    ][0]
    assert "ports" not in agent
    assert not any(a.startswith("--metrics-listen") for a in agent["args"])
    chart = str(REPO / "charts" / "kvoffload")
    no_port = helm("template", "kv", chart, *ON, "--set", "nodeAgent.metrics.port=0")
    assert no_port.returncode != 0 and "needs nodeAgent.metrics.port" in no_port.stderr
    no_agent = helm("template", "kv", chart, "--set", "monitoring.nodeAgentPodMonitor.enabled=true")
    assert no_agent.returncode != 0 and "needs nodeAgent.enabled" in no_agent.stderr


def _upgrade_parts(objs) -> tuple[dict, list[str], list[dict]]:
    """(the DaemonSet, the operator's args, the upgrade Role and RoleBinding)."""
    (ds,) = [o for o in objs if o["kind"] == "DaemonSet"]
    (deployment,) = [o for o in objs if o["kind"] == "Deployment"]
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    rbac = [o for o in objs if o["kind"] in ("Role", "RoleBinding")
            and o["metadata"]["name"].endswith("-agent-upgrade")]  # fmt: skip
    return ds, args, rbac


def test_in_place_upgrade_is_the_default_and_the_operator_may_patch_only_its_pods(render) -> None:
    """nodeAgent.upgrade=inPlace (the default): the DaemonSet never replaces its pods (OnDelete)
    and carries the label the operator checks; the operator gets its name and, in the release
    namespace only, get on it by name, list/patch on pods and create on events."""
    objs = render(*ON)
    ds, args, rbac = _upgrade_parts(objs)
    assert ds["spec"]["updateStrategy"] == {"type": "OnDelete"}
    assert ds["metadata"]["labels"][au.LABEL] == au.IN_PLACE
    name = ds["metadata"]["name"]
    config = settings.parse_operator_args(args, environ={"POD_NAMESPACE": "kvoffload-system"})
    assert (config.agent_daemonset, config.pod_namespace) == (name, ds["metadata"]["namespace"])
    assert au.in_place(ds) and au.template_agent(ds)["name"] == au.AGENT
    role, binding = sorted(rbac, key=lambda o: o["kind"])
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == "kvoffload-system"
    assert role["rules"] == [
        {"apiGroups": ["apps"], "resources": ["daemonsets"], "resourceNames": [name],
         "verbs": ["get"]},
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "patch"]},
        {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
    ]  # fmt: skip
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": role["metadata"]["name"]}  # fmt: skip
    (deployment,) = [o for o in objs if o["kind"] == "Deployment"]
    account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account, "namespace": "kvoffload-system"}
    ]
    # no ClusterRole reaches DaemonSets, and pods only through the namespace ClusterRole
    for o in objs:
        if o["kind"] == "ClusterRole":
            assert not any("daemonsets" in r["resources"] for r in o["rules"])
            assert not any("patch" in r["verbs"] and "pods" in r["resources"] for r in o["rules"])


def test_rollout_upgrade_keeps_the_rolling_update_and_grants_nothing(render) -> None:
    ds, args, rbac = _upgrade_parts(render(*ON, "--set", "nodeAgent.upgrade=rollout"))
    assert ds["spec"]["updateStrategy"] == {"type": "RollingUpdate",
                                           "rollingUpdate": {"maxUnavailable": 1}}  # fmt: skip
    assert au.LABEL not in ds["metadata"]["labels"] and not au.in_place(ds)
    assert not any(a.startswith("--agent-daemonset") for a in args)
    assert rbac == []


def test_no_node_agent_no_upgrade_flag_or_role(render) -> None:
    objs = render()
    (deployment,) = [o for o in objs if o["kind"] == "Deployment"]
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert not any(a.startswith("--agent-daemonset") for a in args)
    assert not [o for o in objs if o["metadata"]["name"].endswith("-agent-upgrade")]


def test_an_unknown_upgrade_mode_is_refused_naming_the_field(helm) -> None:
    chart = str(REPO / "charts" / "kvoffload")
    result = helm("template", "kv", chart, *ON, "--set", "nodeAgent.upgrade=recreate")
    assert result.returncode != 0
    assert "at '/nodeAgent/upgrade'" in result.stdout + result.stderr
