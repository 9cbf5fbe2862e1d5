"""A real sidecar's /metrics against docs/METRICS.md, and what its capacity series say.

A `kvoffload sidecar` process with `--metrics-listen` (and `--tenants`, whose series exist only
with it) serves one namespace; a client stores,
looks up, pins and releases over its socket, and a connector status file (written by the
connector's own writer) says what the GPU tier holds. The scrape must pass a strict exposition
check (HELP and TYPE per family, no duplicate series, OpenMetrics parser too), expose exactly the
documented `kvoffload_` series with the documented types and labels, and its numbers must be the
ones the calls made: store/load latency observed once each, hit rate inputs, blocks used,
capacity in tokens per tier.
"""

from __future__ import annotations

import socket
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
from kvoffload_connector.capacity import gpu_capacity
from kvoffload_connector.guard import write_status
from prometheus_client.openmetrics import parser as om_parser

from tests.sidecar.metrics_doc import (
    check_text_format,
    documented,
    exposed,
    samples,
    sidecar_documented,
)
from tests.sidecar.procs import Client, keys, sidecar_process, socket_dir, spec, wait_ready

pytestmark = [pytest.mark.process, pytest.mark.timeout(120)]

# Documented series that may have no sample in this scrape (nothing was discarded at start).
MAY_BE_EMPTY = {"kvoffload_pool_discarded_blocks"}
GPU_BLOCKS, GPU_BLOCK_SIZE = 100, 16
# Per-tenant series exist only with --tenants: one configured tenant (and the default).
TENANTS = '[{"name": "a", "cacheSalts": ["salt-a"], "guaranteed": "25%", "max": "60%"}]'


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(port: int, accept: str | None = None) -> str:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics")
    if accept:
        req.add_header("Accept", accept)
    with urllib.request.urlopen(req, timeout=5) as resp:
        return resp.read().decode()


def fake_vllm_config(model: str) -> SimpleNamespace:
    """What `gpu_capacity` reads of a vLLM config whose KV cache is sized (one KV group)."""
    return SimpleNamespace(
        model_config=SimpleNamespace(served_model_name=None, model=model),
        cache_config=SimpleNamespace(num_gpu_blocks=GPU_BLOCKS, block_size=GPU_BLOCK_SIZE),
    )


def one(text: str, name: str, **labels: str) -> float:
    found = {k: v for k, v in samples(text, name).items() if labels.items() <= dict(k).items()}
    assert len(found) == 1, (name, labels, found)
    return next(iter(found.values()))


def strict_checks(text: str, openmetrics: str) -> None:
    check_text_format(text)
    families = list(om_parser.text_string_to_metric_families(openmetrics))  # raises on errors
    assert any(f.name.startswith("kvoffload_") for f in families)


def test_metrics_match_the_docs_and_the_calls(tmp_path: Path) -> None:
    port = free_port()
    with (
        socket_dir() as sock_dir,
        sidecar_process(
            tmp_path, sock_dir, "--metrics-listen", f"127.0.0.1:{port}", "--tenants", TENANTS
        ) as sc,
        Client(sc.target) as client,
    ):
        # two KV groups: a slot holds one group's chunk, so half the slots' tokens per group
        client.register(spec("tiny-llama", kv_groups="full:a;full:b"))
        wait_ready(client)
        assert write_status(
            str(sc.socket),
            "active",
            "",
            "scheduler",
            0,
            "test",
            gpu_capacity(fake_vllm_config("tiny-llama")),
        )
        assert client.store(keys(1, 2, 3)).store_id
        assert client.lookup(keys(1, 2, 3, 4)) == [3]
        pin = client.reserve_load(keys(1, 2))
        assert pin.pin_id and client.release(pin.pin_id) == 2
        ns = client.namespace_stats()
        text = scrape(port)
        strict_checks(text, scrape(port, "application/openmetrics-text; version=1.0.0"))

    docs = sidecar_documented()
    seen = exposed(text)
    assert set(seen) == set(docs), (
        f"exposed, not documented: {sorted(set(seen) - set(docs))}; "
        f"documented, not exposed: {sorted(set(docs) - set(seen))}"
    )
    for name, doc in docs.items():
        got = seen[name]
        assert got.type == doc.type, (name, got.type, doc.type)
        if name in MAY_BE_EMPTY and not got.samples:
            continue
        assert got.samples, f"{name}: no sample"
        assert got.labels == doc.labels, (name, sorted(got.labels), sorted(doc.labels))

    nsl = {"pool_namespace": client.namespace_id}
    # latency: one store reserved -> visible, one pin -> release; both in the 0.5 ms..10 s range
    assert one(text, "kvoffload_store_latency_seconds_count", **nsl) == 1
    assert one(text, "kvoffload_load_latency_seconds_count", **nsl) == 1
    assert 0 < one(text, "kvoffload_store_latency_seconds_sum", **nsl) < 10
    # hit-rate inputs: 4 keys asked, 3 found, 1 query missed
    assert one(text, "kvoffload_lookup_queried_blocks_total", **nsl) == 4 == ns.queried_blocks
    assert one(text, "kvoffload_lookup_blocks_total", result="hit", **nsl) == 3
    assert one(text, "kvoffload_lookup_blocks_total", result="miss", **nsl) == 1
    # capacity and usage in blocks and as a ratio
    assert one(text, "kvoffload_pool_capacity_blocks", **nsl) == ns.slot_count > 3
    assert one(text, "kvoffload_pool_used_blocks", **nsl) == 3
    assert one(text, "kvoffload_pool_usage_perc", **nsl) == pytest.approx(3 / ns.slot_count)
    # effective KV capacity: host = slots x chunk tokens / 2 groups; gpu = what vLLM sized
    host = ns.slot_count * ns.spec.chunk_blocks * ns.spec.block_size // 2
    assert one(text, "kvoffload_pool_capacity_tokens", **nsl) == host
    model = {"model": "tiny-llama"}
    assert one(text, "kvoffload_kv_capacity_tokens", tier="host", **model) == host
    gpu = GPU_BLOCKS * GPU_BLOCK_SIZE
    assert one(text, "kvoffload_kv_capacity_tokens", tier="gpu", **model) == gpu
    assert one(text, "kvoffload_kv_effective_capacity_tokens", **model) == gpu + host


def test_a_degraded_sidecar_exposes_only_documented_series(tmp_path: Path) -> None:
    """Without a pool: the documented process series and the GPU tier, nothing undocumented."""
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
            "--metrics-listen",
            f"127.0.0.1:{port}",
            ready_timeout=20,
        ) as sc,
    ):
        write_status(
            str(sc.socket), "disabled", "no pool", "scheduler", 0, "test",
            gpu_capacity(fake_vllm_config("m")),
        )  # fmt: skip
        text = scrape(port)
        strict_checks(text, scrape(port, "application/openmetrics-text; version=1.0.0"))
    docs = sidecar_documented()
    seen = exposed(text)
    assert set(seen) <= set(docs), sorted(set(seen) - set(docs))
    assert all(seen[n].type == docs[n].type for n in seen)
    assert one(text, "kvoffload_pool_degraded") == 1
    gpu = GPU_BLOCKS * GPU_BLOCK_SIZE
    assert one(text, "kvoffload_kv_capacity_tokens", tier="gpu", model="m") == gpu
    assert one(text, "kvoffload_kv_capacity_tokens", tier="host", model="m") == 0
    assert one(text, "kvoffload_kv_effective_capacity_tokens", model="m") == gpu


def test_operator_metrics_match_the_docs() -> None:
    from kvoffload_operator.metrics import OperatorMetrics
    from prometheus_client import generate_latest

    m = OperatorMetrics.create()
    m.injections.labels(outcome="injected", reason="").inc()
    m.injection_seconds.observe(0.01)
    m.reconciles.labels(result="success").inc()
    m.rollouts.labels(kind="Deployment").inc()
    text = generate_latest(m.registry).decode()
    check_text_format(text)
    docs = documented("Operator")
    seen = exposed(text)
    assert set(seen) == set(docs)
    assert all((seen[n].type, seen[n].labels) == (docs[n].type, docs[n].labels) for n in docs)


def test_connector_metrics_match_the_docs() -> None:
    from kvoffload_connector import pool_metrics, stats  # needs vLLM's base classes

    names = {name for name, _ in stats.PromMetrics.NAMES.values()} | {stats.PromMetrics.ACTIVE}
    names |= {name for name, _ in stats.PromMetrics.VLLM_NAMES.values()}  # vLLM's own names
    names |= set(pool_metrics.NAMES)
    docs = documented("vLLM connector")
    assert names == set(docs)
    assert docs[stats.PromMetrics.ACTIVE].type == "gauge"
    for name, (_, labels, _) in pool_metrics.SERIES.items():  # beside vLLM's engine labels
        assert (docs[name].type, docs[name].labels) == ("gauge", set(labels)), name
