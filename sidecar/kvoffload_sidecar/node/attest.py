"""Which pod a connecting process belongs to, from the kernel (a second check beside the socket).

A pod's socket is reachable only through that pod's volume, so whoever connects is normally that
pod. Attestation covers the case where the path leaked (a pod granted a hostPath of the kubelet's
directory, a debug container): the peer's pid comes from `SO_PEERCRED`, and its memory cgroup
path names the pod's uid (`/kubepods/<qos>/pod<uid>/...` with cgroupfs,
`kubepods-<qos>-pod<uid_with_underscores>.slice` with systemd). It needs the agent to see pod
pids (`hostPID: true`); a peer it cannot see (pid 0) or place is refused.
"""

from __future__ import annotations

import re
from pathlib import Path

_CGROUPFS = re.compile(r"/pod([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})(?:/|$)")
_SYSTEMD = re.compile(r"-pod([0-9a-f]{8}_[0-9a-f]{4}_[0-9a-f]{4}_[0-9a-f]{4}_[0-9a-f]{12})\.slice")


def pod_uid_of_cgroup(text: str) -> str | None:
    """The pod uid in a `/proc/<pid>/cgroup` file (v1 or v2), or None when it names none or
    several."""
    found: set[str] = set()
    for line in text.splitlines():
        path = line.split(":", 2)[-1]
        found.update(m.group(1) for m in _CGROUPFS.finditer(path))
        found.update(m.group(1).replace("_", "-") for m in _SYSTEMD.finditer(path))
    return found.pop() if len(found) == 1 else None


class CgroupAttestor:
    """`pod_uid(pid)` from `<proc_root>/<pid>/cgroup`; None when the pid cannot be placed."""

    def __init__(self, proc_root: Path = Path("/proc")) -> None:
        self._root = proc_root

    def pod_uid(self, pid: int) -> str | None:
        if pid <= 0:
            return None
        try:
            return pod_uid_of_cgroup((self._root / str(pid) / "cgroup").read_text())
        except OSError:
            return None
