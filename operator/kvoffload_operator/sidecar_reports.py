"""What an injected pod's sidecar says about serving, as plain data (pure, no gRPC).

The operator asks each running injected pod's sidecar for ``Stats`` (see `sidecar_stats`) and
keeps only what the policy status needs: whether it answered, why it serves without a pool
(``degraded_reason``), the vLLM connectors' own states (``connector_status``, the JSON array
the connectors write beside the socket) and the pool's size and use. `status` folds these into
the ``Degraded`` condition; `pool_usage` sums the pools.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvoffload_operator import annotations as ann


@dataclass(frozen=True)
class ConnectorState:
    """One vLLM process's connector: ``active`` (uses the pool) or ``disabled`` (and why), and
    the notes of an active one: limits it serves under (e.g. hits that do not survive an
    engine restart)."""

    state: str
    reason: str = ""
    role: str = ""
    rank: int | None = None
    notes: tuple[str, ...] = ()

    def describe(self) -> str:
        """``scheduler rank 0: <reason>`` (role/rank as the connector wrote them)."""
        where = (self.role or "connector") + ("" if self.rank is None else f" rank {self.rank}")
        return f"{where}: {self.reason or self.state}"


@dataclass(frozen=True)
class SidecarReport:
    """One injected pod's sidecar, as the last ``Stats`` call saw it."""

    pod: str
    namespace: str
    uid: str
    reachable: bool
    degraded_reason: str = ""  # non-empty: the sidecar serves without a pool
    connectors: tuple[ConnectorState, ...] = ()
    vllm_container: str = ""  # the engine container the connector runs in (for Events)
    pool_bytes: int = 0  # the pool file's size (0: no pool)
    used_bytes: int = 0  # bytes its namespaces hold (committed or reserved slots)

    @property
    def disabled_connectors(self) -> tuple[ConnectorState, ...]:
        return tuple(c for c in self.connectors if c.state == "disabled")

    @property
    def connector_notes(self) -> tuple[str, ...]:
        """The notes of this pod's connectors, each once, in the order they were written."""
        return tuple(dict.fromkeys(n for c in self.connectors for n in c.notes))


def parse_connector_status(text: str) -> tuple[ConnectorState, ...]:
    """``StatsResponse.connector_status`` (a JSON array of objects); garbage yields nothing."""
    try:
        data = json.loads(text or "[]")
    except ValueError:
        return ()
    if not isinstance(data, list):
        return ()
    out = []
    for entry in data:
        if not isinstance(entry, dict):
            continue
        rank = entry.get("rank")
        notes = entry.get("notes")
        out.append(
            ConnectorState(
                state=str(entry.get("state") or "unknown"),
                reason=str(entry.get("reason") or ""),
                role=str(entry.get("role") or ""),
                rank=rank if isinstance(rank, int) and not isinstance(rank, bool) else None,
                notes=tuple(n for n in notes if isinstance(n, str) and n)
                if isinstance(notes, list)
                else (),
            )
        )
    return tuple(out)


def pod_identity(pod: Mapping[str, Any]) -> tuple[str, str, str, str]:
    """(name, namespace, uid, vLLM container) of an injected pod, from its metadata."""
    meta = pod.get("metadata") or {}
    vllm = ""
    try:
        status = json.loads((meta.get("annotations") or {}).get(ann.STATUS) or "{}")
        vllm = str(status.get("vllmContainer") or "") if isinstance(status, dict) else ""
    except ValueError:
        pass
    return (
        str(meta.get("name", "?")),
        str(meta.get("namespace", "")),
        str(meta.get("uid", "")),
        vllm,
    )
