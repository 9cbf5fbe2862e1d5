"""What this machine offers the pool file: the filesystem under a path, its free room, free huge
pages and whether memory may be locked. Read from /proc and statvfs; one copy for the start-up
checks (config.py) and the region that creates the file (region.py)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = [
    "HUGE_PAGE_BYTES",
    "can_lock",
    "filesystem_type",
    "free_bytes",
    "free_huge_page_bytes",
    "mount_of",
]

HUGE_PAGE_BYTES = 2 << 20  # the default huge page on x86_64 and aarch64
PROC_MOUNTS = Path("/proc/self/mounts")
_CAP_IPC_LOCK = 14


def read_mounts() -> str:
    """This process's mount table ("" if unreadable)."""
    try:
        return PROC_MOUNTS.read_text(encoding="utf-8")
    except OSError:
        return ""


def mount_of(path: Path, mounts_text: str | None = None) -> tuple[str, str]:
    """(mount point, filesystem type) of the longest mount containing `path`; ("/", "unknown")
    when no line matches. `mounts_text`: a mount table in /proc/mounts format (default: ours)."""
    if mounts_text is None:
        mounts_text = read_mounts()
    best = ("/", "unknown")
    matched = ""
    resolved = os.path.realpath(path)
    for line in mounts_text.splitlines():
        parts = line.split()
        if len(parts) < 3:
            continue
        point = _unescape(parts[1])
        inside = resolved == point or resolved.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(matched):
            matched, best = point, (point, parts[2])
    return best


def filesystem_type(path: Path) -> str:
    """Filesystem type holding `path` ("unknown" if the mount table is unreadable)."""
    return mount_of(path)[1]


def free_bytes(path: Path) -> int | None:
    """Bytes an unprivileged writer may still allocate on `path`'s filesystem; None when it
    reports no size (f_blocks 0: no limit to check)."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize if st.f_blocks else None


def free_huge_page_bytes() -> int | None:
    """Unreserved free bytes of the default huge-page pool from /proc/meminfo (None if unknown)."""
    info: dict[str, int] = {}
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name in ("HugePages_Free", "HugePages_Rsvd", "Hugepagesize"):
                    info[name] = int(rest.split()[0])
    except (OSError, ValueError):
        return None
    if len(info) < 3:
        return None
    return (info["HugePages_Free"] - info["HugePages_Rsvd"]) * info["Hugepagesize"] * 1024


def can_lock(size: int) -> tuple[bool, str]:
    """Whether mlock of ``size`` more bytes may succeed here, and why (or why not): with
    CAP_IPC_LOCK the limit does not apply; without it RLIMIT_MEMLOCK must cover the pool."""
    try:
        with open("/proc/self/status", encoding="utf-8") as f:
            caps = next((line.split()[1] for line in f if line.startswith("CapEff:")), "0")
        if int(caps, 16) >> _CAP_IPC_LOCK & 1:
            return True, "CAP_IPC_LOCK"
    except (OSError, ValueError):
        pass
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY or soft >= size:
        return True, "RLIMIT_MEMLOCK"
    return False, f"no CAP_IPC_LOCK and RLIMIT_MEMLOCK {soft} bytes < pool {size} bytes"


def _unescape(field: str) -> str:
    """Undo the octal escapes (\\040 for a space) of /proc/mounts."""
    if "\\" not in field:
        return field
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 4 <= len(field) and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)
