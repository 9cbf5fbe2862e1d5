"""Whether the pool fits the sidecar container's memory limit (reads /proc and /sys only).

Why: pages of a memory-backed emptyDir are charged to the memory cgroup of the process that
first touches them, and the sidecar pre-faults its whole pool. A pool larger than what the
container's limit leaves gets the sidecar OOM-killed part-way through, and again after every
restart: a crash loop, with vLLM's pool coming and going. Checked before the pool is built, the
sidecar serves degraded instead, says why once (reason ``no_memory``), and retries: a limit
raised in place (in-place pod resize) lets the next attempt build the pool.

cgroup v2 (``0::/path``; the limit is the lowest ``memory.max`` of the cgroup and its ancestors)
and v1 (the ``memory`` controller's ``hierarchical_memory_limit``) are read; inside a container
whose cgroup is mounted at the root, the root's files are the container's own. Usage is the
working set, as the kubelet counts it: inactive file cache, which the kernel reclaims for the
pool, is left out (tmpfs pages are not file cache and stay in).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

from kvoffload_sidecar.units import format_bytes

UNLIMITED = 1 << 62  # cgroup v1 writes "no limit" as ~2**63 rounded to a page
MIB = 1 << 20
SELF_RESERVE_BYTES = 32 * MIB  # what the sidecar may still grow by beyond the pool and index
INDEX_DIVISOR = 256  # the slot index and its tables: sizing.py's headroom counts pool/256


@dataclass(frozen=True)
class MemoryRoom:
    """The memory cgroup's limit and what is charged to it now, in bytes."""

    limit: int
    usage: int

    @property
    def free(self) -> int:
        return max(0, self.limit - self.usage)


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return UNLIMITED
    try:
        return int(text)
    except ValueError:
        return None


def _stat(d: Path) -> dict[str, int]:
    out = {}
    try:
        for line in (d / "memory.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            with contextlib.suppress(ValueError):
                out[key] = int(value)
    except OSError:
        pass
    return out


def _v1(root: Path, path: str) -> MemoryRoom | None:
    d = root / path.lstrip("/")
    if not (d / "memory.usage_in_bytes").exists():
        d = root  # a container's own cgroup mounted at the root
    stat = _stat(d)
    limit = stat.get("hierarchical_memory_limit") or _read_int(d / "memory.limit_in_bytes")
    usage = _read_int(d / "memory.usage_in_bytes")
    if limit is None or usage is None or limit >= UNLIMITED:
        return None
    # the working set, as the kubelet counts it: inactive file cache is reclaimed for the pool
    return MemoryRoom(limit, max(0, usage - stat.get("total_inactive_file", 0)))


def _v2(root: Path, path: str) -> MemoryRoom | None:
    d = root / path.lstrip("/")
    if not (d / "memory.current").exists():
        d = root
    usage = _read_int(d / "memory.current")
    if usage is not None:
        usage = max(0, usage - _stat(d).get("inactive_file", 0))
    limits = [
        x
        for p in (d, *d.parents)
        if p == root or root in p.parents
        if (x := _read_int(p / "memory.max")) is not None
    ]
    if usage is None or not limits or min(limits) >= UNLIMITED:
        return None
    return MemoryRoom(min(limits), usage)


def memory_room(
    proc_cgroup: Path = Path("/proc/self/cgroup"), cgroup_root: Path = Path("/sys/fs/cgroup")
) -> MemoryRoom | None:
    """This process's memory cgroup limit and usage; None where no limit applies or none can
    be read (then nothing is refused)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    entries = [line.split(":", 2) for line in lines if line.count(":") >= 2]
    for _hid, controllers, path in entries:  # v1 (or hybrid: memory on v1)
        if "memory" in controllers.split(","):
            return _v1(cgroup_root / "memory", path)
    for hid, controllers, path in entries:
        if hid == "0" and controllers == "":
            return _v2(cgroup_root, path)
    return None


def pool_shortfall(
    pool_bytes: int,
    resident_bytes: int,
    room: MemoryRoom | None,
    *,
    container: str = "the sidecar container",
    remedy: str = "raise spec.sidecar.resources.limits.memory or lower the pool size",
) -> str | None:
    """Why a pool of `pool_bytes` cannot be pre-faulted under `room` (None: it fits).
    `resident_bytes`: the pool file's pages already in memory (a restart's adopted file),
    charged already wherever they are. `container` and `remedy` word the answer."""
    if room is None:
        return None
    needed = max(0, pool_bytes - resident_bytes) + pool_bytes // INDEX_DIVISOR + SELF_RESERVE_BYTES
    if needed <= room.free:
        return None
    return (
        f"the pool ({format_bytes(pool_bytes)}) does not fit {container}'s memory "
        f"limit ({format_bytes(room.limit)}, {format_bytes(room.usage)} in use, "
        f"{format_bytes(needed)} needed): {remedy}"
    )
