"""The policy status's pool capacity and use: summed over the injected pods' sidecars that
answered Stats (pure), printed in binary units, and read from a real sidecar over TCP."""

from __future__ import annotations

from pathlib import Path

import pytest
from kvoffload_operator.pool_usage import binary_quantity, pool_usage
from kvoffload_operator.sidecar_reports import SidecarReport
from kvoffload_operator.sidecar_stats import GrpcStatsSource, probe_sidecars
from kvoffload_operator.status import build_status

from tests.operator.harness import free_port
from tests.operator.test_sidecar_status import POLICY, pod
from tests.sidecar.procs import SLOT_BYTES, Client, keys, sidecar_process, socket_dir, wait_ready

GiB = 1 << 30


def report(name: str, pool: int, used: int, up: bool = True, ns: str = "ns") -> SidecarReport:
    return SidecarReport(name, ns, f"uid-{name}", up, pool_bytes=pool, used_bytes=used)


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0"),
        (1023, "1023"),
        (1024, "1Ki"),
        (64 * GiB, "64Gi"),
        (3 * GiB // 2, "1.5Gi"),
        (GiB - 1, "1024Mi"),  # rounds up to the next whole number of the unit below
        (37 * GiB + GiB // 5, "37.2Gi"),
        (2 << 40, "2Ti"),
        (5 << 60, "5Ei"),
    ],
)
def test_binary_quantity(n: int, text: str) -> None:
    assert binary_quantity(n) == text


def test_status_sums_the_answering_sidecars_of_this_policy() -> None:
    pods = [pod("a"), pod("b"), pod("dark")]
    reports = [
        report("a", 64 * GiB, 10 * GiB),
        report("b", 64 * GiB, GiB // 2),
        report("dark", 64 * GiB, 64 * GiB, up=False),  # did not answer: not counted
        report("gone", 64 * GiB, 64 * GiB),  # not an injected pod of this policy (any more)
        report("nopool", 0, 0),  # a sidecar without a pool adds nothing
    ]
    status = build_status(POLICY, pods, [POLICY], namespace_enabled=True, now="t", reports=reports)
    assert (status["poolCapacityBytes"], status["poolUsedBytes"]) == (128 * GiB, 21 * GiB // 2)
    assert (status["poolCapacity"], status["poolUsed"]) == ("128Gi", "10.5Gi")
    none = build_status(POLICY, pods, [POLICY], namespace_enabled=True, now="t")
    assert (none["poolCapacityBytes"], none["poolUsed"]) == (0, "0")


def test_pool_usage_ignores_unreachable_and_negative_numbers() -> None:
    usage = pool_usage([report("a", GiB, 5), report("b", GiB, GiB, up=False), report("c", -1, -1)])
    assert (usage.capacity_bytes, usage.used_bytes) == (GiB, 5)


@pytest.mark.process
@pytest.mark.timeout(120)
def test_a_real_sidecars_stats_give_its_pool_size_and_use(tmp_path: Path) -> None:
    port = free_port()
    with (
        socket_dir() as sock_dir,
        sidecar_process(tmp_path, sock_dir, f"--listen=127.0.0.1:{port}", pool_size="32Mi") as sc,
        Client(sc.target) as client,
    ):
        client.register()
        wait_ready(client)
        assert client.store(keys(1, 2, 3)).store_id
        the_pod = pod("a", ip="127.0.0.1", port=port)
        (answer,) = probe_sidecars([the_pod], GrpcStatsSource(), timeout=2.0)
    assert answer.reachable
    assert (answer.pool_bytes, answer.used_bytes) == (32 << 20, 3 * SLOT_BYTES)
    status = build_status(
        POLICY, [the_pod], [POLICY], namespace_enabled=True, now="t", reports=[answer]
    )
    assert (status["poolCapacity"], status["poolUsed"]) == ("32Mi", "192Ki")
