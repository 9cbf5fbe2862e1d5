"""Which pod a connecting process belongs to, from the kernel (a second check beside the socket).

A pod's socket is reachable only through that pod's volume, so whoever connects is normally that
pod. Attestation covers the case where the path leaked (a pod granted a hostPath of the kubelet's
directory, a debug container): the peer's pid comes from `SO_PEERCRED`, and its memory cgroup
path names the pod's uid (`/kubepods/<qos>/pod<uid>/...` with cgroupfs,
`kubepods-<qos>-pod<uid_with_underscores>.slice` with systemd). It needs the agent to see pod
pids (`hostPID: true`); a peer it cannot see (pid 0) or place is refused.

Every socket of a pod is checked the same way, once per connection as it is accepted
(`peer_in_pod`): `memory.sock` (tenant_memory.py), `session.sock` (pools.py) and `pool.sock`
(front.py).
"""

from __future__ import annotations

import re
import socket
import struct
from collections.abc import Callable
from pathlib import Path

NOT_IN_POD = "the connecting process is not in this socket's pod"
# connections of peers outside the pod a socket holds at once, apart from the pod's own: a
# process that reached a leaked path never takes the pod's places (past this: closed unanswered)
MAX_OUTSIDERS_PER_SOCKET = 8

# pid -> the uid of the pod it runs in, None when it cannot be placed (CgroupAttestor.pod_uid)
Attest = Callable[[int], str | None]

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


def peer_credentials(conn: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process that connected `conn` (`SO_PEERCRED`, as of connect)."""
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid


def peer_in_pod(conn: socket.socket, pod_uid: str, attest: Attest | None) -> bool:
    """Whether the peer of an accepted `conn` runs in the pod `pod_uid`; always True without
    attestation (`attest` None). A peer whose credentials cannot be read is not placed."""
    if attest is None:
        return True
    try:
        pid, _, _ = peer_credentials(conn)
    except OSError:
        return False
    return attest(pid) == pod_uid
