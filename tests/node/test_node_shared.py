"""A node pool seen as shared: Stats over each pod's `pool.sock`, the agent's /metrics,
`kvoffload stats`, and the host tier's KV events of every engine that can load a block.

One real agent (`--metrics-listen`), the kubelet stand-in publishing two pods of tenant alpha
and one of beta, each pod's client a process of its own (tests/node/slot_client.py)."""

from __future__ import annotations

import re
import time
import urllib.request
from collections.abc import Iterator

import grpc
import nodeharness
import pytest
from kvoffload.v1 import pool_pb2 as pb
from kvoffload.v1 import pool_pb2_grpc as pb_grpc
from kvoffload_connector.common.pool_replies import RegisterResult
from kvoffload_connector.scheduler.events import DecodedBlob, EventFeed
from kvoffload_connector.scheduler.scheduler_stats import pool_entry
from kvoffload_sidecar.cli import main_stats
from nodeharness import POD_A, POD_A2, POD_B, MiB, Pod
from slot_client import SLOT_BYTES, block_hash, spec

from tests.sidecar.metrics_doc import check_text_format, documented, exposed, samples

pytestmark = [pytest.mark.process, pytest.mark.timeout(120)]

TOKENS_PER_SLOT = 16  # slot_client.py's spec: block_size 16, chunk_blocks 1, one KV group


class Node(nodeharness.Node):
    """The node with the agent's /metrics listening."""

    def stub(self, pod: Pod) -> pb_grpc.KVPoolStub:
        channel = grpc.insecure_channel(f"unix:{self.mount(pod)}/pool.sock")
        return pb_grpc.KVPoolStub(channel)

    @property
    def metrics_port(self) -> int:
        found = re.search(r"node agent metrics on port (\d+)", self.agent.log.read_text())
        assert found, self.agent.log.read_text()
        return int(found.group(1))

    def scrape(self) -> str:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.read().decode()


@pytest.fixture(scope="module")
def node() -> Iterator[Node]:
    metrics = ("--metrics-listen", "127.0.0.1:0")
    with Node(POD_A, POD_A2, POD_B, holder=False, agent_args=metrics) as n:
        yield n


def test_stats_of_every_pod_name_the_one_shared_pool_and_its_sharers(node: Node) -> None:
    a, a2, b = (node.stats(p) for p in (POD_A, POD_A2, POD_B))
    for s in (a, a2, b):
        assert s.placement == "node" and s.HasField("shared")
    assert a.shared.pool_id == a2.shared.pool_id == f"node-pool/node-a/alpha/{a.pool_generation}"
    assert b.shared.pool_id == f"node-pool/node-a/beta/{b.pool_generation}" != a.shared.pool_id
    assert (a.shared.node_pool, a.shared.node, a.shared.tenant) == ("node-pool", "node-a", "alpha")
    assert (a.shared.capacity_bytes, b.shared.capacity_bytes) == (4 * MiB, 2 * MiB)
    assert (a.shared.attached_pods, b.shared.attached_pods) == (2, 1)  # published, granted
    assert a.shared.active_pods == 0 and a.shared.live_clients == 0  # nobody registered yet

    node.client(POD_A, "store", "--keys", "1,2,3", "--announce")
    a = node.stats(POD_A2)  # any sharer's Stats answers the same pool
    assert (a.shared.attached_pods, a.shared.active_pods, a.shared.live_clients) == (2, 1, 1)
    node.client(POD_A2, "register")
    a = node.stats(POD_A)
    assert (a.shared.active_pods, a.shared.live_clients) == (2, 2)
    assert node.stats(POD_B).shared.active_pods == 0  # beta's pool is another, unused

    (ns,) = a.namespaces
    assert ns.capacity_tokens == ns.slot_count * TOKENS_PER_SLOT > 0
    assert ns.used_tokens == 3 * TOKENS_PER_SLOT
    assert a.shared.used_bytes == ns.used_bytes == 3 * ns.slot_bytes


def test_kvoffload_stats_prints_the_shared_pool(
    node: Node, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main_stats(["--socket", f"{node.mount(POD_A2)}/pool.sock"]) == 0
    out = capsys.readouterr().out
    pool_id = node.stats(POD_A).shared.pool_id
    assert f"placement node: pool {pool_id} (node pool node-pool, node node-a, tenant alpha)" in out
    assert "shared by 2 pod(s) attached" in out and "count it once per pool id" in out
    assert re.search(r"\s48/\d+\s", out), out  # tokens used/capacity of the namespace row


def test_agent_metrics_expose_each_pool_once_with_its_id(node: Node) -> None:
    text = node.scrape()
    check_text_format(text)
    a, b = (node.stats(p).shared.pool_id for p in (POD_A, POD_B))
    info = samples(text, "kvoffload_node_pool_info")
    assert {dict(k)["pool_id"] for k in info} == {a, b}  # one series per pool, not per pod
    assert samples(text, "kvoffload_node_pool_attached_pods") == {
        (("pool_id", a),): 2.0,
        (("pool_id", b),): 1.0,
    }
    assert samples(text, "kvoffload_node_pool_capacity_bytes")[(("pool_id", a),)] == 4 * MiB
    tokens = {dict(k)["pool_id"]: v for k, v in samples(text, "kvoffload_pool_used_tokens").items()}
    assert tokens[a] == 3 * TOKENS_PER_SLOT
    # the agent's series: its own section's as documented, the sidecar's with pool_id added
    node_doc = documented("Node agent")
    sidecar_doc = documented("Sidecar", "Per-tenant")
    families = exposed(text)
    for name, family in families.items():
        if name in node_doc:
            assert family.labels == node_doc[name].labels, name
            continue
        if name == "kvoffload_build_info":  # the agent's own, once
            assert family.labels == {"version"} and family.samples == 1
            continue
        assert name in sidecar_doc, f"{name} is not documented"
        if family.samples:  # (a histogram no call observed yet has none)
            assert family.labels == sidecar_doc[name].labels | {"pool_id"}, name
    assert set(node_doc) <= set(families)
    assert "kvoffload_pool_capacity_tokens" in families  # per domain, with pool_id
    # no pod's GPU tier here, no degraded sidecar
    assert not {"kvoffload_kv_capacity_tokens", "kvoffload_pool_degraded"} & set(families)


class Builder:
    """The feed's event builder without vLLM (importing it takes seconds; the vLLM format of
    these events is the engine tests'): what the feed decoded of each stored block."""

    def stored(self, blob: DecodedBlob) -> DecodedBlob:
        return blob

    def removed(self, announced: object) -> object:
        return announced


def events_of(node: Node, pod: Pod, namespace_id: str) -> list:
    """The host tier's KV events the engine of `pod` announces: the connector's feed over the
    pod's own pool.sock, read until caught up."""
    stub = node.stub(pod)

    def fetch(log_id: str, after: int, cursor: int, page: int) -> pb.EventsResponse:
        req = pb.EventsRequest(
            namespace_id=namespace_id, log_id=log_id, after_seq=after, cursor=cursor,
            max_events=page,
        )  # fmt: skip
        return stub.Events(req, timeout=10)

    feed = EventFeed(fetch, builder=Builder())
    feed.poll()
    return feed.take()


def test_a_replica_announces_the_blocks_another_stored_and_another_tenant_none(
    node: Node,
) -> None:
    stats = node.stats(POD_A)
    if not stats.namespaces or stats.namespaces[0].stored_blocks < 3:
        node.client(POD_A, "store", "--keys", "1,2,3", "--announce")
        stats = node.stats(POD_A)
    (ns,) = stats.namespaces
    deadline = time.monotonic() + 10
    events = events_of(node, POD_A2, ns.namespace_id)  # B never stored: it can load them
    while len(events) < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
        events = events_of(node, POD_A2, ns.namespace_id)
    assert [e.hashes for e in events] == [(block_hash(i),) for i in (1, 2, 3)]
    assert events[0].tokens == list(range(16, 32)) and events[1].parent == block_hash(1)
    # beta registers the same model: another tenant's pool, another memfd; nothing of alpha's
    node.client(POD_B, "register")
    (beta_ns,) = node.stats(POD_B).namespaces
    assert events_of(node, POD_B, beta_ns.namespace_id) == []


def register(node: Node, pod: Pod) -> RegisterResult:
    """The Register answer a connector gets through the pod's own pool.sock."""
    req = pb.RegisterRequest(
        spec=spec("tiny-llama"), num_ranks=1, slot_bytes_per_rank=SLOT_BYTES,
        client_name="node-test/scheduler",
    )  # fmt: skip
    return RegisterResult.from_response(node.stub(pod).Register(req, timeout=10))


def test_each_replicas_register_answer_names_the_shared_pool_for_its_metrics(
    node: Node,
) -> None:
    """What each replica's vLLM /metrics names the pool by (`vllm:kvoffload_pool_*`): the
    same pool_id and capacity through both sharers' sockets, so a router that dedupes by
    pool_id counts alpha's pool once; beta's is another."""
    a, a2, b = (register(node, p) for p in (POD_A, POD_A2, POD_B))
    stats = node.stats(POD_A)
    assert a.pool == a2.pool and a.pool.pool_id == stats.shared.pool_id
    assert (a.pool.placement, a.pool.node_pool, a.pool.node, a.pool.tenant) == (
        "node", "node-pool", "node-a", "alpha",
    )  # fmt: skip
    assert a.pool.pool_bytes == stats.shared.capacity_bytes == 4 * MiB
    assert b.pool.pool_id == node.stats(POD_B).shared.pool_id != a.pool.pool_id
    (ns,) = stats.namespaces
    replicas = [pool_entry(r, TOKENS_PER_SLOT, 1) for r in (a, a2)]
    assert replicas[0] == replicas[1]
    assert replicas[0]["capacity_tokens"] == ns.capacity_tokens
    assert replicas[0]["capacity_bytes"] == ns.capacity_bytes
    by_pool = {e["pool_id"]: e["capacity_bytes"] for e in replicas}
    assert sum(by_pool.values()) == ns.capacity_bytes  # once, not once per replica
