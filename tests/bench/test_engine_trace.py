"""bench/engine_trace.py: the traced connector's configuration and the prefill timeline."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import engine_trace  # noqa: E402
from engine_trace import prefill_timelines  # noqa: E402
from serve_sweep import configs_arg, kv_transfer_config, pool_gib  # noqa: E402


def test_a_traced_kvo_configuration_loads_the_trace_module_with_the_same_keys() -> None:
    plain = kv_transfer_config("kvo-eager+store_threshold=2", "/s.sock", 1 << 30)
    traced = kv_transfer_config("kvo-eager+store_threshold=2", "/s.sock", 1 << 30, traced=True)
    assert plain["kv_connector_module_path"] == "kvoffload_connector.connector"
    assert traced["kv_connector_module_path"] == "engine_trace"
    assert traced["kv_connector"] == plain["kv_connector"] == "KVOffloadConnector"
    assert traced["kv_connector_extra_config"] == plain["kv_connector_extra_config"]
    assert plain["kv_connector_extra_config"]["store_threshold"] == "2"
    assert kv_transfer_config("none", "", 1 << 30, traced=True) is None  # nothing to trace
    # the do-nothing baseline traced: the same module, its own connector class
    noop = kv_transfer_config("noop", "", 1 << 30, traced=True)
    assert (noop["kv_connector_module_path"], noop["kv_connector"]) == (
        "engine_trace",
        "NoopConnector",
    )


def test_prefill_timelines_measure_each_event_from_its_prefill_schedule() -> None:
    events = [  # (label, thread, start s, end s)
        ("schedule:1024", 1, 10.000, 10.001),
        ("execute_model", 1, 10.001, 10.020),
        ("rpc.<lambda>", 2, 10.002, 10.003),
        ("schedule:1", 1, 10.021, 10.0215),
        ("schedule:1", 1, 10.030, 10.0305),
        ("send", 3, 10.200, 10.201),  # past the 80 ms window
        ("schedule:8", 1, 11.000, 11.001),  # a decode step: not a prefill
        ("schedule:600", 1, 12.000, 12.002),
        ("execute_model", 1, 12.002, 12.012),
    ]
    tl = prefill_timelines(events, min_tokens=512, window_s=0.08)
    assert tl["prefills"] == 2
    off = tl["offsets"]
    assert [round(a, 3) for a, _ in off["execute_model#0"]] == [1.0, 2.0]
    assert [round(b - a, 3) for a, b in off["execute_model#0"]] == [19.0, 10.0]
    assert [round(a, 3) for a, _ in off["schedule#1"]] == [21.0]  # the decode after it
    assert [round(a, 3) for a, _ in off["schedule#2"]] == [30.0]
    assert "send#0" not in off and "rpc.<lambda>#0" in off


def test_an_ablation_is_traced_only_and_kept_out_of_the_connector_config(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from serve_sweep import ablation

    cfg = "kvo-eager+ablate=nodma+store_threshold=2"
    assert ablation(cfg) == "nodma" and ablation("kvo-eager+store_threshold=2") == ""
    traced = kv_transfer_config(cfg, "/s.sock", 1 << 30, traced=True)
    assert traced["kv_connector_extra_config"] == {
        "socket": "/s.sock",
        "mode": "eager",
        "store_threshold": "2",
    }
    with pytest.raises(ValueError, match="--engine-trace"):
        kv_transfer_config(cfg, "/s.sock", 1 << 30)
    from serve_sweep import main

    with pytest.raises(SystemExit):  # refused before any server starts
        main(["--configs", "kvo-eager+ablate=nodma", "--out", "/nonexistent/x.json"])
    assert "+ablate= needs --engine-trace" in capsys.readouterr().err


def test_ablations_drop_only_the_stores_part_they_name(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvoffload_connector.transfer import cuda

    calls: list[tuple[str, bool]] = []
    monkeypatch.setattr(
        cuda.CudaEngine,
        "_dma",
        lambda self, r, b, buf, to_pool, s, raw: calls.append(("dma", to_pool)),
    )
    monkeypatch.setattr(
        cuda.CudaEngine,
        "_copy_kernel",
        lambda self, p, ids, buf, s, to_staging, ctas: calls.append(("gather", to_staging)),
    )
    with pytest.raises(ValueError, match="known"):
        engine_trace.ablate("nothing")
    engine_trace.ablate("nodma")
    eng = object.__new__(cuda.CudaEngine)
    for flag in (True, False):
        eng._dma(None, 0, 0, flag, None, 0)
        eng._copy_kernel(None, 0, 0, None, flag, 2)
    # the store's DMA (to the pool) is gone; its gather and all of a load stay
    assert calls == [("gather", True), ("dma", False), ("gather", False)]
    calls.clear()
    engine_trace.ablate("nogather")  # on top of nodma: both gone now
    for flag in (True, False):
        eng._dma(None, 0, 0, flag, None, 0)
        eng._copy_kernel(None, 0, 0, None, flag, 2)
    assert calls == [("dma", False), ("gather", False)]


def test_request_phases_split_each_time_to_first_token_at_its_prefill_step() -> None:
    """The engine's perf_counter runs 1,000 s behind the epoch here (its `clock` event): a
    request sent at epoch 1,010.000 is at 10.000 on the trace's clock."""
    events = [  # (label, thread, start s, end s); the GPU span is recorded a step later
        ("clock", 1, 5.0, 1005.0),
        ("schedule:1", 1, 9.990, 9.991),  # a decode step before the request: not its prefill
        ("execute_model", 1, 9.991, 9.995),
        ("schedule:1024", 1, 10.004, 10.005),
        ("execute_model", 1, 10.005, 10.027),
        ("execute_on:5:5", 1, 10.005, 10.005),  # launched from vCPU 5
        ("keeper", 2, 10.010, 10.0101),  # another thread, during the launch
        ("kvo.start_load_kv", 1, 10.006, 10.0061),  # the engine thread's own hook: not beside
        ("schedule:1", 1, 10.028, 10.029),
        ("execute_model", 1, 10.029, 10.031),
        ("execute_gpu", 1, 10.005, 10.030),
        ("schedule:1024", 1, 12.010, 12.011),  # the second request's prefill: no GPU span
        ("execute_model", 1, 12.011, 12.041),
    ]
    first, second, unsent, untraced = engine_trace.request_phases(
        events,
        [
            {"sent": 1010.0, "ttft_s": 0.040},
            {"sent": 1012.0, "ttft_s": 0.050},
            {"ttft_s": 0.040},  # an older report: no `sent` stamp
            {"sent": 1013.0, "ttft_s": 0.040},  # after the last traced prefill
        ],
    )
    assert first == pytest.approx(
        {
            "to_schedule_ms": 4.0,
            "schedule_ms": 1.0,
            "execute_ms": 22.0,
            "execute_gpu_ms": 25.0,
            "after_ms": 13.0,  # 40 ms less the 27 ms from sending to the prefill's end
            "cpu": 5,
            "beside": 1,
        }
    )
    assert second is not None and second["execute_gpu_ms"] is None and second["cpu"] == -1
    assert second["beside"] == 0
    assert second["after_ms"] == pytest.approx(50.0 - 41.0)
    assert unsent is None and untraced is None
    # a trace without the clock anchor (written before it existed) places no request
    assert engine_trace.request_phases(events[1:], [{"sent": 1010.0, "ttft_s": 0.04}]) == [None]


def test_the_trace_names_the_cpu_a_step_ran_on() -> None:
    """`execute_on:CPU0:CPU1` events name the CPUs the engine thread ran on (sched_getcpu)."""
    assert 0 <= engine_trace._cpu() < (os.cpu_count() or 1)


def test_pool_gib_sizes_one_kvo_servers_sidecar_and_stays_out_of_the_connector_keys() -> None:
    assert pool_gib("kvo-eager+pool_gib=1.5", 24.0) == 1.5
    assert pool_gib("kvo-eager", 24.0) == 24.0
    kv = kv_transfer_config("kvo-eager+pool_gib=1+store_threshold=2", "/s.sock", 1 << 30)
    assert kv["kv_connector_extra_config"] == {
        "socket": "/s.sock",
        "mode": "eager",
        "store_threshold": "2",
    }
    assert configs_arg("none,kvo-eager+pool_gib=1,kvo-eager")[1] == "kvo-eager+pool_gib=1"
    for bad in ("kvo-eager+pool_gib=0", "kvo-eager+pool_gib=x", "none+pool_gib=1"):
        with pytest.raises(argparse.ArgumentTypeError, match="pool_gib"):
            configs_arg(bad)
