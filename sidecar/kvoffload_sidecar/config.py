"""`kvoffload sidecar` settings: flags, `KVOFFLOAD_<FLAG>` environment variables, validation.

A flag wins over its environment variable; an empty environment variable counts as unset (pod
specs often template empty values). Every problem is raised as one `ConfigError` whose message
names the flag, the environment variable and the reason, so start-up fails with one clear line.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import stat
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from kvoffload_sidecar.filemode import DEFAULT_MODE, parse_mode
from kvoffload_sidecar.host import free_bytes, mount_of
from kvoffload_sidecar.keymap import native_enabled
from kvoffload_sidecar.numa import NUMA_ROOT
from kvoffload_sidecar.region import POOL_FILE_NAME
from kvoffload_sidecar.tenants import TenantsConfig, parse_tenants
from kvoffload_sidecar.units import format_bytes, parse_size

log = logging.getLogger(__name__)

ENV_PREFIX = "KVOFFLOAD_"
EVICTION_POLICIES = ("lru", "arc")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
MEMORY_FILESYSTEMS = ("tmpfs", "hugetlbfs")
MAX_UNIX_PATH = 107  # sun_path is 108 bytes including the terminating NUL on Linux
FRAMED_SUFFIX = ".session"  # the framed session socket sits beside the gRPC one (frames.py)


ON_POOL_ERROR = ("exit", "degrade")


class ConfigError(ValueError):
    """A bad setting; str(e) is the one line printed before exiting with code 2.

    `setting` is the flag's dest ("pool_dir", "numa_node", ...) when one flag is to blame: a
    sidecar run with `--on-pool-error degrade` turns it into its degraded reason code.
    """

    def __init__(self, message: str, setting: str = "") -> None:
        super().__init__(message)
        self.setting = setting


@dataclass(frozen=True)
class SidecarConfig:
    """Validated sidecar settings (flag or environment variable, see `build_parser`)."""

    pool_size: int
    """Bytes of the pool file, exactly; the pod's memory limit must cover it."""
    pool_dir: Path
    """Existing writable directory, memory-backed (tmpfs emptyDir, hugetlbfs), shared with vLLM."""
    socket: Path
    """Unix socket the KVPool service listens on; its parent directory must exist."""
    listen: str | None = None
    """Optional HOST:PORT for gRPC health + Stats over TCP (kubelet gRPC probes); None = off."""
    metrics_listen: str | None = None
    """Optional HOST:PORT for Prometheus /metrics over HTTP; None = off."""
    eviction: str = "lru"
    """Eviction policy: "lru" or "arc"."""
    hugepages: bool = False
    """pool_dir is a hugetlbfs mount; the pool is then rounded to 2 MiB pages."""
    numa_node: int | None = None
    """NUMA node to bind the pool's pages to (best effort); None = the kernel's default policy."""
    max_namespaces: int = 1
    """Equal pool partitions, one per namespace (model/layout); 1 suits one engine per pod."""
    client_timeout_s: float = 60.0
    """Seconds after which a client with no session and no call is reaped (pins released)."""
    detach_grace_s: float = 2.0
    """Seconds a client's pins and reservations outlive its last session (in-flight copies)."""
    reserved_hold_s: float = 30.0
    """After adopting a pool: seconds the slots a dead sidecar had reserved for stores stay out
    of use (a copy its engines queued may still land in them)."""
    framed_sessions: bool = True
    presence_map: bool = True
    """Also serve the Session protocol without gRPC on `<socket>.session` (frames.py)."""
    log_level: str = "INFO"
    """Python logging level name."""
    drain_grace_s: float = 5.0
    """Seconds in-flight RPCs get after SIGTERM; below the pod's terminationGracePeriodSeconds."""
    max_sessions: int = 64
    """Framed connections served at once; more are refused (each one holds a thread)."""
    on_pool_error: str = "exit"
    """"exit" (code 2) or "degrade": serve health + Stats without a pool when none can be built."""
    pool_retry_interval_s: float = 5.0
    """Degraded for a reason that can go away: seconds between attempts to build the pool."""
    tenants: TenantsConfig | None = None
    """Per-tenant quotas of each namespace's slots, by vLLM cache_salt (tenants.py); None: off."""
    file_mode: int = DEFAULT_MODE
    """Mode of the sockets and the pool file (`filemode`): 0600 (this user only) by default;
    the injector passes 0666 inside pods, where the emptyDirs are private to the pod."""

    @property
    def reap_interval_s(self) -> float:
        """How often clients are reaped: a quarter of the idle timeout or half the detach grace
        (whichever is shorter), between 0.1 s and 10 s."""
        period = self.client_timeout_s / 4
        if self.detach_grace_s > 0:
            period = min(period, self.detach_grace_s / 2)
        return min(10.0, max(0.1, period))


class _Parser(argparse.ArgumentParser):
    """argparse that raises ConfigError instead of printing usage and exiting."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(message)


@dataclass(frozen=True)
class _Flag:
    name: str  # "--pool-size"
    help: str
    required: bool = False
    is_switch: bool = False

    @property
    def dest(self) -> str:
        return self.name[2:].replace("-", "_")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.dest.upper()


_FLAGS: tuple[_Flag, ...] = (
    _Flag(
        "--pool-size", "pool size in bytes or with a unit: 64Gi, 512Mi, 1G, 1.5GiB", required=True
    ),
    _Flag("--pool-dir", "existing memory-backed directory for the pool file", required=True),
    _Flag("--socket", "Unix socket path for the KVPool gRPC service", required=True),
    _Flag("--listen", "HOST:PORT for gRPC health + Stats over TCP (optional)"),
    _Flag("--metrics-listen", "HOST:PORT for Prometheus /metrics over HTTP (optional)"),
    _Flag(
        "--file-mode",
        "octal mode of the sockets and the pool file (default 0600: this user only; 0660 shares "
        "with the group, 0666 with every user, as in a pod whose vLLM runs as another uid)",
    ),
    _Flag("--eviction", "eviction policy: lru (default) or arc"),
    _Flag("--hugepages", "the pool dir is a hugetlbfs mount", is_switch=True),
    _Flag("--numa-node", "NUMA node to bind the pool to (optional)"),
    _Flag("--max-namespaces", "pool partitions, one per namespace (default 1)"),
    _Flag(
        "--client-timeout", "seconds before an idle client without a session is reaped (default 60)"
    ),
    _Flag(
        "--detach-grace",
        "seconds a client's pins outlive its last session (default 2; 0: none); store "
        "reservations belong to the engine and end only by commit, abort or its death",
    ),
    _Flag(
        "--reserved-hold",
        "accepted for existing pod specs and ignored: slots reserved when a sidecar died stay "
        "out until the engine that reserved them is dead",
    ),
    _Flag(
        "--framed-sessions",
        "serve the connector's Session calls without gRPC on SOCKET.session: true (default), false",
    ),
    _Flag(
        "--presence-map",
        "write SOCKET.presence, which lets connectors answer most misses without a round trip: "
        "true (default), false",
    ),
    _Flag("--log-level", "DEBUG, INFO (default), WARNING, ERROR"),
    _Flag("--max-sessions", "framed session connections served at once (default 64)"),
    _Flag(
        "--on-pool-error",
        "when no pool can be built: exit (default, code 2) or degrade (serve health and Stats "
        "without a pool, answer Register FAILED_PRECONDITION)",
    ),
    _Flag(
        "--pool-retry-interval",
        "seconds between attempts to build the pool while degraded for a reason that can go "
        "away (no space, no memory, pool dir not writable) (default 5)",
    ),
    _Flag(
        "--tenants",
        "per-tenant quotas of each namespace's slots, by the requests' vLLM cache_salt: a JSON "
        'list such as [{"name": "a", "cacheSalts": ["a"], "guaranteed": "25%%", "max": "60%%"}] '
        '(a "default" entry without cacheSalts sets the shares of requests with no or an '
        "unknown salt: 0%% guaranteed, 100%% max when absent). Eviction takes from tenants "
        "above their guarantee first; a tenant at its max replaces only its own blocks. "
        "Blocks adopted after a restart count as the default tenant's (default: off)",
    ),
)


def build_parser(prog: str = "kvoffload sidecar") -> argparse.ArgumentParser:
    """The flag parser; every flag is read as text and validated by `load_config`."""
    parser = _Parser(
        prog=prog,
        description="Host-memory KV pool sidecar: gRPC KVPool service on a Unix socket.",
        epilog="Every flag may also come from KVOFFLOAD_<FLAG> (e.g. KVOFFLOAD_POOL_SIZE); "
        "the flag wins.",
    )
    for flag in _FLAGS:
        help_ = f"{flag.help} [env {flag.env}]"
        if flag.is_switch:
            parser.add_argument(flag.name, action="store_true", default=None, help=help_)
        else:
            parser.add_argument(flag.name, metavar=flag.dest.upper(), help=help_)
    return parser


def _error(flag: _Flag, source: str | None, problem: str) -> ConfigError:
    origin = f", here from {source}" if source else ""
    return ConfigError(f"{flag.name} (env {flag.env}{origin}): {problem}", flag.dest)


def _raw_values(
    ns: argparse.Namespace, environ: Mapping[str, str]
) -> dict[str, tuple[str, str | bool]]:
    """dest -> (source, raw value) for every flag given by flag or environment variable."""
    values: dict[str, tuple[str, str | bool]] = {}
    for flag in _FLAGS:
        given = getattr(ns, flag.dest)
        if given is not None:
            values[flag.dest] = (flag.name, given)
        elif environ.get(flag.env, "") != "":
            values[flag.dest] = (flag.env, environ[flag.env])
        elif flag.required:
            raise ConfigError(f"{flag.name} (env {flag.env}) is required", flag.dest)
    return values


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{text!r} is not a boolean (true/false, 1/0, yes/no)")


def _parse_host_port(text: str) -> str:
    host, sep, port_text = text.rpartition(":")
    if not sep or not host or not port_text.isdigit():
        raise ValueError(f"{text!r} is not HOST:PORT (e.g. 0.0.0.0:9090, [::]:9090)")
    port = int(port_text)
    if not 0 <= port <= 65535:
        raise ValueError(f"port {port} is out of range 0..65535")
    if ":" in host and not host.startswith("["):  # a bare IPv6 address, e.g. $(POD_IP)
        return f"[{host}]:{port}"
    return text


def _parse_int(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            raise ValueError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise ValueError(f"{value} must be at least {minimum}")
        return value

    return parse


def _parse_seconds(text: str) -> float:
    try:
        value = float(text.strip())
    except ValueError:
        raise ValueError(f"{text!r} is not a number of seconds") from None
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{text!r} must be a positive, finite number of seconds")
    return value


def _parse_grace(text: str) -> float:
    try:
        value = float(text.strip())
    except ValueError:
        raise ValueError(f"{text!r} is not a number of seconds") from None
    if not 0 <= value <= 3600:
        raise ValueError(f"{text!r} must be between 0 and 3600 seconds")
    return value


def _parse_choice(choices: Sequence[str], *, upper: bool = False) -> Callable[[str], str]:
    def parse(text: str) -> str:
        value = text.strip().upper() if upper else text.strip().lower()
        if value not in choices:
            raise ValueError(f"{text!r} is not one of {', '.join(choices)}")
        return value

    return parse


_PARSERS: dict[str, Callable[[str], Any]] = {
    "pool_size": parse_size,
    "pool_dir": lambda text: Path(text),
    "socket": lambda text: Path(text),
    "listen": _parse_host_port,
    "metrics_listen": _parse_host_port,
    "file_mode": parse_mode,
    "eviction": _parse_choice(EVICTION_POLICIES),
    "hugepages": _parse_bool,
    "framed_sessions": _parse_bool,
    "presence_map": _parse_bool,
    "numa_node": _parse_int(0),
    "max_namespaces": _parse_int(1),
    "client_timeout": _parse_seconds,
    "detach_grace": _parse_grace,
    "reserved_hold": _parse_grace,
    "log_level": _parse_choice(LOG_LEVELS, upper=True),
    "max_sessions": _parse_int(1),
    "on_pool_error": _parse_choice(ON_POOL_ERROR),
    "pool_retry_interval": _parse_seconds,
    "tenants": parse_tenants,
}
_FIELD_OF = {
    "client_timeout": "client_timeout_s",
    "detach_grace": "detach_grace_s",
    "reserved_hold": "reserved_hold_s",
    "pool_retry_interval": "pool_retry_interval_s",
}


def parse_config(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> SidecarConfig:
    """Flags + environment -> SidecarConfig, checking values only (no filesystem access)."""
    env = os.environ if environ is None else environ
    ns = build_parser().parse_args(list(argv))
    fields: dict[str, Any] = {}
    by_dest = {flag.dest: flag for flag in _FLAGS}
    for dest, (source, raw) in _raw_values(ns, env).items():
        flag = by_dest[dest]
        try:
            value = raw if isinstance(raw, bool) else _PARSERS[dest](raw)
        except ValueError as exc:
            raise _error(flag, source, str(exc)) from None
        fields[_FIELD_OF.get(dest, dest)] = value
    return SidecarConfig(**fields)


def resident_pool_bytes(pool_dir: Path) -> int:
    """The bytes a pool file left in `pool_dir` already holds in memory (a restarted sidecar
    adopts them, so they count as room); 0 without one."""
    try:
        existing = pool_dir / POOL_FILE_NAME
        return existing.stat().st_blocks * 512 if existing.is_file() else 0
    except OSError:
        return 0


def check_environment(config: SidecarConfig, *, mounts_text: str | None = None) -> list[str]:
    """Check the settings against this machine; ConfigError on a fatal problem, else warnings."""
    warnings: list[str] = []
    flag = {f.dest: f for f in _FLAGS}
    where = None  # the value's source is no longer known here; the message names both

    pool_dir = config.pool_dir
    if not pool_dir.exists():
        raise _error(flag["pool_dir"], where, f"{str(pool_dir)!r} does not exist")
    if not pool_dir.is_dir():
        raise _error(flag["pool_dir"], where, f"{str(pool_dir)!r} is not a directory")
    if not os.access(pool_dir, os.W_OK | os.X_OK):
        raise _error(flag["pool_dir"], where, f"{str(pool_dir)!r} is not writable")
    point, fstype = mount_of(pool_dir, mounts_text)
    if config.hugepages and fstype != "hugetlbfs":
        raise _error(
            flag["hugepages"], where, f"{str(pool_dir)!r} is on {fstype} ({point}), not hugetlbfs"
        )
    if fstype not in MEMORY_FILESYSTEMS:
        warnings.append(
            f"--pool-dir {str(pool_dir)!r} is on {fstype} ({point}), not tmpfs/hugetlbfs: "
            "the pool may be written back to disk"
        )
    free = free_bytes(pool_dir)
    available = 0 if free is None else free + resident_pool_bytes(pool_dir)
    if free is not None and config.pool_size > available:
        raise _error(
            flag["pool_size"],
            where,
            f"{format_bytes(config.pool_size)} does not fit in {str(pool_dir)!r} "
            f"({format_bytes(available)} available)",
        )

    sock = config.socket
    if len(os.fsencode(sock)) > MAX_UNIX_PATH:
        raise _error(flag["socket"], where, f"path is longer than {MAX_UNIX_PATH} bytes")
    if not sock.parent.is_dir():
        raise _error(flag["socket"], where, f"parent directory {str(sock.parent)!r} does not exist")
    if not os.access(sock.parent, os.W_OK | os.X_OK):
        raise _error(
            flag["socket"], where, f"parent directory {str(sock.parent)!r} is not writable"
        )
    if sock.exists() or sock.is_symlink():
        if not stat.S_ISSOCK(sock.lstat().st_mode):
            if config.on_pool_error != "degrade":
                raise _error(flag["socket"], where, f"{str(sock)!r} exists and is not a socket")
            # In a pod (the injector sets degrade) the run dir is this sidecar's own emptyDir:
            # whatever sits at its socket path is in the way, not someone else's data.
            warnings.append(f"{str(sock)!r} exists and is not a socket: replacing it")
        if socket_is_live(sock):
            raise _error(flag["socket"], where, f"another process is serving on {str(sock)!r}")

    if config.framed_sessions:
        framed = sock.with_name(sock.name + FRAMED_SUFFIX)
        if len(os.fsencode(framed)) > MAX_UNIX_PATH:
            raise _error(
                flag["socket"],
                where,
                f"{str(framed)!r} (the framed session socket beside it) is longer than "
                f"{MAX_UNIX_PATH} bytes: shorten the path or set --framed-sessions false",
            )
        if framed.exists() and stat.S_ISSOCK(framed.lstat().st_mode) and socket_is_live(framed):
            raise _error(flag["socket"], where, f"another process is serving on {str(framed)!r}")

    if config.numa_node is not None and not (NUMA_ROOT / f"node{config.numa_node}").is_dir():
        raise _error(
            flag["numa_node"], where, f"node {config.numa_node} does not exist under {NUMA_ROOT}"
        )
    try:
        native_enabled()  # read again for every namespace: a bad value must stop start-up
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return warnings


def socket_is_live(path: Path) -> bool:
    """True when a process accepts connections on the Unix socket `path`."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(0.5)
    try:
        probe.connect(str(path))
    except OSError:
        return False
    finally:
        probe.close()
    return True


def remove_stale_socket(path: Path) -> bool:
    """Remove a socket file nobody serves on (left by a killed sidecar); True when removed."""
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return False
    if stat.S_ISSOCK(mode) and not socket_is_live(path):
        path.unlink()
        log.info("removed stale socket %s", path)
        return True
    return False


def remove_dead_instance(config: SidecarConfig) -> list[Path]:
    """The sockets of a sidecar that died in this pod (SIGKILL, OOM); returns those removed.

    Only when no process serves `config.socket`: a live sidecar is never touched. Its pool file
    stays: vLLM may still map it, so the new pool reuses it (region.py) rather than needing room
    for a second one in a size-limited emptyDir.
    """
    sock = config.socket
    if sock.exists() and socket_is_live(sock):
        return []
    owned = config.on_pool_error == "degrade"
    return [
        path
        for path in (sock, sock.with_name(sock.name + FRAMED_SUFFIX))
        if remove_stale_socket(path) or (owned and _remove_non_socket(path))
    ]


def _remove_non_socket(path: Path) -> bool:
    """Remove a file or link that is not a socket at one of our socket paths (degrade mode only:
    a pod's run dir belongs to its sidecar); True when removed."""
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return False
    if stat.S_ISSOCK(mode) or stat.S_ISDIR(mode):
        return False
    path.unlink()
    log.warning("removed %s: not a socket, and the sidecar serves there", path)
    return True


@dataclass(frozen=True)
class EarlySettings:
    """What a sidecar with bad settings still needs: whether to degrade, and where to answer."""

    on_pool_error: str = "exit"
    socket: Path | None = None
    listen: str | None = None
    metrics_listen: str | None = None
    log_level: str = "INFO"
    file_mode: int = DEFAULT_MODE


def early_settings(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> EarlySettings:
    """The few settings read leniently before validation; an unusable one takes its default."""
    env = os.environ if environ is None else environ
    parser = _Parser(add_help=False)
    wanted = (
        "--on-pool-error",
        "--socket",
        "--listen",
        "--metrics-listen",
        "--log-level",
        "--file-mode",
    )
    for name in wanted:
        parser.add_argument(name)
    try:
        ns, _ = parser.parse_known_args(list(argv))
    except ConfigError:
        ns = argparse.Namespace(**{name[2:].replace("-", "_"): None for name in wanted})

    def value(dest: str, parse: Callable[[str], Any]) -> Any:
        raw = getattr(ns, dest, None)
        if raw is None:
            raw = env.get(ENV_PREFIX + dest.upper()) or None
        if raw is None:
            return None
        try:
            return parse(raw)
        except ValueError:
            return None

    return EarlySettings(
        on_pool_error=value("on_pool_error", _PARSERS["on_pool_error"]) or "exit",
        socket=value("socket", _PARSERS["socket"]),
        listen=value("listen", _parse_host_port),
        metrics_listen=value("metrics_listen", _parse_host_port),
        log_level=value("log_level", _PARSERS["log_level"]) or "INFO",
        file_mode=value("file_mode", parse_mode) or DEFAULT_MODE,
    )
