"""`kvoffload probe`: the native sidecar's startup probe, which never holds vLLM for long.

A native sidecar's startup probe gates the vLLM container: while it fails, vLLM does not start.
A sidecar that cannot come up must not keep vLLM waiting, so this probe passes as soon as the
sidecar's Unix socket accepts a connection, or once `--deadline` seconds have passed since the
first probe of this container, whichever comes first (vLLM then starts without the pool; the
connector attaches later if the sidecar comes up).

It runs every second inside the sidecar container, so it is stdlib only (no grpc, no protobuf)
and imports nothing else of this package. The first probe's time is kept in a marker file beside
the socket (the run dir is a writable emptyDir; the root filesystem may be read-only).

Exit codes: 0 serving or deadline passed (one line saying which); 1 not yet; 2 bad arguments.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path

MARKER_NAME = ".kvoffload-probe-start"
CONNECT_TIMEOUT_S = 0.5


def accepts(path: Path, timeout: float = CONNECT_TIMEOUT_S) -> bool:
    """True when something accepts connections on the Unix socket `path`."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(str(path))
    except OSError:
        return False
    finally:
        sock.close()
    return True


def container_age(proc: Path = Path("/proc")) -> float | None:
    """Seconds since this PID namespace's first process started (the container, or the pod with
    a shared process namespace); None when /proc does not say."""
    try:
        uptime = float((proc / "uptime").read_text().split()[0])
        fields = (proc / "1" / "stat").read_text().rpartition(")")[2].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: starttime, in ticks
    except (OSError, ValueError, IndexError):
        return None
    return max(0.0, uptime - started)


def first_probe_time(marker: Path, now: float) -> float:
    """When the first probe ran (wall clock seconds), recording `now` if this is the first.

    Without a usable marker (a missing or read-only dir, a garbage file) the container's age
    stands in for it, so the deadline still passes.
    """
    try:
        fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except FileExistsError:
        try:
            return float(marker.read_text().strip())
        except (OSError, ValueError):
            return now - (container_age() or 0.0)
    except OSError:
        return now - (container_age() or 0.0)
    try:
        os.write(fd, f"{now:.3f}\n".encode())
    finally:
        os.close(fd)
    return now


def probe(sock: Path, deadline_s: float, *, now: float | None = None) -> tuple[int, str]:
    """(exit code, line to print) for one probe."""
    if accepts(sock):
        return 0, f"sidecar serving on {sock}"
    now = time.time() if now is None else now
    waited = now - first_probe_time(sock.parent / MARKER_NAME, now)
    if waited >= deadline_s:
        return 0, f"sidecar not serving after {waited:.0f}s; letting vLLM start without waiting"
    return 1, f"sidecar not serving on {sock} yet ({waited:.0f}s of {deadline_s:g}s)"


def main_probe(argv: Sequence[str]) -> int:
    """Exit 0 once the sidecar's socket accepts connections or the deadline has passed."""
    parser = argparse.ArgumentParser(prog="kvoffload probe", description=main_probe.__doc__)
    parser.add_argument(
        "--socket",
        default=os.environ.get("KVOFFLOAD_SOCKET") or None,
        help="sidecar Unix socket [env KVOFFLOAD_SOCKET]",
    )
    parser.add_argument(
        "--deadline",
        type=float,
        default=10.0,
        help="seconds after the first probe at which the probe passes anyway (default 10)",
    )
    try:
        ns = parser.parse_args(list(argv))
    except SystemExit as exc:
        return int(exc.code or 0)
    if not ns.socket:
        print("kvoffload probe: error: --socket is required (or KVOFFLOAD_SOCKET)", file=sys.stderr)
        return 2
    if not ns.deadline >= 0:
        print("kvoffload probe: error: --deadline must be >= 0 seconds", file=sys.stderr)
        return 2
    code, line = probe(Path(ns.socket), ns.deadline)
    print(line, file=sys.stdout if code == 0 else sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main_probe(sys.argv[1:]))
