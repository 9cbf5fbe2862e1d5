"""A connector hook that raises never reaches vLLM (docs/FAILURES.md).

Per hook, an exception inside the connector's own object: the hook answers as without a
connector, the process drops its pool (later hooks are no-ops, said once with the traceback,
in the status file and the `hook_faults` counter), and what vLLM was already promised stays
exact: a load it was told of is reported failed (vLLM recomputes those blocks), and every job
the scheduler counts on is reported, so its block references go back.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
from kvoffload_connector import guard
from kvoffload_connector.common.metadata import ConnectorMeta, GroupTransfer, LoadJob, StoreJob
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorRole

from tests.connector import test_guard
from tests.connector.test_guard import _build, _status

fresh_guard = test_guard.fresh_guard

WORKER = KVConnectorRole.WORKER


class Boom(RuntimeError):
    pass


def _raise(*args, **kwargs):
    raise Boom("a bug in the connector")


def _req(rid="r1", tokens=300):
    return SimpleNamespace(request_id=rid, num_tokens=tokens, lora_request=None)


def _blocks(*ids):
    return SimpleNamespace(blocks=([SimpleNamespace(block_id=i, is_null=False) for i in ids],))


def _faults(caplog):
    return [r for r in caplog.records if "serving without the pool" in r.getMessage()]


def _assert_dropped(conn, caplog, tmp_path, hook, role="scheduler"):
    assert not conn.active and conn.fault == hook
    (said,) = _faults(caplog)
    assert said.exc_info is not None and said.exc_info[0] is Boom, "the traceback is logged"
    assert f"{hook} raised Boom: a bug in the connector" in said.getMessage()
    status = _status(tmp_path, role)
    assert status["state"] == "disabled" and status["fault"] == hook
    assert hook in status["reason"]
    stats = conn.get_kv_connector_stats()
    assert stats.data == {"hook_faults": 1}
    assert conn.get_kv_connector_stats() is None  # counted once


SCHEDULER_HOOKS = {
    # hook: (inner method broken, call, what vLLM gets)
    "get_num_new_matched_tokens": (
        "get_num_new_matched_tokens",
        lambda c: c.get_num_new_matched_tokens(_req(), 0),
        (0, False),
    ),
    "update_state_after_alloc": (
        "update_state_after_alloc",
        lambda c: c.update_state_after_alloc(_req(), _blocks(1), 0),
        None,
    ),
    "build_connector_meta": (
        "build_connector_meta",
        lambda c: type(c.build_connector_meta(SimpleNamespace())),
        KVConnectorMetadata,
    ),
    "update_connector_output": (
        "update_connector_output",
        lambda c: c.update_connector_output(SimpleNamespace(kv_connector_worker_meta=None)),
        None,
    ),
    "reset_cache": ("reset_cache", lambda c: c.reset_cache(), True),
    "request_finished": (
        "request_finished",
        lambda c: c.request_finished(_req(), [1]),
        (False, None),
    ),
    "request_finished_all_groups": (
        "request_finished",
        lambda c: c.request_finished_all_groups(_req(), ([1],)),
        (False, None),
    ),
    "has_pending_push_work": ("has_pending_push_work", lambda c: c.has_pending_push_work(), False),
    "bind_gpu_block_pool": ("bind", lambda c: c.bind_gpu_block_pool(object()), None),
}


@pytest.mark.parametrize("hook", sorted(SCHEDULER_HOOKS))
def test_a_scheduler_hook_that_raises_answers_as_without_a_connector(
    hook, tmp_path, fresh_guard, caplog, monkeypatch
):
    conn = _build(tmp_path)
    assert conn.active, conn.disabled_reason
    inner, call, expected = SCHEDULER_HOOKS[hook]
    monkeypatch.setattr(conn._impl, inner, _raise)
    with caplog.at_level(logging.WARNING, logger="kvoffload_connector"):
        assert call(conn) == expected
        # from now on every hook is a no-op: no second line, no second fault
        assert conn.get_num_new_matched_tokens(_req("r2"), 0) == (0, False)
        assert type(conn.build_connector_meta(SimpleNamespace())) is KVConnectorMetadata
        assert conn.has_pending_push_work() is False
        assert conn.reset_cache() is True
    _assert_dropped(conn, caplog, tmp_path, hook)
    conn.shutdown()


def _promise(conn, monkeypatch, req, tokens, load_async):
    """The pool tells vLLM `req` has `tokens` external tokens; vLLM allocates blocks 5.."""
    monkeypatch.setattr(conn._impl, "get_num_new_matched_tokens", lambda r, n: (tokens, load_async))
    monkeypatch.setattr(conn._impl, "update_state_after_alloc", lambda *a: None)
    assert conn.get_num_new_matched_tokens(req, 16) == (tokens, load_async)
    conn.update_state_after_alloc(req, _blocks(*range(5, 12)), tokens)


@pytest.mark.parametrize("load_async", [True, False], ids=["async", "layered"])
@pytest.mark.parametrize("where", ["build_connector_meta", "get_num_new_matched_tokens"])
def test_a_load_promised_before_the_fault_fails_on_the_workers(
    where, load_async, tmp_path, fresh_guard, caplog, monkeypatch
):
    """vLLM was told of 32 tokens (blocks 6 and 7 of 16 tokens, after 16 computed ones) when
    the scheduler side fails before the load reached the workers: the next metadata carries a
    load job no worker can run (vLLM recomputes the blocks), once, and the engine keeps
    stepping until it is out; a worker that gets it reports it failed."""
    conn = _build(tmp_path)
    req = _req("promised")
    _promise(conn, monkeypatch, req, 32, load_async)
    monkeypatch.setattr(conn._impl, where, _raise)
    with caplog.at_level(logging.WARNING, logger="kvoffload_connector"):
        if where == "get_num_new_matched_tokens":
            assert conn.get_num_new_matched_tokens(_req("other"), 0) == (0, False)
            assert conn.has_pending_push_work() is True  # the engine steps to send it
        meta = conn.build_connector_meta(SimpleNamespace())
    assert isinstance(meta, ConnectorMeta) and not meta.stores
    (job,) = meta.loads
    assert (job.req_id, job.generation, job.layered) == ("promised", "", not load_async)
    assert [t.gpu_blocks for t in job.transfers] == [(6, 7)]
    assert type(conn.build_connector_meta(SimpleNamespace())) is KVConnectorMetadata
    assert conn.has_pending_push_work() is False
    _assert_dropped(conn, caplog, tmp_path, where)
    conn.shutdown()

    worker = _build(tmp_path, role=WORKER)  # a live worker: the job is not for any pool
    try:
        worker.bind_connector_metadata(meta)
        worker.start_load_kv(None)
        worker.wait_for_save()
        results = worker.get_transfer_results(set())
        errors = worker.get_block_ids_with_load_errors()
        if load_async:
            assert results.failed_recving == {"promised"} and errors == set()
        else:
            assert not results.failed_recving and errors == {6, 7}
    finally:
        worker.shutdown()


def test_a_request_that_finishes_before_its_load_went_out_is_owed_nothing(
    tmp_path, fresh_guard, monkeypatch
):
    conn = _build(tmp_path)
    req = _req("aborted")
    _promise(conn, monkeypatch, req, 32, True)
    monkeypatch.setattr(conn._impl, "request_finished", lambda *a: (False, None))
    conn.request_finished(req, [5, 6, 7])
    monkeypatch.setattr(conn._impl, "build_connector_meta", _raise)
    assert type(conn.build_connector_meta(SimpleNamespace())) is KVConnectorMetadata
    conn.shutdown()


def test_a_scheduler_fault_gives_back_its_block_references_and_fences_its_copies(
    tmp_path, fresh_guard, monkeypatch
):
    """Jobs already handed to the workers are fenced (each worker finishes them before its
    next forward); our block references go back to vLLM."""
    conn = _build(tmp_path)
    sched = conn._scheduler
    let_go = []
    monkeypatch.setattr(sched, "_let_go", lambda: (let_go.append(1), sched._fence.update({4, 9})))
    monkeypatch.setattr(conn._impl, "update_connector_output", _raise)
    conn.update_connector_output(SimpleNamespace(kv_connector_worker_meta=None))
    assert let_go == [1]
    meta = conn.build_connector_meta(SimpleNamespace())
    assert isinstance(meta, ConnectorMeta) and meta.fence == (4, 9) and not meta.loads
    conn.shutdown()


# -- worker side ----------------------------------------------------------------------------------


def _worker_with_jobs(tmp_path):
    """A worker holding an async load (blocks 4, 5), a layered load (block 8) and a store."""
    conn = _build(tmp_path, role=WORKER)
    w = conn._worker
    w._jobs.update(
        {7: ("load", "rA", 0, ""), 8: ("store", "", 3, "ns"), 9: ("layered", "rB", 0, "")}
    )
    w._load_blocks.update({7: [4, 5], 9: [8]})
    w._done[6] = 1
    return conn


def _meta_with_jobs():
    t = (GroupTransfer(0, (20, 21), (1, 2), (0, 1)),)
    return ConnectorMeta(
        loads=(
            LoadJob(11, "rC", t, "gen"),
            LoadJob(12, "rD", (GroupTransfer(0, (30,), (1,), (0,)),), "gen", True),
        ),
        stores=(StoreJob(13, 5, "ns", t, "gen"),),
    )


WORKER_HOOKS = {
    # hook: inner method broken (vLLM 0.26's get_finished: the test after this one)
    "start_load_kv": "start_load_kv",
    "wait_for_layer_load": "wait_for_layer_load",
    "wait_for_save": "wait_for_save",
    "get_transfer_results": "get_transfer_results",
    "get_block_ids_with_load_errors": "take_load_error_blocks",
    "build_connector_worker_meta": "build_connector_worker_meta",
}


def _step_end(conn):
    """vLLM's end of a worker step (0.32+): results, load errors, the report."""
    return (
        conn.get_transfer_results(set()),
        conn.get_block_ids_with_load_errors(),
        conn.build_connector_worker_meta(),
    )


@pytest.mark.parametrize("hook", sorted(WORKER_HOOKS))
def test_a_worker_hook_that_raises_fails_what_it_held_and_reports_it(
    hook, tmp_path, fresh_guard, caplog, monkeypatch
):
    conn = _worker_with_jobs(tmp_path)
    monkeypatch.setattr(conn._impl, WORKER_HOOKS[hook], _raise)
    conn.bind_connector_metadata(_meta_with_jobs())
    failed, finished, errors, reports = set(), set(), set(), []
    with caplog.at_level(logging.WARNING, logger="kvoffload_connector"):
        conn.start_load_kv(None)
        conn.wait_for_layer_load("l0")
        conn.wait_for_save()
        for _ in range(2):  # the step the fault came in, and the next (nothing raises)
            results, errs, report = _step_end(conn)
            failed |= results.failed_recving
            finished |= results.finished_recving
            errors |= errs
            reports += [report] if report is not None else []
        conn.clear_connector_metadata()
    _assert_dropped(conn, caplog, tmp_path, hook, role="worker")
    # async loads (held and newly sent) fail: vLLM recomputes their requests
    assert failed == {"rA", "rC"} and failed <= finished
    assert errors == {8, 30}  # the layered loads' blocks: recomputed
    # the scheduler hears of every job (its references go back) and stops counting on the rank
    (report,) = [r for r in reports if r.no_pool]
    assert report.no_pool == conn.disabled_reason and report.ready == {0: False}
    outcomes: dict[int, int] = {}
    for r in reports:
        for job, n in r.failed.items():
            outcomes[job] = outcomes.get(job, 0) + n
    assert outcomes == {7: 1, 8: 1, 9: 1, 11: 1, 12: 1, 13: 1}
    assert {6: 1} in [dict(r.done) for r in reports]
    # later steps: no-ops, and a stray job still gets its answer
    conn.bind_connector_metadata(ConnectorMeta(stores=(StoreJob(14, 6, "ns", (), "gen"),)))
    conn.start_load_kv(None)
    conn.wait_for_layer_load("l0")
    conn.wait_for_save()
    results, errs, report = _step_end(conn)
    assert not results.finished_recving and errs == set()
    assert report.failed == {14: 1}
    assert conn.build_connector_worker_meta() is None
    conn.shutdown()


def test_on_vllm_026_a_worker_fault_reports_failed_loads_by_their_blocks(
    tmp_path, fresh_guard, monkeypatch
):
    """vLLM 0.26 asks `get_finished`: a failed async load is finished and its blocks errors."""
    conn = _worker_with_jobs(tmp_path)
    monkeypatch.setattr(conn._impl, "get_finished", _raise)
    conn.bind_connector_metadata(_meta_with_jobs())
    assert conn.get_finished(set()) == (None, {"rA", "rC"})
    assert conn.get_block_ids_with_load_errors() == {4, 5, 8, 20, 21, 30}
    conn.shutdown()


def test_the_injected_fault_fires_once_where_it_is_asked_for(monkeypatch):
    monkeypatch.setattr(guard, "_FAULT", "build_connector_meta:owed")
    guard.check_test_fault("build_connector_meta", owed=False)
    guard.check_test_fault("start_load_kv", owed=True)
    with pytest.raises(guard.InjectedFault):
        guard.check_test_fault("build_connector_meta", owed=True)
    guard.check_test_fault("build_connector_meta", owed=True)  # once
