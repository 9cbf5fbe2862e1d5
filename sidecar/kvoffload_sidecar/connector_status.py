"""The connectors' status files, read for `Stats.connector_status`.

Each vLLM process's connector writes `connector-status-*.json` beside the sidecar's socket (the
pod's shared run dir) saying whether it uses the pool and, if not, why. The sidecar only relays
them: one JSON array of the parsed objects, so `kvoffload stats` can show in one place why a pod
serves without its pool. A file that cannot be read or is not a JSON object is skipped: a
connector may be writing it right now, or have died mid-write.
"""

from __future__ import annotations

import fnmatch
import json
import os
import stat
from pathlib import Path
from typing import Any

STATUS_GLOB = "connector-status-*.json"
MAX_FILES = 64  # a pod has a handful of engine processes; bound the work of one Stats call
MAX_FILE_BYTES = 64 << 10


def connector_statuses(directory: Path | None) -> list[dict[str, Any]]:
    """The parsed status objects in `directory`, by file name; unreadable or garbage skipped.
    Only regular files are read, never through a link: the node agent reads pods' volume
    directories, where a pod could plant a link to a file of the node or a FIFO."""
    if directory is None:
        return []
    try:
        names = sorted(n for n in os.listdir(directory) if fnmatch.fnmatch(n, STATUS_GLOB))
    except OSError:
        return []
    found: list[dict[str, Any]] = []
    for name in names[:MAX_FILES]:
        try:
            fd = os.open(
                directory / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
            )
        except OSError:
            continue
        try:
            with os.fdopen(fd, "rb") as f:
                if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                    continue
                raw = f.read(MAX_FILE_BYTES + 1)
            data = json.loads(raw) if len(raw) <= MAX_FILE_BYTES else None
        except (OSError, ValueError):
            continue
        if isinstance(data, dict):
            found.append(data)
    return found


def read_connector_status(directory: Path | None) -> str:
    """`connector_statuses` as the JSON array text `StatsResponse.connector_status` carries."""
    return json.dumps(connector_statuses(directory), sort_keys=True)


def describe(entry: dict[str, Any]) -> str:
    """One line for `kvoffload stats`: "connector scheduler rank 0: disabled: <reason>", the
    placement it was configured with ("connector worker rank 0 (placement node): active"),
    why an active one serves without the pool now ("active, without the pool: ..."), and any
    notes it left (limits it serves under: "active (note: ...)")."""
    role = entry.get("role") or "?"
    rank = entry.get("rank")
    state = entry.get("state") or "unknown"
    where = f"connector {role}" + ("" if rank is None else f" rank {rank}")
    placement = entry.get("placement")
    if isinstance(placement, str) and placement:
        where += f" (placement {placement})"
    reason = entry.get("reason") or ""
    no_pool = entry.get("no_pool")
    without = f", without the pool: {no_pool}" if isinstance(no_pool, str) and no_pool else ""
    notes = entry.get("notes")
    noted = "".join(
        f" (note: {n})" for n in (notes if isinstance(notes, list) else []) if isinstance(n, str)
    )
    return f"{where}: {state}" + (f": {reason}" if reason else "") + without + noted
