"""Run one sidecar process: Pool up, server up, reaper, signals, drain, Pool down.

Shutdown order on SIGTERM/SIGINT (see STYLE.md §4): health NOT_SERVING, `pool.begin_drain()`,
`server.stop(grace)` (open sessions end, their pins are released), `pool.close()`, exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

from kvoffload_sidecar.config import SidecarConfig, remove_dead_instance, resident_pool_bytes
from kvoffload_sidecar.degraded import (
    Degraded,
    Endpoints,
    degraded_until_built,
    from_pool_error,
    run_degraded,
)
from kvoffload_sidecar.errors import PoolError
from kvoffload_sidecar.keymap import native_enabled
from kvoffload_sidecar.memory_room import memory_room, pool_shortfall
from kvoffload_sidecar.metrics import MetricsHttpServer
from kvoffload_sidecar.pool import Pool, PoolSettings
from kvoffload_sidecar.server import SidecarServer, create_server

log = logging.getLogger("kvoffload_sidecar")


def pool_settings(config: SidecarConfig) -> PoolSettings:
    return PoolSettings(
        pool_size=config.pool_size,
        pool_dir=config.pool_dir,
        eviction=config.eviction,
        hugepages=config.hugepages,
        numa_node=config.numa_node,
        max_namespaces=config.max_namespaces,
        client_timeout_s=config.client_timeout_s,
        detach_grace_s=config.detach_grace_s,
        reserved_hold_s=config.reserved_hold_s,
        tenants=config.tenants,
    )


async def reap_forever(pool: Pool, interval_s: float, sidecar: SidecarServer | None = None) -> None:
    """Reap clients that went idle without a session, and rebuild a pool file truncated or
    replaced under us (then end every session: the connectors register again and re-map to the
    new generation); errors are logged, never fatal."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            if pool.check_file() and sidecar is not None:
                await sidecar.end_sessions()
        except Exception:  # noqa: BLE001
            log.exception("checking the pool file failed")
        try:
            reaped = pool.reap_idle_clients()
        except Exception:  # noqa: BLE001
            log.exception("reaping idle clients failed")
            continue
        if reaped:
            log.info("reaped %d idle client(s)", reaped)


async def serve(config: SidecarConfig, pool: Pool, *, stop: asyncio.Event | None = None) -> None:
    """Serve `pool` (already started) until `stop` is set or SIGTERM/SIGINT arrives, then drain."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    sidecar: SidecarServer = create_server(config, pool)
    http: MetricsHttpServer | None = None
    reaper: asyncio.Task[None] | None = None
    try:
        await sidecar.start()
        if config.metrics_listen:
            http = sidecar.metrics.serve_http(config.metrics_listen)
            host = config.metrics_listen.rpartition(":")[0]
            log.info("metrics on http://%s:%d/metrics", host, http.port)
        extra = f", health+Stats on TCP port {sidecar.tcp_port}" if config.listen else ""
        log.info(
            "serving KVPool on %s%s (key index: %s)",
            sidecar.socket_target,
            extra,
            "native" if native_enabled() else "dict",
        )
        reaper = asyncio.create_task(reap_forever(pool, config.reap_interval_s, sidecar))
        await stop.wait()
        log.info(
            "draining: %d open session(s), grace %.1fs",
            sidecar.servicer.open_sessions,
            config.drain_grace_s,
        )
    finally:
        # The handlers stay installed while draining: a repeated SIGTERM only sets `stop` again.
        if reaper is not None:
            reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reaper
        await sidecar.drain(config.drain_grace_s)
        if http is not None:
            http.close()
        with contextlib.suppress(OSError):
            config.socket.unlink()


def endpoints_of(config: SidecarConfig) -> Endpoints:
    return Endpoints(config.socket, config.listen, config.metrics_listen)


def build_pool(config: SidecarConfig) -> Pool | Degraded:
    """One attempt at building and starting the pool; why not when it failed. A pool the
    container's memory limit cannot hold is not started (memory_room.py: pre-faulting it would
    get this process OOM-killed, again after every restart)."""
    if not config.hugepages:  # hugetlbfs pages are not charged to the memory cgroup
        resident = resident_pool_bytes(config.pool_dir)
        short = pool_shortfall(config.pool_size, resident, memory_room())
        if short is not None:
            return Degraded("no_memory", short)
    pool = Pool(pool_settings(config))
    try:
        pool.start()
    except (OSError, ValueError, PoolError) as exc:
        return from_pool_error(exc, config.pool_dir)
    return pool


def run(config: SidecarConfig, failure: Degraded | None = None) -> int:
    """Start the Pool, serve until a signal, close the Pool; the process exit code.

    `failure`: the pool is already known not to fit (check_environment). Degraded with a reason
    that can go away, the sidecar retries and serves the pool once built.
    """
    built = build_pool(config) if failure is None else failure
    if isinstance(built, Degraded):
        if config.on_pool_error != "degrade":
            log.error("%s", built.reason)
            return 2

        def retry() -> Pool | None:
            again = build_pool(config)
            if isinstance(again, Pool):
                return again
            log.debug("still degraded: %s", again.reason)
            return None

        pool = degraded_until_built(
            endpoints_of(config), built, retry, config.pool_retry_interval_s
        )
        if pool is None:
            log.info("stopped")
            return 0
        remove_dead_instance(config)  # the degraded server's sockets, should any be left
    else:
        pool = built
    try:
        asyncio.run(serve(config, pool))
    except (OSError, RuntimeError) as exc:  # a listener that cannot bind (port taken, ...)
        if config.on_pool_error != "degrade":
            raise
        serve_failure = Degraded("serve_error", f"cannot serve the pool: {exc}")
    else:
        serve_failure = None
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):  # already draining: let pool.close() finish
            signal.signal(signum, signal.SIG_IGN)
        pool.close()
    if serve_failure is not None:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, signal.SIG_DFL)
        return run_degraded(endpoints_of(config), serve_failure)
    log.info("stopped")
    return 0
