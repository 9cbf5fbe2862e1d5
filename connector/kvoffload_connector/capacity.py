"""The GPU tier's KV capacity, as the scheduler's connector reports it in its status file.

Why: the sidecar publishes the pod's effective KV capacity in tokens (GPU + host tier) for
autoscalers, and only vLLM knows the GPU side: by the time it builds the scheduler's connector
it has sized the KV cache (`kv_cache_config.num_blocks`, also `cache_config.num_gpu_blocks`).
Tokens = blocks x block size / KV groups (each group takes its own blocks from the one pool;
the sidecar counts host-tier tokens the same way).

Standard library only and never raising: the facade vLLM imports calls this while it writes
the status file, before (and whether or not) the working connector exists.
"""

from __future__ import annotations

from typing import Any


def served_model(vllm_config: Any) -> str:
    """The model name the namespace spec carries (the worker's `build_spec` uses the same)."""
    mc = vllm_config.model_config
    return str(getattr(mc, "served_model_name", None) or mc.model)


def _positive(value: Any) -> int:
    try:
        number = int(value or 0)
    except (TypeError, ValueError):
        return 0
    return number if number > 0 else 0


def gpu_capacity(vllm_config: Any, kv_cache_config: Any = None) -> dict[str, Any]:
    """Status-file fields: model, num_gpu_blocks, block_size, kv_groups, gpu_kv_tokens.
    Empty when vLLM has not sized its KV cache (or the config is not one this code knows)."""
    try:
        groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
        blocks = _positive(getattr(kv_cache_config, "num_blocks", 0)) or _positive(
            getattr(vllm_config.cache_config, "num_gpu_blocks", 0)
        )
        sizes = [_positive(getattr(g.kv_cache_spec, "block_size", 0)) for g in groups]
        block_size = (sizes[0] if sizes else 0) or _positive(vllm_config.cache_config.block_size)
        if not blocks or not block_size:
            return {}
        n_groups = max(1, len(groups))
        return {
            "model": served_model(vllm_config),
            "num_gpu_blocks": blocks,
            "block_size": block_size,
            "kv_groups": n_groups,
            "gpu_kv_tokens": blocks * block_size // n_groups,
        }
    except Exception:  # noqa: BLE001 - a status detail must never stop vLLM
        return {}
