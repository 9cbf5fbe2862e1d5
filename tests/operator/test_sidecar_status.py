"""The sidecars' Stats in the policy status: folding (pure), the bounded prober (fake and real
sources) and the merge patch that drops vanished map keys."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from kvoffload_operator import annotations as ann
from kvoffload_operator.handlers import status_patch
from kvoffload_operator.inject import SIDECAR_NAME
from kvoffload_operator.policy import policy_from_resource
from kvoffload_operator.sidecar_reports import (
    ConnectorState,
    SidecarReport,
    parse_connector_status,
)
from kvoffload_operator.sidecar_stats import (
    GrpcStatsSource,
    StatsAnswer,
    probe_sidecars,
    stats_target,
)
from kvoffload_operator.status import (
    _degraded,
    build_status,
    degraded_counts,
    degraded_problems,
    event_for,
)

from tests.operator.harness import free_port
from tests.sidecar.procs import sidecar_process, socket_dir

POLICY = policy_from_resource(
    {
        "kind": "KVOffloadPolicy",
        "metadata": {"name": "cache", "namespace": "ns", "generation": 2},
        "spec": {"selector": {"matchLabels": {"app": "vllm"}}, "pool": {"size": "1Gi"}},
    }
)
DISABLED = json.dumps(
    [
        {"state": "disabled", "reason": "Mamba models are not supported", "role": "scheduler"},
        {"state": "active", "reason": "", "role": "worker", "rank": 0},
        {
            "state": "disabled",
            "reason": "Mamba models are not supported",
            "role": "worker",
            "rank": 1,
        },
    ]
)


def pod(
    name: str,
    *,
    ip: str | None = "10.0.0.1",
    phase: str = "Running",
    started: bool = True,
    waiting: str | None = None,
    port: int | None = None,
) -> dict[str, Any]:
    sidecar: dict[str, Any] = {"name": SIDECAR_NAME, "started": started, "ready": started}
    if waiting:
        sidecar["state"] = {"waiting": {"reason": waiting, "message": "pull access denied"}}
    spec: dict[str, Any] = {"containers": [{"name": "vllm"}]}
    if port is not None:
        spec["initContainers"] = [
            {"name": SIDECAR_NAME, "ports": [{"name": "grpc-health", "containerPort": port}]}
        ]
    status: dict[str, Any] = {"phase": phase, "initContainerStatuses": [sidecar]}
    if ip:
        status["podIP"] = ip
    return {
        "metadata": {
            "name": name,
            "namespace": "ns",
            "uid": f"uid-{name}",
            "labels": {"app": "vllm"},
            "annotations": {
                ann.STATUS: json.dumps({"policy": "cache", "vllmContainer": "vllm"}),
                ann.POLICY: "cache",
            },
        },
        "spec": spec,
        "status": status,
    }


def report(name: str, reason: str = "", connectors: str = "[]", up: bool = True) -> SidecarReport:
    return SidecarReport(
        name,
        "ns",
        f"uid-{name}",
        up,
        degraded_reason=reason,
        connectors=parse_connector_status(connectors),
        vllm_container="vllm",
    )


def conditions(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in status["conditions"]}


def test_pool_unavailable_and_connector_disabled_fold_into_degraded() -> None:
    pods = [pod("healthy"), pod("nopool"), pod("off"), pod("dark")]
    reports = [
        report("healthy", connectors='[{"state": "active", "role": "scheduler"}]'),
        report("nopool", reason="NUMA node 999 does not exist", connectors=DISABLED),
        report("off", connectors=DISABLED),
        report("dark", up=False),
    ]
    status = build_status(POLICY, pods, [POLICY], namespace_enabled=True, now="t", reports=reports)
    degraded = conditions(status)["Degraded"]
    assert (degraded["status"], degraded["reason"]) == ("True", "PoolUnavailable")
    assert degraded["message"] == (
        "2 injected pod(s) serve without the kvoffload pool: "
        "nopool (PoolUnavailable: NUMA node 999 does not exist), "
        "off (ConnectorDisabled: scheduler: Mamba models are not supported; "
        "worker rank 1: Mamba models are not supported)"
    )
    # the pool's reason hides the connectors it turned off; an unreachable sidecar is no cause
    assert status["degradedPods"] == 2
    assert status["degradedReasons"] == {"ConnectorDisabled": 1, "PoolUnavailable": 1}
    assert status["unreachableSidecars"] == 1
    # only disabled connectors: that reason
    only_off = build_status(
        POLICY, pods, [POLICY], namespace_enabled=True, now="t", reports=reports[2:]
    )
    assert conditions(only_off)["Degraded"]["reason"] == "ConnectorDisabled"
    healthy = build_status(
        POLICY, pods, [POLICY], namespace_enabled=True, now="t", reports=reports[:1]
    )
    assert conditions(healthy)["Degraded"]["status"] == "False"
    assert (healthy["degradedPods"], healthy["degradedReasons"]) == (0, {})


SEED_NOTE = (
    "PYTHONHASHSEED is unset and this vLLM seeds its sha256 block hashes per process: pool "
    "hits last this engine's life, a restarted engine will not find what it stored (set "
    "PYTHONHASHSEED to any fixed value in the engine's environment)"
)


def test_connector_notes_fold_into_limited_and_not_into_degraded() -> None:
    """A pod whose connector serves with the pool under a noted limit is named in Limited,
    each note once per pod (scheduler and worker may both write it); it is not Degraded."""
    noted = json.dumps(
        [
            {"state": "active", "role": "scheduler", "notes": [SEED_NOTE]},
            {"state": "active", "role": "worker", "rank": 0, "notes": [SEED_NOTE, 7, ""]},
        ]
    )
    pods = [pod(f"p{i}") for i in range(7)]
    reports = [report(f"p{i}", connectors=noted) for i in range(6)] + [report("p6")]
    status = build_status(POLICY, pods, [POLICY], namespace_enabled=True, now="t", reports=reports)
    limited = conditions(status)["Limited"]
    assert (limited["status"], limited["reason"]) == ("True", "ConnectorNotes")
    assert limited["message"].startswith("6 injected pod(s) use the pool under a limit: p0 (")
    assert limited["message"].endswith(" and 1 more")
    assert limited["message"].count("PYTHONHASHSEED is unset") == 5  # one per named pod
    assert status["notedPods"] == 6
    assert conditions(status)["Degraded"]["status"] == "False" and status["degradedPods"] == 0
    clear = build_status(POLICY, pods, [POLICY], namespace_enabled=True, now="t", reports=[])
    assert (conditions(clear)["Limited"]["status"], clear["notedPods"]) == ("False", 0)
    # a report of a pod this policy did not inject is not this policy's limit
    other = build_status(
        POLICY, pods[:1], [POLICY], namespace_enabled=True, now="t", reports=reports[1:2]
    )
    assert other["notedPods"] == 0


def test_failing_containers_take_precedence_and_hide_that_pods_stats() -> None:
    pods = [pod("nopool"), pod("pull", waiting="ImagePullBackOff", started=False)]
    reports = [
        report("nopool", reason="no hugepages"),
        report("pull", reason="stale answer"),  # a blocked pod: its Stats are not a cause
    ]
    problems = degraded_problems(pods, reports)
    assert [(p.pod, p.reason) for p in problems] == [
        ("pull", "ImagePullBackOff"),
        ("nopool", "PoolUnavailable"),
    ]
    status, reason, message = _degraded(problems)
    assert (status, reason) == ("True", "ImagePullFailed")
    assert message == (
        "2 injected pod(s) cannot run a kvoffload container: "
        "pull (kvoffload-sidecar: ImagePullBackOff), nopool (PoolUnavailable: no hugepages)"
    )
    assert degraded_counts(problems) == (2, {"ImagePullBackOff": 1, "PoolUnavailable": 1})


def test_message_names_five_pods_and_counts_the_rest_and_stats_of_other_pods_are_ignored() -> None:
    pods = [pod(f"p{i}") for i in range(7)]
    reports = [report(f"p{i}", reason="x" * 500) for i in range(7)] + [report("gone", "y")]
    problems = degraded_problems(pods, reports)
    assert len(problems) == 7  # "gone" is not among the injected pods any more
    message = _degraded(problems)[2]
    assert message.endswith(" and 2 more") and message.count("PoolUnavailable") == 5
    assert "x" * 157 + "..." in message and "x" * 158 not in message


def test_events_say_what_the_pod_loses() -> None:
    nopool, off = degraded_problems(
        [pod("a"), pod("b")],
        [report("a", reason="NUMA node 999 does not exist"), report("b", connectors=DISABLED)],
    )
    reason, message = event_for(nopool)
    assert reason == "KVOffloadPoolUnavailable"
    assert message.startswith("kvoffload sidecar serves without a pool: NUMA node 999 does not")
    assert nopool.field_path == "spec.initContainers{kvoffload-sidecar}"
    reason, message = event_for(off)
    assert reason == "KVOffloadConnectorDisabled"
    assert "scheduler: Mamba models are not supported" in message
    assert off.field_path == "spec.containers{vllm}"
    assert nopool.key != off.key


@pytest.mark.parametrize("text", ["", "garbage", "{}", "[1, null]", '[{"rank": true}]', '"x"'])
def test_connector_status_garbage_is_tolerated(text: str) -> None:
    parsed = parse_connector_status(text)
    assert all(c.rank is None for c in parsed)
    assert not any(c.state == "disabled" for c in parsed)


def test_connector_state_describe() -> None:
    assert ConnectorState("disabled", "why", "worker", 3).describe() == "worker rank 3: why"
    assert ConnectorState("disabled").describe() == "connector: disabled"


def test_stats_target_needs_a_running_pod_with_an_ip_and_a_started_sidecar() -> None:
    assert stats_target(pod("a")) == "10.0.0.1:9400"
    assert stats_target(pod("a", port=19400)) == "10.0.0.1:19400"
    assert stats_target(pod("a", ip="fd00::5")) == "[fd00::5]:9400"
    assert stats_target(pod("a", ip=None)) is None
    assert stats_target(pod("a", phase="Pending")) is None
    assert stats_target(pod("a", started=False)) is None


class FakeSource:
    """Answers per target; "hang" sleeps past the budget, "fail" raises."""

    def __init__(self, answers: dict[str, Any]) -> None:
        self.answers = answers
        self.running = 0
        self.most = 0
        self.lock = threading.Lock()

    def stats(self, target: str, timeout: float) -> StatsAnswer:
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
        try:
            answer = self.answers[target]
            if answer == "hang":
                time.sleep(3)
            if isinstance(answer, StatsAnswer):
                time.sleep(0.05)
                return answer
            raise ConnectionError(f"{target}: unreachable")
        finally:
            with self.lock:
                self.running -= 1


def test_probe_is_bounded_and_counts_failures_as_unreachable() -> None:
    pods = [pod(f"p{i}", ip=f"10.0.0.{i}") for i in range(1, 41)]
    pods.append(pod("pending", ip=None))
    answers: dict[str, Any] = {f"10.0.0.{i}:9400": StatsAnswer("", "[]") for i in range(1, 41)}
    answers["10.0.0.1:9400"] = StatsAnswer("no space", "[]")
    answers["10.0.0.2:9400"] = "fail"
    answers["10.0.0.3:9400"] = "hang"
    source = FakeSource(answers)
    began = time.monotonic()
    reports = probe_sidecars(pods, source, timeout=0.5, concurrency=8, budget=1.0)
    assert time.monotonic() - began < 2.0  # the hanging call does not hold the refresh
    assert len(reports) == 40  # the pod without an IP is not asked
    assert source.most <= 8
    by_name = {r.pod: r for r in reports}
    assert by_name["p1"].degraded_reason == "no space" and by_name["p1"].reachable
    assert not by_name["p2"].reachable and not by_name["p3"].reachable
    assert sum(not r.reachable for r in reports) == 2


def test_status_patch_nulls_vanished_map_keys() -> None:
    old = {"skipped": {"a": 1, "b": 2}, "degradedReasons": {"PoolUnavailable": 1}, "x": 1}
    new = {"skipped": {"a": 1}, "degradedReasons": {}, "x": 2, "conditions": []}
    assert status_patch(old, new) == {
        "skipped": {"b": None, "a": 1},
        "degradedReasons": {"PoolUnavailable": None},
        "x": 2,
        "conditions": [],
    }
    # a stale body (the watch has not brought the last patch back yet) lacks the key that
    # patch stored: the last status sent still nulls it
    stale = {"degradedReasons": {}}
    sent = {"degradedReasons": {"ConnectorDisabled": 1}}
    patch = status_patch(stale, {"degradedReasons": {}}, sent)
    assert patch == {"degradedReasons": {"ConnectorDisabled": None}}
    assert status_patch(stale, {"degradedReasons": {}}) == {"degradedReasons": {}}


@pytest.mark.process
@pytest.mark.timeout(120)
def test_grpc_source_reads_a_real_degraded_sidecar_over_tcp(tmp_path: Path) -> None:
    port = free_port()
    with (
        socket_dir() as sock_dir,
        sidecar_process(
            tmp_path,
            sock_dir,
            "--on-pool-error",
            "degrade",
            "--numa-node",
            "999",
            "--listen",
            f"127.0.0.1:{port}",
            ready_timeout=20,
        ),
    ):
        (sock_dir / "connector-status-scheduler-0.json").write_text(
            json.dumps({"state": "disabled", "reason": "pool refused", "role": "scheduler"})
        )
        (sock_dir / "connector-status-worker-0.json").write_text(
            json.dumps({"state": "active", "role": "worker", "rank": 0, "notes": [SEED_NOTE]})
        )
        (answer,) = probe_sidecars(
            [pod("a", ip="127.0.0.1", port=port)], GrpcStatsSource(), timeout=2.0
        )
    assert answer.reachable and "999" in answer.degraded_reason
    assert answer.disabled_connectors == (ConnectorState("disabled", "pool refused", "scheduler"),)
    # an active connector's notes travel through the sidecar's Stats to the policy status
    assert answer.connector_notes == (SEED_NOTE,)
    status = build_status(
        POLICY, [pod("a")], [POLICY], namespace_enabled=True, now="t", reports=[answer]
    )
    assert status["notedPods"] == 1
    assert conditions(status)["Limited"]["reason"] == "ConnectorNotes"
    # nothing listens there any more: unreachable within the deadline
    began = time.monotonic()
    (gone,) = probe_sidecars([pod("a", ip="127.0.0.1", port=port)], GrpcStatsSource(), timeout=1.0)
    assert not gone.reachable and time.monotonic() - began < 3.0


def _pending(name: str, message: str) -> dict[str, Any]:
    p = pod(name, ip=None, phase="Pending", started=False)
    p["status"]["conditions"] = [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message}
    ]
    return p


def test_a_pod_no_node_fits_with_the_sidecars_memory_is_degraded_unschedulable() -> None:
    short = "0/3 nodes are available: 3 Insufficient memory. preemption: 0/3 nodes are available."
    pods = [
        _pending("big", short),
        # short of GPUs: not what the sidecar adds, not our cause
        _pending("gpu", "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."),
        pod("fine"),
    ]
    problems = degraded_problems(pods, [report("fine")])
    assert [(p.pod, p.reason, p.container) for p in problems] == [
        ("big", "Unschedulable", SIDECAR_NAME)
    ]
    status, reason, message = _degraded(problems)
    assert (status, reason) == ("True", "Unschedulable")
    assert message == (
        "1 injected pod(s) cannot be scheduled with the kvoffload sidecar's resources: "
        f"big (Unschedulable: {short})"
    )
    event, text = event_for(problems[0])
    assert event == "KVOffloadUnschedulable" and "Insufficient memory" in text
    assert (
        "pool size" in text and problems[0].field_path == "spec.initContainers{kvoffload-sidecar}"
    )
    # with a failing image too, the reason is the generic one and both pods are named
    both = degraded_problems([*pods, pod("pull", waiting="ErrImagePull", started=False)], [])
    assert _degraded(both)[1] == "ContainerFailing" and degraded_counts(both)[0] == 2
    # once scheduled (Running), the same old condition message is no cause
    running = _pending("big", short)
    running["status"]["phase"] = "Running"
    assert degraded_problems([running], []) == []
    full = build_status(
        POLICY, pods, [POLICY], namespace_enabled=True, now="t", reports=[report("fine")]
    )
    assert conditions(full)["Degraded"]["reason"] == "Unschedulable"
    assert full["degradedReasons"] == {"Unschedulable": 1}
