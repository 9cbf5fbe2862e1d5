"""vLLM's deferred block frees (free_order.py), on vLLM's real scheduler with async scheduling.

The CPU build runs without async scheduling, so the engine tests never see a step in flight
when a reset comes; the GPU build does (vLLM 0.26 on an H100: `reset_prefix_cache(
reset_running_requests=True)` raised with our connector and with a do-nothing one, and succeeds
without a connector). Here vLLM's own `Scheduler` is built in-process with async scheduling on
(`max_concurrent_batches` 2, as on a GPU), a prompt's prefill is scheduled and not yet returned,
and the reset comes: what a weight update or `/reset_prefix_cache` does mid-flight.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from kvoffload_cli.sidecar_child import SidecarProcess
from kvoffload_connector.free_order import stop_deferring_block_frees

pytestmark = [pytest.mark.vllm]

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "tests" / "connector" / "models" / "tiny-llama"
BLOCK = 32
BLOCKS = 64
NOOP = {
    "kv_connector": "NoopConnector",
    "kv_connector_module_path": "noop_connector",  # tests/connector/noop_connector.py
    "kv_role": "kv_both",
}


def ours(socket: str) -> dict:
    return {
        "kv_connector": "KVOffloadConnector",
        "kv_connector_module_path": "kvoffload_connector.connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"socket": socket, "register_wait_ms": 0},
    }


def scheduler(kv: dict | None):
    """vLLM's scheduler for the tiny Llama, 64 blocks of 32 tokens, async scheduling on."""
    import torch
    from vllm.config import (
        CacheConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    here = str(Path(__file__).resolve().parent)  # noop_connector.py
    if here not in sys.path:
        sys.path.insert(0, here)
    config = VllmConfig(
        model_config=ModelConfig(
            model=str(MODEL), skip_tokenizer_init=True, dtype="float32", max_model_len=1024
        ),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(
            max_num_seqs=8,
            max_num_batched_tokens=1024,
            max_model_len=1024,
            is_encoder_decoder=False,
        ),
        kv_transfer_config=KVTransferConfig(**kv) if kv else None,
    )
    config.scheduler_config.async_scheduling = True  # the CPU platform turned it off
    assert config.max_concurrent_batches == 2
    config.cache_config.num_gpu_blocks = BLOCKS
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=64, dtype=torch.float32)
    kv_cache = KVCacheConfig(
        num_blocks=BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)],
    )
    return Scheduler(
        vllm_config=config,
        kv_cache_config=kv_cache,
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK,
        log_stats=True,
    )


def reset_with_the_prefill_in_flight(s) -> object:
    """A 300-token prompt's prefill scheduled (its output not back: the step is in flight),
    then the reset a weight update does. vLLM's answer, or the RuntimeError it raised."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    s.add_request(
        Request(
            "a",
            list(range(3, 303)),
            SamplingParams(max_tokens=8),
            None,
            block_hasher=get_request_block_hasher(BLOCK, sha256),
        )
    )
    deadline = time.monotonic() + 10
    while not s.schedule().num_scheduled_tokens:  # our lookup may answer a step later
        assert time.monotonic() < deadline, "the prompt was never scheduled"
        time.sleep(0.01)
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() < BLOCKS - 1
    try:
        return s.reset_prefix_cache(reset_running_requests=True)
    except RuntimeError as exc:
        return exc


def free_blocks(s) -> int:
    return s.kv_cache_manager.block_pool.get_num_free_blocks()


def test_vllm_defers_frees_for_any_consumer_connector_and_its_reset_then_raises():
    # The control: a connector that does nothing makes vLLM defer frees, and the mid-flight
    # reset raises (so the scenario below can fail); without a connector it succeeds.
    s = scheduler(NOOP)
    assert s.defer_block_free is True
    assert isinstance(reset_with_the_prefill_in_flight(s), RuntimeError)
    plain = scheduler(None)
    assert plain.defer_block_free is False
    assert reset_with_the_prefill_in_flight(plain) is True
    assert free_blocks(plain) == BLOCKS - 1  # the null block stays taken


@pytest.mark.process
@pytest.mark.parametrize("sidecar_up", [True, False], ids=["sidecar", "no-sidecar"])
def test_kvoffload_frees_like_no_connector_and_the_reset_succeeds(tmp_path, sidecar_up):
    sidecar = SidecarProcess(pool_size="64Mi") if sidecar_up else None
    if sidecar is not None:
        sidecar.start()
    try:
        socket = sidecar.socket if sidecar else str(tmp_path / "absent.sock")
        s = scheduler(ours(socket))
        assert s.defer_block_free is False
        assert reset_with_the_prefill_in_flight(s) is True
        assert free_blocks(s) == BLOCKS - 1
        assert s.waiting and s.waiting.peek_request().request_id == "a"  # it starts over
    finally:
        if sidecar is not None:
            sidecar.close()


def test_left_alone_when_the_pool_is_not_the_callers_or_frees_are_already_deferred():
    s = scheduler(NOOP)
    assert not stop_deferring_block_frees(s, object())  # another pool: another scheduler
    assert not stop_deferring_block_frees(object(), s.kv_cache_manager.block_pool)
    s.deferred_frees.append((1, []))
    assert not stop_deferring_block_frees(s, s.kv_cache_manager.block_pool)
    assert s.defer_block_free is True
    s.deferred_frees.clear()
    assert stop_deferring_block_frees(s, s.kv_cache_manager.block_pool)
    assert s.defer_block_free is False
