"""Which pod each published socket belongs to, kept in the agent's state directory.

The kubelet publishes a pod's volume once; a restarted agent must serve the sockets of pods that
were already running, so every binding is a small JSON file written atomically (write, fsync,
rename) before NodePublishVolume answers, and removed before NodeUnpublishVolume answers. A
binding says whether its pod holds the grant of its tenant (`granted`, access.py): written
again, before its sockets serve the tenant, when the agent grants it later.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from kvoffload_sidecar.node.identity import PodIdentity

log = logging.getLogger(__name__)

SOCKET_NAME = "memory.sock"


@dataclass(frozen=True)
class Binding:
    volume_id: str
    target_path: str
    pod: PodIdentity
    tenant: str
    mount_group: int | None  # the pod's fsGroup (volume_mount_group), owner group of the socket
    granted: bool  # the pod holds its tenant's grant (kept until it unpublishes)

    @property
    def socket_path(self) -> str:
        return os.path.join(self.target_path, SOCKET_NAME)

    def same_request(self, other: Binding) -> bool:
        """The same volume asked again: pod, tenant and group (the grant is the agent's)."""
        return replace(self, granted=other.granted) == other


class BindingStore:
    """One file per (volume, target path); `load()` returns what a previous agent recorded."""

    def __init__(self, state_dir: Path) -> None:
        self._dir = state_dir / "bindings"
        self._dir.mkdir(parents=True, exist_ok=True, mode=0o700)

    def _file(self, volume_id: str, target_path: str) -> Path:
        digest = hashlib.sha256(f"{volume_id}\0{target_path}".encode()).hexdigest()[:32]
        return self._dir / f"{digest}.json"

    def save(self, b: Binding) -> None:
        path = self._file(b.volume_id, b.target_path)
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, json.dumps(asdict(b), sort_keys=True).encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)

    def remove(self, volume_id: str, target_path: str) -> None:
        self._file(volume_id, target_path).unlink(missing_ok=True)

    def load(self) -> list[Binding]:
        out = []
        for path in sorted(self._dir.glob("*.json")):
            try:
                doc = json.loads(path.read_text())
                doc["pod"] = PodIdentity(**doc["pod"])
                doc.setdefault("granted", True)  # records without it were made granted only
                out.append(Binding(**doc))
            except (OSError, ValueError, TypeError, KeyError) as e:
                log.warning("dropping unreadable binding %s: %s", path, e)
                path.unlink(missing_ok=True)
        return out
