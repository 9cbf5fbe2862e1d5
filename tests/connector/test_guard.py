"""The connector never crashes vLLM: bad configuration, imports, models, versions or keys.

A chunk that does not fit the engine's block size is rounded up; anything that goes wrong while
the connector is built (bad config, a package that cannot import, an unsupported model or vLLM
version, groups with different block sizes) leaves it disabled: every hook answers as if no
connector were configured, the reason is logged once, written beside the socket for
`kvoffload stats`, and shown by the `vllm:kvoffload_pool_active` gauge.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
from kvoffload_connector import guard
from kvoffload_connector.common import compat
from kvoffload_connector.common.config import parse_extra_config
from kvoffload_connector.connector import KVOffloadConnector
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorRole,
)

# -- class 1: the chunk follows the engine's block size -----------------------------------------


@pytest.mark.parametrize(
    ("configured", "block", "used"), [(64, 128, 128), (100, 32, 128), (129, 128, 256), (1, 16, 16)]
)
def test_chunk_that_does_not_fit_is_rounded_up_with_one_warning(configured, block, used, caplog):
    with caplog.at_level(logging.WARNING, logger="kvoffload_connector"):
        cfg = parse_extra_config({"chunk_size": configured}, block)
    assert cfg.chunk_tokens == used and cfg.chunk_tokens % block == 0
    warnings = [r.getMessage() for r in caplog.records if "chunk_size" in r.getMessage()]
    assert len(warnings) == 1 and str(configured) in warnings[0] and str(block) in warnings[0]


def test_chunk_that_fits_is_kept_silently_and_default_follows_block(caplog):
    with caplog.at_level(logging.WARNING, logger="kvoffload_connector"):
        assert parse_extra_config({"chunk_size": 256}, 128).chunk_tokens == 256
    assert not caplog.records
    assert parse_extra_config({}, 128).chunk_tokens == 512
    assert parse_extra_config({}, 16).chunk_tokens == 64


# -- fakes ---------------------------------------------------------------------------------------


class AttentionSpec:
    def __init__(self, block_size=16, sliding_window=None):
        self.block_size = block_size
        self.sliding_window = sliding_window


class FullAttentionSpec(AttentionSpec):
    pass


class SlidingWindowSpec(AttentionSpec):
    pass


class MambaSpec:
    block_size = 16


class CrossAttentionSpec(AttentionSpec):
    pass


def _kv_cache_config(*specs):
    groups = [
        SimpleNamespace(kv_cache_spec=s, layer_names=[f"model.layers.{i}.attn"])
        for i, s in enumerate(specs)
    ]
    return SimpleNamespace(kv_cache_groups=groups)


def _vllm_config(extra, **model):
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(
            kv_connector_extra_config=extra, engine_id="test-engine", is_kv_producer=True
        ),
        model_config=SimpleNamespace(
            is_encoder_decoder=False, runner_type="generate", dtype="float32", **model
        ),
        cache_config=SimpleNamespace(block_size=16, cache_dtype="auto"),
        parallel_config=SimpleNamespace(
            tensor_parallel_size=1, pipeline_parallel_size=1, world_size=1
        ),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=2048),
    )


@pytest.fixture
def fresh_guard(monkeypatch):
    """Each test is a fresh process as far as the once-per-process log line goes."""
    monkeypatch.setattr(guard, "_said", set())
    monkeypatch.delenv(guard.FAIL_IMPORT_ENV, raising=False)
    monkeypatch.delenv(compat.ALLOW_UNTESTED_ENV, raising=False)


def _build(tmp_path, extra=None, kv=None, role=KVConnectorRole.SCHEDULER, **model):
    extra = {"socket": str(tmp_path / "pool.sock"), **(extra or {})}
    conn = KVOffloadConnector(
        _vllm_config(extra, **model), role, kv or _kv_cache_config(FullAttentionSpec())
    )
    return conn


def _status(tmp_path, role="scheduler"):
    return json.loads((tmp_path / f"connector-status-{role}-0.json").read_text())


def _assert_disabled_hooks(conn):
    req = SimpleNamespace(request_id="r1", num_tokens=300, prompt_token_ids=[1] * 300)
    assert not conn.active
    assert conn.get_num_new_matched_tokens(req, 0) == (0, False)
    conn.update_state_after_alloc(req, None, 0)
    meta = conn.build_connector_meta(SimpleNamespace())
    assert type(meta) is KVConnectorMetadata
    conn.update_connector_output(SimpleNamespace(kv_connector_worker_meta=None))
    assert conn.request_finished(req, [1, 2]) == (False, None)
    assert conn.request_finished_all_groups(req, ([1, 2],)) == (False, None)
    assert conn.has_pending_push_work() is False
    conn.bind_gpu_block_pool(object())
    conn.register_kv_caches({})
    conn.bind_connector_metadata(meta)
    conn.start_load_kv(None)
    conn.wait_for_layer_load("model.layers.0.attn")
    conn.save_kv_layer("model.layers.0.attn", None, None)
    conn.wait_for_save()
    assert conn.get_finished({"r1"}) == (None, None)
    results = conn.get_transfer_results({"r1"})
    assert not results.finished_sending and not results.finished_recving
    assert not results.failed_recving
    assert conn.get_block_ids_with_load_errors() == set()
    assert conn.build_connector_worker_meta() is None
    assert conn.get_kv_connector_stats() is None
    assert conn.requires_kv_delivery is False
    assert KVOffloadConnector.requires_piecewise_for_cudagraph({}) is False
    conn.shutdown()


def _said(caplog):
    return [r.getMessage() for r in caplog.records if "serving without the pool" in r.getMessage()]


# -- class 5: a construction that fails disables, says why once ---------------------------------


def test_bad_config_value_disables_and_says_why_once(tmp_path, fresh_guard, caplog):
    with caplog.at_level(logging.WARNING, logger="kvoffload_connector"):
        conn = _build(tmp_path, {"mode": "sometimes"})
        again = _build(tmp_path, {"mode": "sometimes"}, role=KVConnectorRole.WORKER)
    _assert_disabled_hooks(conn)
    _assert_disabled_hooks(again)
    said = _said(caplog)
    assert len(said) == 1, said
    assert said[0].startswith("kvoffload: serving without the pool: ValueError: ")
    assert "'mode'" in said[0]
    status = _status(tmp_path)
    assert status["state"] == "disabled" and "'mode'" in status["reason"]
    assert status["role"] == "scheduler" and status["rank"] == 0 and status["pid"] == os.getpid()
    assert status["vllm_version"] == compat.vllm_version()
    assert _status(tmp_path, "worker")["state"] == "disabled"


@pytest.mark.parametrize("key", ["inline_lookup_ms", "refresh_steps", "store_threshold"])
@pytest.mark.parametrize(("value", "says"), [(-1, "must be >= 0"), ("soon", "must be an integer")])
def test_the_serving_keys_reject_bad_values_by_name(key, value, says):
    """The load and lookup tuning keys go through the same validated parser: a clear error
    naming the key (the guard above turns it into serving without the pool, said once)."""
    with pytest.raises(ValueError) as e:
        parse_extra_config({key: value}, 16)
    assert f"['{key}']" in str(e.value) and says in str(e.value)
    assert getattr(parse_extra_config({key: "3"}, 16), key) == 3  # strings from the CRD parse


def test_unimportable_dependency_disables(tmp_path, fresh_guard, monkeypatch, caplog):
    monkeypatch.setenv(guard.FAIL_IMPORT_ENV, "grpc")
    with caplog.at_level(logging.WARNING, logger="kvoffload_connector"):
        conn = _build(tmp_path)
    _assert_disabled_hooks(conn)
    assert "ImportError" in conn.disabled_reason and "grpc" in conn.disabled_reason
    assert len(_said(caplog)) == 1


def test_active_connector_writes_active_status(tmp_path, fresh_guard, caplog):
    with caplog.at_level(logging.WARNING, logger="kvoffload_connector"):
        conn = _build(tmp_path, {"chunk_size": 24})  # rounded up to 32: no crash
    try:
        assert conn.active, conn.disabled_reason
        assert conn.cfg.chunk_tokens == 32
        status = _status(tmp_path)
        assert status["state"] == "active" and status["reason"] == ""
        assert not _said(caplog)
    finally:
        conn.shutdown()


@pytest.mark.parametrize("seed", [None, "0"], ids=["no-seed", "seed"])
def test_per_process_hash_seed_is_said_once_and_noted_in_the_status(
    tmp_path, fresh_guard, caplog, monkeypatch, seed
):
    """xxhash block hashes are seeded per process unless PYTHONHASHSEED is set (every vLLM;
    0.26 also sha256): the pool still serves, and the scheduler says once, in its log and its
    status file (`kvoffload stats`), that a restarted engine will not find what it stored."""
    if seed is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", seed)
    config = _vllm_config({"socket": str(tmp_path / "pool.sock")})
    config.cache_config.prefix_caching_hash_algo = "xxhash"
    with caplog.at_level(logging.WARNING, logger="kvoffload_connector"):
        conn = KVOffloadConnector(
            config, KVConnectorRole.SCHEDULER, _kv_cache_config(FullAttentionSpec())
        )
    try:
        assert conn.active, conn.disabled_reason
        said = [r.getMessage() for r in caplog.records if "PYTHONHASHSEED" in r.getMessage()]
        status = _status(tmp_path)
        assert status["state"] == "active"
        if seed is None:
            assert len(said) == 1 and "restarted engine" in said[0], said
            assert status["notes"] == [said[0].removeprefix("kvoffload: ")]
        else:
            assert said == [] and "notes" not in status
    finally:
        conn.shutdown()


def test_kv_caches_the_worker_cannot_map_disable_that_rank_and_tell_the_scheduler(
    tmp_path, fresh_guard, caplog
):
    """A KV cache layout the connector was not written for (here: not tensors at all) must not
    stop vLLM at registration: the rank serves without the pool, says why once, and its next
    worker report tells the scheduler, so requests never wait for its registration."""
    with caplog.at_level(logging.WARNING, logger="kvoffload_connector"):
        conn = _build(tmp_path, role=KVConnectorRole.WORKER)
        assert conn.active, conn.disabled_reason
        conn.register_kv_caches({"model.layers.0.attn": object()})
    assert not conn.active
    assert conn.disabled_reason.startswith("cannot register the KV caches: ")
    said = _said(caplog)
    assert len(said) == 1 and "cannot register the KV caches" in said[0], said
    status = _status(tmp_path, "worker")
    assert status["state"] == "disabled" and "cannot register" in status["reason"]
    report = conn.build_connector_worker_meta()
    assert report.no_pool == conn.disabled_reason
    assert conn.build_connector_worker_meta() is None  # said once
    conn.start_load_kv(None)
    conn.wait_for_save()
    assert conn.get_finished({"r1"}) == (None, None)
    assert conn.get_block_ids_with_load_errors() == set()
    conn.shutdown()


def test_status_write_failure_is_ignored(tmp_path, fresh_guard):
    conn = KVOffloadConnector(
        _vllm_config({"socket": "/proc/no/such/dir/pool.sock", "mode": "x"}),
        KVConnectorRole.SCHEDULER,
        _kv_cache_config(FullAttentionSpec()),
    )
    assert not conn.active


def test_different_block_sizes_disable(tmp_path, fresh_guard):
    conn = _build(tmp_path, kv=_kv_cache_config(FullAttentionSpec(16), FullAttentionSpec(32)))
    _assert_disabled_hooks(conn)
    assert "different block sizes [16, 32]" in conn.disabled_reason


# -- class 7: models the pool cannot serve ------------------------------------------------------


@pytest.mark.parametrize(
    ("kv", "model", "needle"),
    [
        (_kv_cache_config(FullAttentionSpec(), MambaSpec()), {}, "MambaSpec"),
        (_kv_cache_config(CrossAttentionSpec()), {}, "encoder attention"),
        (_kv_cache_config(FullAttentionSpec()), {"is_encoder_decoder": True}, "encoder-decoder"),
        (_kv_cache_config(FullAttentionSpec()), {"runner_type": "pooling"}, "pooling"),
        (_kv_cache_config(FullAttentionSpec()), {"is_hybrid": True}, "hybrid"),
    ],
)
def test_unsupported_models_disable_with_the_reason(tmp_path, fresh_guard, kv, model, needle):
    base = {"is_encoder_decoder": False, "runner_type": "generate"}
    cfg = _vllm_config({"socket": str(tmp_path / "pool.sock")})
    cfg.model_config = SimpleNamespace(**{**base, **model}, dtype="float32")
    conn = KVOffloadConnector(cfg, KVConnectorRole.SCHEDULER, kv)
    _assert_disabled_hooks(conn)
    assert needle in conn.disabled_reason
    assert _status(tmp_path)["state"] == "disabled"


def test_sliding_window_plus_full_attention_stays_supported():
    kv = _kv_cache_config(FullAttentionSpec(), SlidingWindowSpec(sliding_window=64))
    assert compat.model_problem(_vllm_config({}), kv) is None


def test_real_vllm_spec_classes_are_told_apart():
    from vllm.v1 import kv_cache_interface as k

    attention = ("FullAttentionSpec", "SlidingWindowSpec", "MLAAttentionSpec")
    for name in attention:
        assert "AttentionSpec" in {c.__name__ for c in getattr(k, name).__mro__}, name
    mamba = {c.__name__ for c in k.MambaSpec.__mro__}
    assert "AttentionSpec" not in mamba and "MambaSpec" in mamba


# -- class 8: vLLM versions ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("version", "ok"),
    [
        ("0.26.0", True),
        ("0.26.1+cu128", True),
        ("0.32.0", True),
        ("0.33.0", True),
        ("0.33.5rc1", True),
        ("0.25.9", False),
        ("0.34.0", False),
        ("1.0.0", False),
        ("0.1.dev5+gabc", False),
        ("unknown", False),
    ],
)
def test_supported_vllm_range(version, ok):
    assert (compat.version_problem(version, env={}) is None) is ok
    assert compat.version_problem(version, env={compat.ALLOW_UNTESTED_ENV: "1"}) is None


def test_untested_vllm_disables(tmp_path, fresh_guard, monkeypatch):
    monkeypatch.setattr(compat, "vllm_version", lambda: "0.40.0")
    conn = _build(tmp_path)
    _assert_disabled_hooks(conn)
    assert "vLLM 0.40.0 is outside the supported range 0.26 <= version < 0.34" in (
        conn.disabled_reason
    )
    monkeypatch.setenv(compat.ALLOW_UNTESTED_ENV, "1")
    conn = _build(tmp_path)
    assert conn.active
    conn.shutdown()


# -- the payload's deps folder -------------------------------------------------------------------


def test_deps_dir_is_beside_the_package_per_python(tmp_path):
    site = tmp_path / "site"
    (site / "kvoffload_connector").mkdir(parents=True)
    copy = site / "kvoffload_connector" / "guard.py"
    copy.write_text(Path(guard.__file__).read_text())
    code = "import sys; sys.path.insert(0, sys.argv[1]); import kvoffload_connector.guard as g;"
    code += "print(g.deps_dir())"
    out = subprocess.run(
        [sys.executable, "-c", code, str(site)], capture_output=True, text=True, check=True
    ).stdout.strip()
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    assert out == str(site / "_kvoffload_deps" / tag)


def test_payload_deps_are_appended_never_prepended(tmp_path, monkeypatch):
    deps = tmp_path / "_kvoffload_deps" / "cp3x"
    (deps / "kvo_probe_dep").mkdir(parents=True)
    (deps / "kvo_probe_dep" / "__init__.py").write_text("WHERE = 'payload'\n")
    (deps / "json").mkdir()  # a package the interpreter already has must not be shadowed
    (deps / "json" / "__init__.py").write_text("raise RuntimeError('shadowed')\n")
    code = textwrap.dedent(
        f"""
        import sys
        sys.modules.pop("json", None)
        from kvoffload_connector import guard
        assert guard.add_payload_deps(__import__("pathlib").Path({str(deps)!r})) is not None
        assert sys.path[-1] == {str(deps)!r}, sys.path
        import json, kvo_probe_dep
        assert kvo_probe_dep.WHERE == "payload"
        assert "shadowed" not in json.__file__ and {str(deps)!r} not in json.__file__
        from pathlib import Path
        assert guard.add_payload_deps(Path({str(tmp_path / "none")!r})) is None
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_construction_appends_the_payload_deps(tmp_path, fresh_guard, monkeypatch):
    deps = tmp_path / "deps"
    deps.mkdir()
    monkeypatch.setattr(guard, "deps_dir", lambda: deps)
    monkeypatch.setattr(sys, "path", list(sys.path))
    conn = _build(tmp_path)
    try:
        assert sys.path[-1] == str(deps)
    finally:
        conn.shutdown()


# -- the module vLLM imports ---------------------------------------------------------------------


def test_facade_imports_and_disables_without_grpc_protobuf_numpy_stubs(tmp_path):
    """The facade's import needs vLLM's base classes only; with grpc, protobuf and our stubs
    unimportable the connector is built disabled and says why."""
    code = textwrap.dedent(
        f"""
        import sys, logging
        logging.basicConfig(level=logging.WARNING)
        import vllm.distributed.kv_transfer.kv_connector.v1.base as base
        for name in ("grpc", "google.protobuf", "kvoffload", "kvoffload.v1"):
            sys.modules[name] = None  # import raises ImportError
        import kvoffload_connector.connector as c
        ours = sorted(m for m in sys.modules if m.startswith("kvoffload_connector"))
        assert ours == ["kvoffload_connector", "kvoffload_connector.connector",
                        "kvoffload_connector.guard", "kvoffload_connector.scheduler_hooks",
                        "kvoffload_connector.worker_hooks"], ours
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_guard import _vllm_config, _kv_cache_config, FullAttentionSpec
        conn = c.KVOffloadConnector(
            _vllm_config({{"socket": {str(tmp_path / "p.sock")!r}}}),
            base.KVConnectorRole.SCHEDULER, _kv_cache_config(FullAttentionSpec()))
        assert not conn.active and "ModuleNotFoundError" in conn.disabled_reason
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]
    assert out.stderr.count("kvoffload: serving without the pool: ModuleNotFoundError") == 1


# -- the gauge -----------------------------------------------------------------------------------


class _Metric:
    made: list[_Metric] = []

    def __init__(self, name, documentation, labelnames, **kw):
        self.name, self.labelnames, self.values = name, labelnames, {}
        _Metric.made.append(self)

    def labels(self, *values):
        metric = self

        class _Child:
            def set(self, v):
                metric.values[values] = v

            def inc(self, v=1):
                metric.values[values] = metric.values.get(values, 0) + v

        return _Child()


class _BrokenGauge:
    def __init__(self, **kw):
        raise ValueError("Duplicated timeseries in CollectorRegistry")


def _types(gauge=_Metric):
    from vllm.v1.metrics.loggers import Counter, Gauge, Histogram

    return {Gauge: gauge, Counter: _Metric, Histogram: _Metric}


def _gauge(name="vllm:kvoffload_pool_active"):
    return next(m for m in reversed(_Metric.made) if m.name == name)


def test_pool_active_gauge_says_active_or_why_not(tmp_path, fresh_guard):
    good = _vllm_config({"socket": str(tmp_path / "p.sock")})
    good.kv_transfer_config.kv_connector = "KVOffloadConnector"
    m = KVOffloadConnector.build_prom_metrics(
        good, _types(), ["model_name", "engine"], {0: ["m", "0"]}
    )
    assert m is not None
    assert _gauge().labelnames == ["model_name", "engine", "reason"]
    assert _gauge().values == {("m", "0", ""): 1}

    bad = _vllm_config({"socket": str(tmp_path / "p.sock"), "load_mode": "never"})
    m = KVOffloadConnector.build_prom_metrics(bad, _types(), ["engine"], {0: ["0"]})
    ((labels, value),) = _gauge().values.items()
    assert value == 0 and "load_mode" in labels[1]


def test_prom_metrics_never_raise(tmp_path, fresh_guard):
    cfg = _vllm_config({"socket": str(tmp_path / "p.sock")})
    assert KVOffloadConnector.build_prom_metrics(cfg, _types(_BrokenGauge), ["e"], {0: ["0"]})
    assert KVOffloadConnector.build_prom_metrics(cfg, {}, ["e"], {0: ["0"]}) is None


def test_kv_events_that_fail_to_build_leave_the_engine_stepping_and_are_said_once(
    tmp_path, fresh_guard, caplog
):
    """take_events runs in vLLM's engine step: whatever goes wrong building the host tier's
    events (here the feed raising), the step gets no events, and the reason is logged once."""
    conn = _build(tmp_path)
    try:
        assert conn.active, conn.disabled_reason
        assert list(conn.take_events()) == []  # --kv-events-config off: nothing, no feed

        class BrokenFeed:
            def take(self):
                raise RuntimeError("cannot build BlockStored")

        conn._scheduler.event_feed = BrokenFeed()
        with caplog.at_level(logging.WARNING, logger="kvoffload_connector"):
            for _ in range(3):
                assert list(conn.take_events()) == []
        said = [r for r in caplog.records if "KV events of the host tier are off" in r.message]
        assert len(said) == 1 and "cannot build BlockStored" in said[0].message
    finally:
        conn._scheduler.event_feed = None
        conn.shutdown()
