"""Ask running injected pods' sidecars for ``Stats`` over TCP (the sidecar's ``--listen``).

Why: a sidecar that cannot build its pool, or a connector that turned itself off, keeps the pod
serving (without the pool); only the sidecar knows why, so the policy status asks it. Bounded on
every side so the status timer never hangs: a short deadline per call, a few calls at once, an
overall budget. A pod that does not answer is counted ``unreachable`` and nothing more: a
NetworkPolicy may keep the operator out, which is no fault of the pod. The same answer carries
the pool's size and use, which the status sums per policy (`pool_usage`).

`StatsSource` is the seam: `GrpcStatsSource` in production, anything with ``stats()`` in tests.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvoffload_operator.inject.reserved import GRPC_PORT, SIDECAR_NAME
from kvoffload_operator.sidecar_reports import SidecarReport, parse_connector_status, pod_identity

PORT_NAME = "grpc-health"  # the sidecar container port the injector declares (render.py)
DEFAULT_CONCURRENCY = 16


@dataclass(frozen=True)
class StatsAnswer:
    """What the policy status uses of a ``StatsResponse``."""

    degraded_reason: str
    connector_status: str  # JSON array text
    pool_bytes: int = 0  # ``pool_bytes``: the pool file's size (0 without a pool)
    used_bytes: int = 0  # the namespaces' ``used_bytes``, summed


class StatsSource(Protocol):
    def stats(self, target: str, timeout: float) -> StatsAnswer:
        """``Stats`` of the sidecar at ``host:port``; raises on any failure."""
        ...


class GrpcStatsSource:
    """``kvoffload.v1.KVPool/Stats`` on a fresh insecure channel (no HTTP proxy: pod IPs)."""

    def stats(self, target: str, timeout: float) -> StatsAnswer:
        import grpc
        from kvoffload.v1 import pool_pb2, pool_pb2_grpc

        with grpc.insecure_channel(target, options=[("grpc.enable_http_proxy", 0)]) as channel:
            resp = pool_pb2_grpc.KVPoolStub(channel).Stats(pool_pb2.StatsRequest(), timeout=timeout)
        return StatsAnswer(
            resp.degraded_reason,
            resp.connector_status,
            resp.pool_bytes,
            sum(ns.used_bytes for ns in resp.namespaces),
        )


def stats_target(pod: Mapping[str, Any]) -> str | None:
    """``podIP:port`` of a running pod's started sidecar; None when there is nothing to ask."""
    status = pod.get("status") or {}
    ip = status.get("podIP")
    if status.get("phase") != "Running" or not ip:
        return None
    sidecar = next(
        (s for s in status.get("initContainerStatuses") or [] if s.get("name") == SIDECAR_NAME),
        None,
    )
    if sidecar is None or not sidecar.get("started"):
        return None
    port = GRPC_PORT
    for c in (pod.get("spec") or {}).get("initContainers") or []:
        if c.get("name") == SIDECAR_NAME:
            for p in c.get("ports") or []:
                if p.get("name") == PORT_NAME and p.get("containerPort"):
                    port = int(p["containerPort"])
    host = f"[{ip}]" if ":" in str(ip) else str(ip)
    return f"{host}:{port}"


def probe_sidecars(
    pods: Sequence[Mapping[str, Any]],
    source: StatsSource,
    *,
    timeout: float = 2.0,
    concurrency: int = DEFAULT_CONCURRENCY,
    budget: float = 10.0,
) -> list[SidecarReport]:
    """One report per pod with a `stats_target`, in ``pods`` order; at most ``budget`` seconds
    (calls still running then count as unreachable; their own deadline ends them)."""
    asked = [(pod, target) for pod in pods if (target := stats_target(pod))]
    if not asked:
        return []
    pool = concurrent.futures.ThreadPoolExecutor(
        max_workers=max(1, min(concurrency, len(asked))), thread_name_prefix="kvoffload-stats"
    )
    try:
        futures = [pool.submit(source.stats, target, timeout) for _, target in asked]
        concurrent.futures.wait(futures, timeout=budget)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    reports = []
    for (pod, _), future in zip(asked, futures, strict=True):
        name, namespace, uid, vllm = pod_identity(pod)
        answer = _result(future)
        if answer is None:
            reports.append(SidecarReport(name, namespace, uid, False, vllm_container=vllm))
            continue
        reports.append(
            SidecarReport(
                name,
                namespace,
                uid,
                True,
                degraded_reason=answer.degraded_reason,
                connectors=parse_connector_status(answer.connector_status),
                vllm_container=vllm,
                pool_bytes=answer.pool_bytes,
                used_bytes=answer.used_bytes,
            )
        )
    return reports


def _result(future: concurrent.futures.Future[StatsAnswer]) -> StatsAnswer | None:
    if not future.done() or future.cancelled():
        return None
    try:
        return future.result(timeout=0)
    except Exception:  # noqa: BLE001 - any failure to ask is "unreachable"
        return None
