"""Stores and registration that need no later engine step (pure scenarios, fake pool).

An in-process engine (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) steps only while its caller's
requests run: a store job must ride the metadata of the step that planned it, and the scheduler
must be registered before the first step. The real engine's proof is
tests/connector/test_vllm_idle.py (its in-process engine's very first request is stored).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvoffload_connector.common.engine_key import MAX_ENGINE, engine_key
from kvoffload_connector.common.keys import build_spec
from kvoffload_connector.common.metadata import PoolHandshake, Registration, WorkerReport

from tests.connector.test_scheduler import (
    FakePool,
    PrefillingRequest,
    SchedOut,
    ask,
    make,
    settle,
)


@dataclass
class Limited(PrefillingRequest):
    """A request with vLLM's `max_tokens`."""

    max_tokens: int = 1


def _one_token_prefill(dispatch_inline: bool, max_tokens: int = 1):
    """A request with `max_tokens` output tokens to come, its prompt prefilled in one step
    (roomy GPU cache: its plan may wait for its first token)."""
    s, fake, bp, mgr = make(nblocks=400, step_tokens=256, dispatch_inline=dispatch_inline)
    req = Limited("r", list(range(200)), max_tokens=max_tokens)
    assert ask(s, req) == (0, False)
    mgr.req_blocks["r"] = [bp.allocate(7)]
    meta = s.build_connector_meta(SchedOut({"r": 200}))
    return s, fake, req, meta, mgr.req_blocks["r"][0]


def test_an_inline_engine_sends_a_steps_stores_in_that_steps_metadata():
    s, fake, req, meta, blocks = _one_token_prefill(dispatch_inline=True)
    (job,) = meta.stores  # reserved in the step that planned it: no later step needed
    assert fake.calls.count("reserve_store") == 1
    assert [len(t.gpu_blocks) for t in job.transfers] == [6]  # 3 full chunks of 2 blocks
    assert all(b.ref_cnt == 2 for b in blocks[:6])  # held until every rank reported
    assert s.request_finished(req, ([b.block_id for b in blocks],)) == (False, None)
    s.update_connector_output(WorkerReport(done={job.job_id: 1}))
    assert all(b.ref_cnt == 1 for b in blocks[:6]) and not s.has_pending_work()


def test_an_inline_engine_keeps_a_longer_requests_stores_off_its_first_token():
    """More tokens to come means more steps: the plan waits for the first token, as in a
    served engine, and then rides the step that plans it."""
    s, fake, req, meta, blocks = _one_token_prefill(dispatch_inline=True, max_tokens=8)
    assert meta.stores == () and "reserve_store" not in fake.calls
    req.num_computed_tokens = 200
    req.num_output_tokens = 2  # the first token left a step ago
    (job,) = s.build_connector_meta(SchedOut({"r": 1})).stores
    assert [len(t.gpu_blocks) for t in job.transfers] == [6]


def test_a_multiprocess_engine_keeps_its_stores_off_the_prefill_step():
    s, fake, req, meta, blocks = _one_token_prefill(dispatch_inline=False)
    assert meta.stores == () and "reserve_store" not in fake.calls  # waits for the token
    s.request_finished(req, ([b.block_id for b in blocks],))  # planned when it finishes
    assert s.has_pending_work()  # an engine-core process keeps stepping for it
    assert s.build_connector_meta(SchedOut({})).stores == ()  # reserved in this one
    settle(s)
    assert fake.calls.count("reserve_store") == 1
    (job,) = s.build_connector_meta(SchedOut({})).stores  # and handed out in the next
    assert [len(t.gpu_blocks) for t in job.transfers] == [6]


class _Registering(FakePool):
    """Away until registered; records each registration."""

    def __init__(self) -> None:
        super().__init__()
        self.up = False
        self.registered: list[tuple] = []

    def register(self, spec, num_ranks, slot_bytes):
        self.registered.append((spec, num_ranks, slot_bytes))
        self.up = True

    def remember(self, spec, num_ranks, slot_bytes):
        pass


def _registration(ns: str = "ns", gen: str = "gen-1") -> Registration:
    spec = build_spec(
        model="m", dtype="bf16", kv_layout="L", block_size=16, chunk_blocks=2, tp_size=1,
        hash_algo="sha256", group_specs=("full",),
    )  # fmt: skip
    return Registration(spec, 1, 4096, ns, gen)


def test_the_workers_handshake_registers_the_scheduler_before_any_step():
    fake = _Registering()
    s, *_ = make(pool=fake)
    reg = _registration()
    s.on_handshake({0: reg})
    settle(s)
    assert fake.registered == [(reg.spec, 1, 4096)] and s.registered
    # the first step's report names the same registration: no second one
    fake.registration = type("R", (), {"namespace_id": "ns", "generation": "gen-1"})()
    s.update_connector_output(WorkerReport(registration=reg, ready={0: True}))
    settle(s)
    assert len(fake.registered) == 1
    s.shutdown()


def test_the_facade_takes_handshakes_of_every_pipeline_stage():
    """vLLM's default for `_pp_aware` raises on a pp_rank > 0; ours forwards every rank."""
    from kvoffload_connector.connector import KVOffloadConnector

    seen = []
    c = KVOffloadConnector.__new__(KVOffloadConnector)
    c._impl = type("Impl", (), {"on_handshake": lambda self, m: seen.append(m)})()
    reg = _registration()
    c.set_xfer_handshake_metadata_pp_aware({(1, 0): PoolHandshake(reg), (0, 0): PoolHandshake(reg)})
    assert seen == [{0: PoolHandshake(reg), 1: PoolHandshake(reg)}]


def test_an_engines_key_is_one_per_engine_start_in_all_its_processes():
    start = ("engine-uuid", "1764640000000000000", "0")
    key = engine_key(start)
    assert key == engine_key(tuple(start)) and 0 < key < MAX_ENGINE
    assert engine_key(("engine-uuid", "1764640000000000001", "0")) != key  # the next start
    assert engine_key(("engine-uuid", "1764640000000000000", "1")) != key  # another DP rank
