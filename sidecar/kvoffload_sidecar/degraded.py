"""A sidecar that could not build its pool, still up: `--on-pool-error degrade`.

As a native sidecar, this process gates the vLLM container through its startup probe, and a
crash-looping sidecar holds the pod's readiness forever. So when no pool can be built (a NUMA
node that does not exist, no hugepages, no room, an unusable pool dir) the process stays up and
says why instead: gRPC health SERVING (probes pass), `Stats` with `degraded_reason` (Unix socket
and `--listen`), `kvoffload_pool_degraded{reason} 1` on /metrics, one log line, and every pool
call answered FAILED_PRECONDITION naming the reason: a connector treats a refused registration
as "no pool" and vLLM serves without it. When even the socket cannot be served, the process
sleeps until SIGTERM (never exits), so the container does not crash-loop.

A reason that can go away (no space, no memory, a pool dir not yet writable, a pool file that
could not be made) is retried every `--pool-retry-interval` seconds while this process serves the
socket; once a pool is built the caller serves it (the degraded servers stop first).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from kvoffload.v1 import pool_pb2 as pb
from kvoffload.v1 import pool_pb2_grpc as pb_grpc

from kvoffload_sidecar.config import ConfigError, remove_stale_socket, socket_is_live
from kvoffload_sidecar.connector_status import read_connector_status
from kvoffload_sidecar.metrics import MetricsHttpServer, SidecarMetrics, package_version
from kvoffload_sidecar.server import SERVICE_NAME, add_servicer, bind_unix, new_server

if TYPE_CHECKING:
    from kvoffload_sidecar.pool import Pool

log = logging.getLogger("kvoffload_sidecar")

# check_environment's flag -> reason code (ConfigError.setting)
_SETTING_CODES = {
    "pool_dir": "pool_dir",
    "pool_size": "no_space",
    "hugepages": "hugepages",
    "numa_node": "numa_node",
    "socket": "socket",
}
_DIR_ERRNOS = {errno.EACCES, errno.EPERM, errno.ENOENT, errno.ENOTDIR, errno.EROFS}
# Reasons that can go away while the pod runs (memory freed, a dir mounted or made writable);
# a bad setting, a missing NUMA node or hugetlbfs mount stay as they are: no retry.
RETRYABLE = frozenset({"no_space", "no_memory", "pool_error", "pool_dir"})

Retry = Callable[[], "Pool | None"]
"""One more attempt at building the pool: the started Pool, or None (still degraded)."""


@dataclass(frozen=True)
class Degraded:
    """Why there is no pool: a short code (the metric's label) and the full reason."""

    code: str
    reason: str

    @property
    def retryable(self) -> bool:
        return self.code in RETRYABLE

    @property
    def log_line(self) -> str:
        return f"kvoffload sidecar: degraded, serving without a pool: {self.reason}"


@dataclass(frozen=True)
class Endpoints:
    """Where a degraded sidecar answers; known even when the other settings are bad."""

    socket: Path | None
    listen: str | None = None
    metrics_listen: str | None = None


def from_config_error(exc: ConfigError, *, checking: bool) -> Degraded:
    """A settings problem; `checking`: raised by check_environment (the flag names the code)."""
    code = _SETTING_CODES.get(exc.setting, "bad_setting") if checking else "bad_setting"
    return Degraded(code, str(exc))


def from_pool_error(exc: BaseException, pool_dir: Path) -> Degraded:
    """A failed `Pool.start()`, by cause: no_space, no_memory, pool_dir, numa_node, hugepages."""
    text = str(exc)
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        code = "no_space"
    elif isinstance(exc, OSError) and exc.errno == errno.ENOMEM:
        code = "no_memory"
    elif isinstance(exc, OSError) and exc.errno in _DIR_ERRNOS:
        code = "pool_dir"
    elif "numa" in text.lower():
        code = "numa_node"
    elif "hugepage" in text.lower() or "huge page" in text.lower():
        code = "hugepages"
    else:
        code = "pool_error"
    return Degraded(code, f"cannot create the pool in {pool_dir}: {text}")


class DegradedServicer(pb_grpc.KVPoolServicer):
    """KVPool without a pool: Stats says why; every other call is FAILED_PRECONDITION."""

    def __init__(self, degraded: Degraded, status_dir: Path | None) -> None:
        self._degraded = degraded
        self._status_dir = status_dir
        self._version = package_version()
        self._started = time.monotonic()
        self._message = f"sidecar degraded, serving without a pool: {degraded.reason}"

    async def Stats(self, request: Any, context: Any) -> pb.StatsResponse:
        return pb.StatsResponse(
            degraded_reason=self._degraded.reason,
            connector_status=read_connector_status(self._status_dir),
            uptime_seconds=time.monotonic() - self._started,
            version=self._version,
        )

    async def _refuse(self, request: Any, context: Any) -> Any:
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, self._message)

    Register = Lookup = ReserveLoad = Release = _refuse
    ReserveStore = CommitStore = AbortStore = Session = _refuse


class StatsOnly(pb_grpc.KVPoolServicer):
    """The TCP listener's face: Stats only (like the healthy sidecar's `--listen`)."""

    def __init__(self, servicer: DegradedServicer) -> None:
        self.Stats = servicer.Stats  # type: ignore[method-assign]


async def _retry_until_built(retry: Retry, interval_s: float, stop: asyncio.Event) -> Pool | None:
    """Call `retry` every `interval_s` until it builds a pool (returned) or `stop` is set."""
    attempts = 1  # the one that failed before this process went degraded
    while True:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), interval_s)
        if stop.is_set():
            return None
        attempts += 1
        try:
            pool = await asyncio.to_thread(retry)
        except Exception:  # noqa: BLE001 - a failed attempt must never end the degraded sidecar
            log.exception("building the pool failed (attempt %d)", attempts)
            continue
        if pool is None:
            continue
        if stop.is_set():  # SIGTERM came while building: nothing will serve it
            pool.close()
            return None
        log.info("pool built after %d attempt(s); serving", attempts)
        return pool


async def _serve(
    endpoints: Endpoints,
    degraded: Degraded,
    stop: asyncio.Event,
    retry: Retry | None = None,
    retry_interval_s: float = 5.0,
) -> Pool | None:
    health_servicer = health.aio.HealthServicer()
    servicer = DegradedServicer(degraded, endpoints.socket.parent if endpoints.socket else None)
    servers: list[grpc.aio.Server] = []
    why_not: list[str] = []
    sock = endpoints.socket.absolute() if endpoints.socket else None
    if sock is None:
        why_not.append("no socket path is known (--socket / KVOFFLOAD_SOCKET)")
    elif not sock.parent.is_dir():
        why_not.append(f"cannot serve on {sock}: its directory does not exist")
        sock = None
    elif socket_is_live(sock):
        why_not.append(f"another process is serving on {sock}")
        sock = None  # never take over a live sidecar's socket
    if sock is not None:
        server = new_server()
        add_servicer(servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        try:
            remove_stale_socket(sock)
            bind_unix(server, sock)
            servers.append(server)
        except (OSError, RuntimeError) as exc:
            why_not.append(f"cannot serve on {sock}: {exc}")
            sock = None
    if endpoints.listen:
        tcp = new_server()
        add_servicer(StatsOnly(servicer), tcp)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, tcp)
        try:
            tcp.add_insecure_port(endpoints.listen)
            servers.append(tcp)
        except RuntimeError as exc:
            why_not.append(f"cannot listen on {endpoints.listen}: {exc}")
    http: MetricsHttpServer | None = None
    if endpoints.metrics_listen:
        try:
            metrics = SidecarMetrics(
                None,
                degraded_code=degraded.code,
                status_dir=endpoints.socket.parent if endpoints.socket else None,
            )
            http = metrics.serve_http(endpoints.metrics_listen)
            host = endpoints.metrics_listen.rpartition(":")[0]
            log.info("metrics on http://%s:%d/metrics", host, http.port)
        except (OSError, ValueError) as exc:
            why_not.append(f"cannot serve metrics on {endpoints.metrics_listen}: {exc}")
    log.error("%s", degraded.log_line)
    if why_not:
        log.error("kvoffload sidecar: degraded and %s", "; ".join(why_not))
    try:
        for server in servers:
            await server.start()
        for name in ("", SERVICE_NAME):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        if sock is not None:
            log.info("serving health and Stats (degraded) on unix:%s", sock)
        if retry is not None and sock is not None and degraded.retryable:
            # Only while this process holds the socket: no other sidecar serves this pod's pool.
            log.info("retrying to build the pool every %gs", retry_interval_s)
            return await _retry_until_built(retry, retry_interval_s, stop)
        await stop.wait()
        return None
    finally:
        await asyncio.gather(*(server.stop(0.2) for server in servers))
        if http is not None:
            http.close()
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.unlink()


async def serve_degraded(
    endpoints: Endpoints,
    degraded: Degraded,
    *,
    stop: asyncio.Event | None = None,
    retry: Retry | None = None,
    retry_interval_s: float = 5.0,
) -> Pool | None:
    """Serve what can be served without a pool until `stop` or SIGTERM/SIGINT (None), or until
    `retry` built a pool (returned, started; the degraded servers are stopped by then)."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    return await _serve(endpoints, degraded, stop, retry, retry_interval_s)


def run_degraded(endpoints: Endpoints, degraded: Degraded) -> int:
    """The process exit code (0) once SIGTERM/SIGINT arrived; never returns before."""
    asyncio.run(serve_degraded(endpoints, degraded))
    log.info("stopped")
    return 0


def degraded_until_built(
    endpoints: Endpoints, degraded: Degraded, retry: Retry, retry_interval_s: float
) -> Pool | None:
    """Serve degraded, retrying when the reason can go away: the built Pool, or None once
    SIGTERM/SIGINT arrived (the process then exits 0)."""
    return asyncio.run(
        serve_degraded(endpoints, degraded, retry=retry, retry_interval_s=retry_interval_s)
    )
