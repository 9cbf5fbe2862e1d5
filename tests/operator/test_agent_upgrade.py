"""The in-place agent upgrade's decision and patches (pure: `agent_upgrade`), and one round of
the operator's loop (`agent_upgrader.upgrade_once`) against a recording fake API."""

from __future__ import annotations

import datetime
import json
from dataclasses import replace
from typing import Any

import jsonpatch
import pytest
from kvoffload_operator import agent_upgrade as au
from kvoffload_operator.agent_upgrader import upgrade_once
from kvoffload_operator.k8s import ApiError
from kvoffload_operator.settings import OperatorConfig

NOW = datetime.datetime(2026, 1, 1, 12, 0, tzinfo=datetime.timezone.utc)
REPO = "registry.example/kvoffload"
OLD, NEW = f"{REPO}:0.1.0", f"{REPO}:0.2.0"
ARGS = ["node-agent", "--csi-socket=/csi/csi.sock"]
DS_UID = "ds-uid"


def daemonset(image: str = NEW, *, strategy: str = "OnDelete", label: bool = True) -> dict:
    labels = {au.LABEL: au.IN_PLACE} if label else {}
    return {
        "metadata": {"name": "kv-node-agent", "uid": DS_UID, "labels": labels},
        "spec": {
            "selector": {"matchLabels": {"app.kubernetes.io/component": "node-agent"}},
            "updateStrategy": {"type": strategy},
            "template": {
                "spec": {
                    "initContainers": [{"name": "holder", "image": image}],
                    "containers": [
                        {"name": "agent", "image": image, "args": ARGS},
                        {"name": "node-driver-registrar", "image": "registrar:v2"},
                    ],
                }
            },
        },
    }


def pod(
    name: str,
    node: str,
    image: str = OLD,
    *,
    running: str | None = None,
    ready: bool = True,
    upgrade: dict | None = None,
    owner: str = DS_UID,
    args: list[str] = ARGS,
) -> dict:
    annotations = {"kubectl.kubernetes.io/default-container": "agent"}
    if upgrade is not None:
        annotations[au.ANNOTATION] = json.dumps(upgrade)
    state = {"running": {"startedAt": "2026-01-01T00:00:00Z"}} if ready else {"waiting": {}}
    return {
        "metadata": {
            "name": name,
            "annotations": annotations,
            "ownerReferences": [{"uid": owner, "controller": True, "kind": "DaemonSet"}],
        },
        "spec": {
            "nodeName": node,
            "initContainers": [{"name": "holder", "image": OLD, "restartPolicy": "Always"}],
            "containers": [
                {"name": "node-driver-registrar", "image": "registrar:v2"},
                {"name": "agent", "image": image, "args": args},
            ],
        },
        "status": {
            "containerStatuses": [
                {"name": "node-driver-registrar", "image": "registrar:v2", "ready": True},
                {
                    "name": "agent",
                    "image": running if running is not None else image,
                    "imageID": "",
                    "ready": ready,
                    "state": state,
                },
            ]
        },
    }


def since(seconds_ago: float) -> str:
    return (NOW - datetime.timedelta(seconds=seconds_ago)).isoformat()


def step(*pods: dict, ds: dict | None = None, timeout: float = 60.0) -> au.Step:
    return au.next_step(ds or daemonset(), list(pods), NOW, timeout)


# --- the decision ---------------------------------------------------------------------------
def test_the_first_outdated_pod_by_node_is_patched() -> None:
    s = step(pod("b", "node-2"), pod("a", "node-1"))
    assert (s.action, s.pod.name, s.image) == ("patch", "a", NEW)
    assert s.pod.index == 1  # the agent, not the registrar before it


def test_a_patched_pod_not_back_yet_is_waited_for_and_no_other_is_patched() -> None:
    upgrading = {"image": NEW, "since": since(10)}
    # spec changed, the kubelet still reports the old container
    s = step(pod("a", "node-1", NEW, running=OLD, upgrade=upgrading), pod("b", "node-2"))
    assert (s.action, s.pod.name) == ("wait", "a")
    # the new container started, not ready yet
    s = step(pod("a", "node-1", NEW, ready=False, upgrade=upgrading), pod("b", "node-2"))
    assert (s.action, s.pod.name) == ("wait", "a")


def test_a_pod_back_with_the_new_image_is_finished_and_the_next_patched() -> None:
    upgrading = {"image": NEW, "since": since(10)}
    s = step(pod("a", "node-1", NEW, upgrade=upgrading), pod("b", "node-2"))
    assert [p.name for p in s.finished] == ["a"]
    assert (s.action, s.pod.name) == ("patch", "b")


def test_a_pod_not_back_within_the_timeout_stalls_the_upgrade() -> None:
    late = {"image": NEW, "since": since(61)}
    s = step(pod("a", "node-1", NEW, ready=False, upgrade=late), pod("b", "node-2"))
    assert (s.action, s.pod.name) == ("stalled", "a")
    stalled = {**late, "stalled": since(1)}  # reported once: still stalled, nothing patched
    s = step(pod("a", "node-1", NEW, ready=False, upgrade=stalled), pod("b", "node-2"))
    assert (s.action, s.pod.name) == ("stalled", "a")
    # it comes back after all: finished, and the upgrade goes on
    s = step(pod("a", "node-1", NEW, upgrade=stalled), pod("b", "node-2"))
    assert ([p.name for p in s.finished], s.action, s.pod.name) == (["a"], "patch", "b")


def test_done_pods_are_left_alone_and_all_current_is_done() -> None:
    done = {"image": NEW, "since": since(100), "done": since(90)}
    s = step(pod("a", "node-1", NEW, upgrade=done), pod("b", "node-2", NEW))
    assert (s.action, s.finished) == ("done", ())


def test_a_new_pod_the_controller_starts_is_not_waited_for() -> None:
    """A pod the DaemonSet made with the new image (a new node) is none of the operator's:
    still starting, it holds up no upgrade."""
    s = step(pod("new", "node-0", NEW, ready=False), pod("b", "node-2"))
    assert (s.action, s.pod.name) == ("patch", "b")


def test_the_template_changing_again_mid_upgrade_patches_towards_the_newest() -> None:
    upgrading = {"image": NEW, "since": since(10)}
    s = step(
        pod("a", "node-1", NEW, running=OLD, upgrade=upgrading),
        ds=daemonset(f"{REPO}:0.3.0"),
    )
    assert (s.action, s.pod.name, s.image) == ("patch", "a", f"{REPO}:0.3.0")


def test_changed_args_block_the_in_place_upgrade() -> None:
    s = step(pod("a", "node-1", args=["node-agent", "--older-flag"]))
    assert (s.action, s.pod.name) == ("blocked", "a")
    assert "args" in s.reason


@pytest.mark.parametrize(
    "ds",
    [daemonset(strategy="RollingUpdate"), daemonset(label=False)],
    ids=["rolling-update", "no-label"],
)
def test_only_an_in_place_on_delete_daemonset_is_upgraded(ds: dict) -> None:
    assert step(pod("a", "node-1"), ds=ds).action == "done"


def test_only_the_daemonsets_own_pods_and_not_deleting_ones() -> None:
    other = pod("x", "node-0", owner="another-uid")
    deleting = pod("y", "node-0")
    deleting["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert step(other, deleting).action == "done"


@pytest.mark.parametrize(
    ("reported", "image_id", "wanted", "matches"),
    [
        ("kvoffload:1", "", "kvoffload:1", True),
        ("docker.io/library/kvoffload:1", "", "kvoffload:1", True),
        ("docker.io/team/kvoffload:1", "", "team/kvoffload:1", True),
        ("docker.io/library/kvoffload:latest", "", "kvoffload", True),
        ("localhost:5000/kvoffload:1", "", "localhost:5000/kvoffload:1", True),
        ("kvoffload:1", "", "kvoffload:2", False),
        ("other.example/kvoffload:1", "", "registry.example/kvoffload:1", False),
        ("sha256:abc", f"{REPO}@sha256:d1", f"{REPO}@sha256:d1", True),
        (f"{REPO}:1", f"{REPO}@sha256:d0", f"{REPO}@sha256:d1", False),
        ("", "", "kvoffload:1", False),
    ],
)
def test_image_matches(reported: str, image_id: str, wanted: str, matches: bool) -> None:
    assert au.image_matches(reported, image_id, wanted) is matches


# --- the patches ----------------------------------------------------------------------------
def test_the_image_patch_changes_the_agent_image_and_annotates_only() -> None:
    body = pod("a", "node-1")
    agent = au.agent_pod(body)
    ops = au.image_patch(agent, NEW, NOW)
    patched = jsonpatch.apply_patch(body, ops)
    assert patched["spec"]["containers"][1]["image"] == NEW
    assert patched["spec"]["containers"][0] == body["spec"]["containers"][0]
    assert patched["spec"]["initContainers"] == body["spec"]["initContainers"]  # the holder
    progress = json.loads(patched["metadata"]["annotations"][au.ANNOTATION])
    assert progress == {"image": NEW, "since": "2026-01-01T12:00:00+00:00"}
    rest = {k: v for k, v in patched.items() if k not in ("spec", "metadata")}
    assert rest == {k: v for k, v in body.items() if k not in ("spec", "metadata")}
    # the container moved or its image changed meanwhile: the patch applies nothing
    moved = json.loads(json.dumps(body))
    moved["spec"]["containers"].reverse()
    with pytest.raises(jsonpatch.JsonPatchTestFailed):
        jsonpatch.apply_patch(moved, ops)
    other = json.loads(json.dumps(body))
    other["spec"]["containers"][1]["image"] = f"{REPO}:9"
    with pytest.raises(jsonpatch.JsonPatchTestFailed):
        jsonpatch.apply_patch(other, ops)


def test_a_pod_without_annotations_gets_the_map() -> None:
    body = pod("a", "node-1")
    del body["metadata"]["annotations"]
    patched = jsonpatch.apply_patch(body, au.image_patch(au.agent_pod(body), NEW, NOW))
    assert json.loads(patched["metadata"]["annotations"][au.ANNOTATION])["image"] == NEW


def test_marking_tests_the_value_read_so_one_replica_marks() -> None:
    body = pod("a", "node-1", NEW, upgrade={"image": NEW, "since": since(5)})
    ops = au.mark_patch(au.agent_pod(body), "done", NOW)
    marked = jsonpatch.apply_patch(body, ops)
    assert json.loads(marked["metadata"]["annotations"][au.ANNOTATION])["done"]
    with pytest.raises(jsonpatch.JsonPatchTestFailed):  # another replica marked it first
        jsonpatch.apply_patch(marked, ops)


# --- one round of the loop ------------------------------------------------------------------
class FakeApi:
    """The DaemonSet and pods in memory; JSON patches applied (a failed test is a 422)."""

    def __init__(self, ds: dict, pods: list[dict]) -> None:
        self.ds, self.pods = ds, {p["metadata"]["name"]: p for p in pods}
        self.events: list[tuple[str, str, str, str]] = []
        self.patched: list[str] = []

    def read_daemonset(self, namespace: str, name: str) -> dict | None:
        return self.ds if name == self.ds["metadata"]["name"] else None

    def list_pods(self, namespace: str, selector: str) -> list[dict]:
        assert selector == "app.kubernetes.io/component=node-agent"
        return [json.loads(json.dumps(p)) for p in self.pods.values()]

    def json_patch_pod(self, namespace: str, name: str, ops: list[dict[str, Any]]) -> None:
        try:
            self.pods[name] = jsonpatch.apply_patch(self.pods[name], ops)
        except jsonpatch.JsonPatchTestFailed:
            raise ApiError(status=422, reason="Unprocessable Entity") from None
        self.patched.append(name)

    def post_event(self, namespace, involved, type_, reason, message, now) -> None:  # noqa: ANN001
        assert involved["kind"] == "DaemonSet" and involved["uid"] == DS_UID
        self.events.append((type_, reason, involved["name"], message))

    def kubelet_restarts(self, name: str) -> None:
        """What the kubelet does after the image change: the agent container runs it."""
        body = self.pods[name]
        image = body["spec"]["containers"][1]["image"]
        body["status"]["containerStatuses"][1].update(image=image, ready=True)


CONFIG = replace(
    OperatorConfig(), agent_daemonset="kv-node-agent", pod_namespace="kvoffload-system",
    agent_upgrade_timeout=60.0,
)  # fmt: skip


def test_a_round_patches_one_pod_then_announces_it_and_patches_the_next() -> None:
    api = FakeApi(daemonset(), [pod("a", "node-1"), pod("b", "node-2")])
    reported: set = set()
    assert upgrade_once(api, CONFIG, reported, NOW).action == "patch"
    assert api.patched == ["a"] and api.events == []
    later = NOW + datetime.timedelta(seconds=5)
    assert upgrade_once(api, CONFIG, reported, later).action == "wait"  # not back: b waits
    assert api.patched == ["a"]
    api.kubelet_restarts("a")
    upgrade_once(api, CONFIG, reported, later)
    assert api.patched == ["a", "a", "b"]  # marked done, then the next
    ((type_, reason, name, message),) = api.events
    assert (type_, reason, name) == ("Normal", "AgentUpgraded", "kv-node-agent")
    assert "pod a on node node-1" in message and NEW in message
    api.kubelet_restarts("b")
    assert upgrade_once(api, CONFIG, reported, later).action == "done"
    assert [e[1] for e in api.events] == ["AgentUpgraded", "AgentUpgraded"]
    assert all(p["spec"]["initContainers"][0]["image"] == OLD for p in api.pods.values())


def test_a_round_reports_a_stalled_pod_once_and_patches_no_other() -> None:
    api = FakeApi(daemonset(), [pod("a", "node-1"), pod("b", "node-2")])
    reported: set = set()
    upgrade_once(api, CONFIG, reported, NOW)
    late = NOW + datetime.timedelta(seconds=61)
    for _ in range(3):
        assert upgrade_once(api, CONFIG, reported, late).action == "stalled"
    ((type_, reason, _, message),) = api.events
    assert (type_, reason) == ("Warning", "AgentUpgradeStalled") and "pod a" in message
    assert api.pods["b"]["spec"]["containers"][1]["image"] == OLD


def test_a_round_announces_a_blocked_image_once() -> None:
    api = FakeApi(daemonset(), [pod("a", "node-1", args=["node-agent", "--older-flag"])])
    reported: set = set()
    for _ in range(2):
        assert upgrade_once(api, CONFIG, reported, NOW).action == "blocked"
    ((type_, reason, _, message),) = api.events
    assert (type_, reason) == ("Warning", "AgentUpgradeNeedsRollout") and NEW in message
    assert api.patched == []


def test_a_round_that_lost_the_race_posts_nothing() -> None:
    """Another replica patched the pod between this one's read and its patch: the guarded
    patch fails, nothing is posted, the next round waits for that pod."""
    api = FakeApi(daemonset(), [pod("a", "node-1"), pod("b", "node-2")])
    read = api.list_pods

    def raced(namespace: str, selector: str) -> list[dict]:
        pods = read(namespace, selector)
        api.pods["a"]["spec"]["containers"][1]["image"] = NEW  # the other replica's patch
        return pods

    api.list_pods = raced  # type: ignore[method-assign]
    assert upgrade_once(api, CONFIG, set(), NOW).action == "patch"
    assert api.patched == [] and api.events == []
