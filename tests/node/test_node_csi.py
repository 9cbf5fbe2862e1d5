"""The node agent's CSI services, driven over its Unix socket as the kubelet drives them."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import uuid
from pathlib import Path

import grpc
import pytest
from kvoffload.csi.v1 import csi_pb2
from kvoffload_connector.common.node_memory import NodeMemoryError, open_tenant_memory
from kvoffload_sidecar.node.tenant_memory import set_socket_owner
from nodeharness import AGENT, POD_A, POD_B, MiB, Pod, pool_call

pytestmark = pytest.mark.process


def _code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code()


def test_identity_and_node_info_are_the_specs_messages(agent) -> None:
    _, k = agent
    info = k.identity.GetPluginInfo(csi_pb2.GetPluginInfoRequest(), timeout=5)
    assert info.name == "node.kvoffload.io" and info.vendor_version
    caps = k.identity.GetPluginCapabilities(csi_pb2.GetPluginCapabilitiesRequest(), timeout=5)
    assert list(caps.capabilities) == []  # node only: no controller service to call
    assert k.identity.Probe(csi_pb2.ProbeRequest(), timeout=5).ready.value is True
    assert k.node.NodeGetInfo(csi_pb2.NodeGetInfoRequest(), timeout=5).node_id == "node-a"
    node_caps = k.node.NodeGetCapabilities(csi_pb2.NodeGetCapabilitiesRequest(), timeout=5)
    rpc = csi_pb2.NodeServiceCapability.RPC
    # no STAGE_UNSTAGE_VOLUME: the kubelet calls NodePublish directly; the pod's fsGroup
    # comes as volume_mount_group
    assert [c.rpc.type for c in node_caps.capabilities] == [rpc.VOLUME_MOUNT_GROUP]


def test_two_pods_of_two_tenants_publish_map_and_unpublish_twice(agent) -> None:
    a, k = agent
    k.publish(POD_A)
    k.publish(POD_B)
    k.publish(POD_A)  # a retried publish of the same volume answers OK again
    sock_a, sock_b = k.target(POD_A) / "memory.sock", k.target(POD_B) / "memory.sock"
    assert len(str(sock_a)) > 108  # the agent binds past sun_path's limit
    assert stat.S_ISSOCK(os.stat(sock_a).st_mode)
    assert stat.S_IMODE(os.stat(sock_a).st_mode) == 0o666
    assert stat.S_IMODE(os.stat(k.target(POD_A)).st_mode) == 0o755
    b_sock, b_dir = os.stat(sock_b), os.stat(k.target(POD_B))
    assert (stat.S_IMODE(b_sock.st_mode), b_sock.st_gid) == (0o660, POD_B.group)
    assert (stat.S_IMODE(b_dir.st_mode), b_dir.st_gid) == (0o2750, POD_B.group)
    records = sorted(
        json.loads(p.read_text())["tenant"] for p in (a.root / "state" / "bindings").glob("*.json")
    )
    assert records == ["alpha", "beta"]

    ma = open_tenant_memory(str(sock_a), "alpha")
    mb = open_tenant_memory(str(sock_b), "beta")
    try:
        assert (ma.size, mb.size) == (4 * MiB, 2 * MiB)
        ma.buffer[:5] = b"alpha"
        mb.buffer[:4] = b"beta"
        again = open_tenant_memory(str(sock_a), "alpha")  # the same memory, another fd
        assert again.buffer[:5] == b"alpha"
        again.close()
        assert mb.buffer[:5] == b"beta\0"
    finally:
        ma.close()
        mb.close()

    for _ in range(2):  # the spec: unpublishing an unpublished volume answers OK
        k.unpublish(POD_A)
    assert not k.target(POD_A).exists()
    assert k.target(POD_A).parent.exists()  # the kubelet's directory stays
    assert sorted(
        json.loads(p.read_text())["tenant"] for p in (a.root / "state" / "bindings").glob("*.json")
    ) == ["beta"]
    k.unpublish(POD_B)
    k.unpublish(POD_B)
    assert not k.target(POD_B).exists()


def test_publish_refuses_only_what_a_kubelet_never_sends_with_the_precise_code(agent) -> None:
    _, k = agent
    bad, denied = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED
    ctx = POD_A.context
    # a persistent volume, or a CSIDriver without podInfoOnMount, is not what this serves
    assert (
        _code(lambda: k.publish(POD_A, context=ctx(**{"csi.storage.k8s.io/ephemeral": None})))
        == bad
    )
    assert (
        _code(lambda: k.publish(POD_A, context=ctx(**{"csi.storage.k8s.io/ephemeral": "false"})))
        == bad
    )
    assert (
        _code(lambda: k.publish(POD_A, context=ctx(**{"csi.storage.k8s.io/pod.uid": None}))) == bad
    )
    assert (
        _code(lambda: k.publish(POD_A, context=ctx(**{"csi.storage.k8s.io/pod.uid": "../x"})))
        == bad
    )
    assert _code(lambda: k.publish(POD_A, context=ctx(tenant=None))) == bad
    assert _code(lambda: k.publish(POD_A, context=ctx(poolSize="1Ti"))) == bad  # unknown key
    assert _code(lambda: k.publish(POD_A, block=True)) == bad
    outside = k.pods_dir.parent / "elsewhere" / "mount"
    assert _code(lambda: k.publish(POD_A, target=outside)) == bad
    outside.mkdir(parents=True)
    (outside / "memory.sock").write_text("not the agent's")
    unpublish_outside = csi_pb2.NodeUnpublishVolumeRequest(
        volume_id=k.volume_id(POD_A), target_path=str(outside)
    )
    assert _code(lambda: k.node.NodeUnpublishVolume(unpublish_outside, timeout=5)) == bad
    assert (outside / "memory.sock").read_text() == "not the agent's"  # untouched
    # pod fields a pod spec wrote itself (a CSIDriver without podInfoOnMount passes them
    # through): the kubelet's target path names the real pod's uid, which no spec can know
    forged = POD_B.context(tenant="beta")
    with pytest.raises(grpc.RpcError) as e:
        k.publish(POD_A, context=forged)  # pod A's volume, claiming to be pod B
    assert e.value.code() == denied and "uid" in e.value.details()
    assert not k.target(POD_A).exists() and not k.target(POD_B).exists()
    # the same volume at the same path, asked again for another tenant, pod or group
    k.publish(POD_B)
    exists = grpc.StatusCode.ALREADY_EXISTS
    as_a = Pod(POD_B.namespace, POD_B.name, POD_B.uid, "vllm", "alpha", POD_B.group)
    assert _code(lambda: k.publish(as_a)) == exists
    relabel = Pod("team-b", "other-name", POD_B.uid, "vllm", "beta", POD_B.group)
    assert _code(lambda: k.publish(relabel)) == exists
    regroup = Pod(POD_B.namespace, POD_B.name, POD_B.uid, "vllm", "beta", 3003)
    assert _code(lambda: k.publish(regroup)) == exists
    k.unpublish(POD_B)


def _other(namespace: str, tenant: str, service_account: str = "vllm") -> Pod:
    return Pod(namespace, f"vllm-{uuid.uuid4().hex[:6]}", str(uuid.uuid4()), service_account,
               tenant, None)  # fmt: skip


def test_a_tenant_not_granted_fails_no_mount_and_its_sockets_refuse_with_the_reason(agent) -> None:
    """A pod whose tenant is not granted to it (another namespace's, an unknown one, one granted
    to other service accounts) is published: the kubelet starts it. Its memory.sock sends no
    memfd and its pool.sock serves no Pool, both saying why, one message whether the tenant
    exists or not; there is no session.sock. Its pod serves without the pool."""
    a, k = agent
    other, unknown = _other("team-a", "beta"), _other("team-a", "gamma")
    wrong_sa = _other("team-b", "beta", service_account="default")
    answers = {}
    for pod in (other, unknown, wrong_sa):
        k.publish(pod)
        k.publish(pod)  # a retried publish answers OK again
        target = k.target(pod)
        assert stat.S_ISSOCK(os.stat(target / "memory.sock").st_mode)
        assert stat.S_ISSOCK(os.stat(target / "pool.sock").st_mode)
        assert not (target / "session.sock").exists()
        with pytest.raises(NodeMemoryError) as e:
            open_tenant_memory(str(target / "memory.sock"), pod.tenant)
        code, details = pool_call(k.short(pod))
        answers[pod.tenant, pod.service_account] = (e.value.code, e.value.message, code, details)
    for mem_code, mem_message, code, details in answers.values():
        assert (mem_code, code) == ("PERMISSION_DENIED", grpc.StatusCode.PERMISSION_DENIED)
        assert details == mem_message and "is not granted to namespace" in details
    beta = answers["beta", "vllm"][1]
    assert beta.replace("beta", "T") == answers["gamma", "vllm"][1].replace("gamma", "T")
    assert "service account default" in answers["beta", "default"][1]
    records = [json.loads(p.read_text()) for p in (a.root / "state" / "bindings").glob("*.json")]
    assert sorted((r["tenant"], r["granted"]) for r in records) == [
        ("beta", False),
        ("beta", False),
        ("gamma", False),
    ]
    assert "published without its tenant" in a.log.read_text()
    # what `kvoffload stats` says in such a pod
    out = subprocess.run(
        [AGENT[0], "stats", "--socket", f"{k.short(other)}/pool.sock"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert out.returncode == 1
    assert f"(PERMISSION_DENIED: {answers['beta', 'vllm'][3]})" in out.stderr, out.stderr
    for pod in (other, unknown, wrong_sa):
        k.unpublish(pod)
        assert not k.target(pod).exists()


def test_a_restarted_agent_serves_the_sockets_it_published(agent) -> None:
    """The kubelet does not publish a running pod's volume again: the agent's state does."""
    a, k = agent
    k.publish(POD_A)
    k.publish(POD_B)
    m = open_tenant_memory(str(k.target(POD_A) / "memory.sock"), "alpha")
    m.buffer[:4] = b"kept"
    a.kill()
    # the pod keeps its mapping while the agent is gone
    assert m.buffer[:4] == b"kept"
    with pytest.raises(OSError):
        open_tenant_memory(str(k.target(POD_A) / "memory.sock"), "alpha", timeout=1)
    a.start()
    again = open_tenant_memory(str(k.target(POD_A) / "memory.sock"), "alpha")
    assert again.size == 4 * MiB
    with pytest.raises(NodeMemoryError) as e:  # the binding came back too, not just a socket
        open_tenant_memory(str(k.target(POD_A) / "memory.sock"), "beta")
    assert e.value.code == "PERMISSION_DENIED"
    again.close()
    m.close()
    k.unpublish(POD_A)
    k.unpublish(POD_B)
    assert not k.target(POD_A).exists() and not k.target(POD_B).exists()


def test_a_socket_swapped_for_a_symlink_changes_nothing_it_points_to(agent, tmp_path) -> None:
    """A pod running as root can write into its own volume; a restarted agent re-creating the
    socket there must not chmod or chown what a planted link points to."""
    a, k = agent
    k.publish(POD_B)
    sock = k.target(POD_B) / "memory.sock"
    victim = tmp_path / "host-file"
    victim.write_text("secret")
    victim.chmod(0o600)
    a.kill()
    sock.unlink()
    sock.symlink_to(victim)
    a.start()
    assert stat.S_ISSOCK(os.lstat(sock).st_mode)  # the link was replaced, not followed
    assert (stat.S_IMODE(victim.stat().st_mode), victim.stat().st_gid) == (0o600, 0)
    m = open_tenant_memory(str(sock), "beta")
    m.close()
    # and the chmod itself refuses a link (the window between bind and chmod)
    link = tmp_path / "link"
    link.symlink_to(victim)
    with pytest.raises(OSError) as e:
        set_socket_owner(str(tmp_path), "link", 0o666, 2002)
    assert "is not the agent's socket" in str(e.value)  # O_PATH|O_NOFOLLOW opened the link
    assert (stat.S_IMODE(victim.stat().st_mode), victim.stat().st_gid) == (0o600, 0)
    k.unpublish(POD_B)


def test_a_restarted_agent_grants_a_pod_its_new_grants_admit_and_keeps_the_record(agent) -> None:
    """A pod published without a grant stays published across an agent restart, still refused;
    an agent restarted on grants that admit it gives it its tenant (recorded, so a later agent
    keeps it granted) without a new publish."""
    a, k = agent
    pod = _other("team-c", "alpha")
    k.publish(pod)
    a.kill()
    a.start()  # the same grants: still refused
    with pytest.raises(NodeMemoryError) as e:
        open_tenant_memory(str(k.target(pod) / "memory.sock"), "alpha")
    assert e.value.code == "PERMISSION_DENIED"
    assert pool_call(k.short(pod), "Stats")[0] == grpc.StatusCode.PERMISSION_DENIED
    pool = json.loads(a.pool_file.read_text())
    pool["tenants"][0]["namespaces"].append("team-c")  # alpha for team-c too
    a.pool_file.write_text(json.dumps(pool))
    a.kill()
    a.start()
    m = open_tenant_memory(str(k.target(pod) / "memory.sock"), "alpha")
    assert m.size == 4 * MiB
    m.close()
    assert pool_call(k.short(pod), "Stats")[0] == grpc.StatusCode.OK
    assert (k.target(pod) / "session.sock").exists()
    [record] = [json.loads(p.read_text()) for p in (a.root / "state" / "bindings").glob("*.json")]
    assert (record["tenant"], record["granted"]) == ("alpha", True)
    k.unpublish(pod)


def _write_status_as(uid: int, groups: list[int], socket: Path, rank: int = 0) -> str:
    """The connector's own status write (guard.write_status) in a process of `uid` with
    `groups` as its supplementary groups, as a vLLM container of the pod runs it; prints the
    path written, or None."""
    code = ("import sys; from kvoffload_connector import guard; "
            "print(guard.write_status(sys.argv[1], 'active', '', 'worker', int(sys.argv[2]), "
            "'0.0', {'placement': 'node'}))")  # fmt: skip
    cmd = ["setpriv", f"--reuid={uid}", f"--regid={uid}",
           f"--groups={','.join(map(str, groups))}" if groups else "--clear-groups",
           sys.executable, "-c", code, str(socket), str(rank)]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_each_pod_gets_a_status_directory_its_containers_may_write_never_through_a_link(
    agent, tmp_path
) -> None:
    """NodePublishVolume makes `status/` in the pod's volume, the one spot its non-root
    containers may write (their connector status files): the pod's fsGroup's, 2770, or with
    none 1777 (sticky: no uid replaces another's file). A link a root pod planted there is
    replaced, never followed, by a restarted agent; unpublish removes it with what is in it."""
    a, k = agent
    k.publish(POD_A)  # no fsGroup
    k.publish(POD_B)  # fsGroup 2002
    sa, sb = k.target(POD_A) / "status", k.target(POD_B) / "status"
    st_a, st_b = os.lstat(sa), os.lstat(sb)
    assert stat.S_ISDIR(st_a.st_mode) and stat.S_IMODE(st_a.st_mode) == 0o1777
    assert (st_a.st_uid, stat.S_IMODE(os.stat(k.target(POD_A)).st_mode)) == (0, 0o755)
    assert (stat.S_IMODE(st_b.st_mode), st_b.st_uid, st_b.st_gid) == (0o2770, 0, POD_B.group)
    assert stat.S_IMODE(os.stat(k.target(POD_B)).st_mode) == 0o2750  # the sockets' stays

    # the connector writes into status/ as a non-root uid; without the fsGroup it cannot
    written = _write_status_as(1000, [], k.target(POD_A) / "pool.sock")
    assert written == str(sa / "connector-status-worker-0.json")
    assert os.stat(written).st_uid == 1000
    assert _write_status_as(1000, [], k.target(POD_B) / "pool.sock") == "None"
    written_b = _write_status_as(1001, [POD_B.group], k.target(POD_B) / "pool.sock")
    assert written_b == str(sb / "connector-status-worker-0.json")
    assert os.stat(written_b).st_gid == POD_B.group  # setgid: the file keeps the pod's group
    # sticky: another uid of the pod cannot replace uid 1000's file (its own name it can)
    assert _write_status_as(1001, [], k.target(POD_A) / "pool.sock") == "None"
    assert os.stat(written).st_uid == 1000
    assert _write_status_as(1001, [], k.target(POD_A) / "pool.sock", rank=1) != "None"

    # a root pod swaps status/ for a link to a node directory; the restarted agent does not
    # chmod or chown what it points to, and makes the directory again
    victim = tmp_path / "node-dir"
    victim.mkdir(mode=0o700)
    (victim / "keep").write_text("node file")
    a.kill()
    for name in os.listdir(sa):
        os.unlink(sa / name)
    sa.rmdir()
    sa.symlink_to(victim)
    a.start()
    assert stat.S_ISDIR(os.lstat(sa).st_mode) and stat.S_IMODE(os.lstat(sa).st_mode) == 0o1777
    assert (stat.S_IMODE(victim.stat().st_mode), victim.stat().st_uid) == (0o700, 0)

    (sb / "sub").mkdir()  # whatever a container left there, a directory with a link in it
    (sb / "sub" / "link").symlink_to(victim)
    for pod in (POD_A, POD_B):  # status/ and the files in it go with the volume
        k.unpublish(pod)
        assert not k.target(pod).exists()
    assert (victim / "keep").read_text() == "node file"  # links removed, never followed
