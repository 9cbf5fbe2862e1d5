"""`kvoffload sidecar` and `kvoffload stats`: argv in, exit code out.

Exit codes: 0 ok; 2 a bad setting (one line on stderr naming it); 1 `stats` could not reach a
serving sidecar. With `--on-pool-error degrade` (what the injector sets) a bad setting or a pool
that cannot be built does not exit: the sidecar serves degraded (degraded.py) until SIGTERM,
retrying every `--pool-retry-interval` seconds when the reason can go away (no room, no pool dir).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

from kvoffload_sidecar import filemode
from kvoffload_sidecar.config import (
    ConfigError,
    EarlySettings,
    SidecarConfig,
    check_environment,
    early_settings,
    parse_config,
    remove_dead_instance,
)
from kvoffload_sidecar.connector_status import describe
from kvoffload_sidecar.units import format_bytes, format_seconds

log = logging.getLogger("kvoffload_sidecar")
STATS_DEADLINE_S = 3.0


def configure_logging(level: str) -> None:
    """One format for every line the sidecar writes (including the Pool's pre-fault progress)."""
    logging.basicConfig(
        level=level,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        force=True,
    )
    quiet = max(logging.getLevelName(level), logging.INFO)  # their DEBUG lines are per-call noise
    for noisy in ("grpc", "asyncio"):
        logging.getLogger(noisy).setLevel(quiet)


def _describe(config: SidecarConfig) -> str:
    numa = "default" if config.numa_node is None else str(config.numa_node)
    return (
        f"pool {format_bytes(config.pool_size)} in {config.pool_dir} (eviction {config.eviction}, "
        f"hugepages {config.hugepages}, numa {numa}, namespaces {config.max_namespaces}, "
        f"client timeout {config.client_timeout_s:g}s, detach grace {config.detach_grace_s:g}s, "
        f"tenants {'off' if config.tenants is None else config.tenants.describe()})"
    )


def main_sidecar(argv: Sequence[str]) -> int:
    """Validate the settings, then run the sidecar until SIGTERM."""
    early = early_settings(argv)
    try:
        config = parse_config(argv)
    except ConfigError as exc:
        return _refuse(early, exc, checking=False)
    except SystemExit as exc:  # --help
        return int(exc.code or 0)
    filemode.set_mode(config.file_mode)  # before anything creates a socket or the pool file
    try:
        warnings = check_environment(config)
    except ConfigError as exc:
        if config.on_pool_error == "degrade":
            from kvoffload_sidecar.degraded import from_config_error

            failure = from_config_error(exc, checking=True)
            if failure.retryable:  # no room or no pool dir yet: serve degraded and retry
                configure_logging(config.log_level)
                from kvoffload_sidecar.runtime import run

                return run(config, failure)
        return _refuse(early, exc, checking=True)
    configure_logging(config.log_level)
    for warning in warnings:
        log.warning("%s", warning)
    remove_dead_instance(config)  # check_environment found nobody serving the socket
    if hasattr(signal, "SIGUSR1"):  # `kill -USR1` prints every thread's stack (a stuck sidecar)
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    log.info("starting: %s", _describe(config))
    from kvoffload_sidecar.runtime import run  # grpc and the Pool only once settings are valid

    return run(config)


def _refuse(early: EarlySettings, exc: ConfigError, *, checking: bool) -> int:
    """A settings problem: exit 2 with one line, or serve degraded with --on-pool-error degrade."""
    if early.on_pool_error != "degrade":
        print(f"kvoffload sidecar: error: {exc}", file=sys.stderr)
        return 2
    configure_logging(early.log_level)
    filemode.set_mode(early.file_mode)
    from kvoffload_sidecar.degraded import Endpoints, from_config_error, run_degraded

    endpoints = Endpoints(early.socket, early.listen, early.metrics_listen)
    return run_degraded(endpoints, from_config_error(exc, checking=checking))


# -- kvoffload stats ------------------------------------------------------------------------------


def _plain(message: Any) -> dict[str, Any]:
    """A proto message as plain JSON values (ints stay ints, every field present)."""
    out: dict[str, Any] = {}
    for fd in message.DESCRIPTOR.fields:
        value = getattr(message, fd.name)
        if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
            out[fd.name] = dict(value)
        elif fd.message_type is not None and fd.is_repeated:
            out[fd.name] = [_plain(item) for item in value]
        elif fd.message_type is not None:
            out[fd.name] = _plain(value)
        elif fd.is_repeated:
            out[fd.name] = list(value)
        else:
            out[fd.name] = value
    return out


def _ratio(hits: int, misses: int) -> str:
    return f"{hits / (hits + misses):.1%}" if hits + misses else "-"


def adoption_lines(adoption: Any) -> list[str]:
    """What this sidecar's start did with the pool file it found (one line; none when new)."""
    if not adoption.outcome or adoption.outcome == "new":
        return []
    dropped = ", ".join(f"{n} {why}" for why, n in sorted(adoption.discarded_blocks.items()))
    if adoption.outcome == "adopted":
        return [
            f"adoption: adopted {adoption.adopted_blocks} blocks in "
            f"{adoption.adopted_namespaces} namespace(s) in {adoption.adopt_seconds:.3f}s "
            f"(boot {adoption.boots}; not adopted: {dropped or 'none'})"
        ]
    return [f"adoption: discarded the pool file's contents: {adoption.reason}"]


def format_stats(resp: Any) -> str:
    """The readable table: a pool-wide line, one row per namespace, one row per RPC method."""
    prefault = resp.prefaulted_bytes / resp.pool_bytes if resp.pool_bytes else 0.0
    if resp.degraded_reason:
        lines = [
            f"pool: degraded, serving without a pool: {resp.degraded_reason}",
            f"uptime {resp.uptime_seconds:.0f}s, version {resp.version}",
        ]
        return "\n".join(lines + connector_lines(resp.connector_status))
    lines = [
        f"pool: {format_bytes(resp.pool_bytes)}, pre-faulted {prefault:.0%} "
        f"({'ready' if resp.pool_ready else 'not ready'}), eviction {resp.eviction_policy}, "
        f"generation {resp.pool_generation}, uptime {resp.uptime_seconds:.0f}s, "
        f"version {resp.version}",
        *shared_lines(resp),
        *adoption_lines(resp.adoption),
        *connector_lines(resp.connector_status),
        "",
    ]
    header = (
        "namespace",
        "model",
        "ranks",
        "slots",
        "capacity",
        "used",
        "tokens",
        "pinned",
        "hit ratio",
        "lookups",
        "stores",
        "loads",
        "evictions",
        "stored",
        "loaded",
        "clients",
    )
    rows = [header]
    for ns in resp.namespaces:
        rows.append(
            (
                ns.namespace_id[:12],
                ns.spec.model,
                str(ns.num_ranks),
                str(ns.slot_count),
                format_bytes(ns.capacity_bytes),
                format_bytes(ns.used_bytes),
                f"{ns.used_tokens}/{ns.capacity_tokens}",
                format_bytes(ns.pinned_bytes),
                _ratio(ns.hit_blocks, ns.miss_blocks),
                str(ns.lookups),
                str(ns.stored_blocks),
                str(ns.loaded_blocks),
                str(ns.evicted_blocks),
                format_bytes(ns.stored_bytes),
                format_bytes(ns.loaded_bytes),
                str(ns.live_clients),
            )
        )
    if len(rows) == 1:
        lines.append("no namespaces registered")
    else:
        lines += _table(rows)
    lines += tenant_lines(resp.namespaces)
    lines.append("")
    latency = [("method", "calls", "p50", "p99")]
    latency += [
        (
            lat.method,
            str(lat.count),
            format_seconds(lat.p50_seconds),
            format_seconds(lat.p99_seconds),
        )
        for lat in resp.rpc_latency
    ]
    lines += _table(latency) if len(latency) > 1 else ["no RPCs yet"]
    return "\n".join(lines)


def shared_lines(resp: Any) -> list[str]:
    """Node placement: which shared pool this is and who shares it (none in pod placement)."""
    if resp.placement != "node":
        return []
    p = resp.shared
    return [
        f"placement node: pool {p.pool_id} (node pool {p.node_pool}, node {p.node}, tenant "
        f"{p.tenant}), shared by {p.attached_pods} pod(s) attached, {p.active_pods} with a "
        f"live client ({p.live_clients} client(s)); tenant memory {format_bytes(p.capacity_bytes)}"
        f", used {format_bytes(p.used_bytes)}: count it once per pool id, not per replica"
    ]


def tenant_lines(namespaces: Sequence[Any]) -> list[str]:
    """Per-tenant quotas (--tenants): a blank line and one row per namespace and tenant;
    nothing when no namespace has tenants."""
    header = ("namespace", "tenant", "guaranteed", "max", "used", "hit ratio", "lookups")
    rows = [(*header, "stores", "evictions")]
    for ns in namespaces:
        for t in ns.tenants:
            rows.append(
                (
                    ns.namespace_id[:12],
                    t.name,
                    f"{t.guaranteed_fraction:.0%} ({t.guaranteed_slots})",
                    f"{t.max_fraction:.0%} ({t.max_slots})",
                    f"{format_bytes(t.used_bytes)} ({t.used_slots})",
                    _ratio(t.hit_blocks, t.miss_blocks),
                    str(t.lookups),
                    str(t.stored_blocks),
                    str(t.evicted_blocks),
                )
            )
    return ["", *_table(rows)] if len(rows) > 1 else []


def connector_lines(status_json: str) -> list[str]:
    """One line per connector status entry ("connector scheduler rank 0: disabled: ...")."""
    try:
        entries = json.loads(status_json) if status_json else []
    except ValueError:
        return []
    if not isinstance(entries, list):
        return []
    return [describe(e) for e in entries if isinstance(e, dict)]


def _table(rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]


def main_stats(argv: Sequence[str]) -> int:
    """Print one sidecar's Stats as a table or JSON; exit 1 when it is not serving."""
    parser = argparse.ArgumentParser(prog="kvoffload stats", description=main_stats.__doc__)
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--socket", default=os.environ.get("KVOFFLOAD_SOCKET"), help="sidecar Unix socket"
    )
    where.add_argument("--address", help="HOST:PORT of the sidecar's --listen (health + Stats)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument(
        "--timeout", type=float, default=STATS_DEADLINE_S, help="deadline in seconds"
    )
    try:
        ns = parser.parse_args(list(argv))
    except SystemExit as exc:
        return int(exc.code or 0)
    if not ns.socket and not ns.address:
        print(
            "kvoffload stats: error: --socket (env KVOFFLOAD_SOCKET) or --address is required",
            file=sys.stderr,
        )
        return 2
    if ns.socket and not os.path.exists(ns.socket):
        print(f"kvoffload stats: error: no sidecar socket at {ns.socket}", file=sys.stderr)
        return 1
    import grpc
    from kvoffload.v1 import pool_pb2, pool_pb2_grpc

    target = f"unix:{os.path.abspath(ns.socket)}" if ns.socket else ns.address
    try:
        with grpc.insecure_channel(target) as channel:
            resp = pool_pb2_grpc.KVPoolStub(channel).Stats(
                pool_pb2.StatsRequest(), timeout=ns.timeout
            )
    except grpc.RpcError as exc:
        detail = exc.details() if hasattr(exc, "details") else str(exc)
        code = exc.code().name if hasattr(exc, "code") else "ERROR"
        print(
            f"kvoffload stats: error: sidecar at {target} is not serving ({code}: {detail})",
            file=sys.stderr,
        )
        return 1
    print(json.dumps(_plain(resp), indent=2, sort_keys=True) if ns.json else format_stats(resp))
    return 0
