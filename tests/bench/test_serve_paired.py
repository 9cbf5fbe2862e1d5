"""`bench/serve.py paired`: two real `vllm serve` processes (CPU build) at once, paired rounds."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from harness import bootstrap_median_ci  # noqa: E402
from serve import across_calls, configs_arg, main, mode_split, paired_rows  # noqa: E402


def _samples(ttft: dict[str, list[float]]) -> dict[str, list[dict]]:
    return {c: [{"round": i, "ttft_s": t} for i, t in enumerate(v)] for c, v in ttft.items()}


def test_pairs_are_round_by_round() -> None:
    ttft = {"none": [0.010, 0.020, 0.030, 0.040], "kvo": [0.011, 0.022, 0.033, 0.044]}
    (kvo,) = paired_rows(_samples(ttft), "none")
    assert (kvo["config"], kvo["against"], kvo["n"]) == ("kvo", "none", 4)
    # every round 10% slower, though the medians of the two lists alone would hide the pairing
    assert kvo["ratio_p50"] == pytest.approx(1.1)
    assert kvo["ratio_ci95"] == [pytest.approx(1.1), pytest.approx(1.1)]
    assert kvo["faster_rounds"] == 0


def test_replicas_pool_per_round_and_show_their_own_offset() -> None:
    """A B B A: each configuration's two servers pooled by geometric mean round by round; the
    second `none` server sits 4% above the first all call long, and its row says so."""
    ttft = {
        "none": [0.010, 0.020, 0.040],
        "kvo-eager": [0.0102, 0.0204, 0.0408],
        "kvo-eager#2": [0.0106, 0.0212, 0.0424],
        "none#2": [0.0104, 0.0208, 0.0416],
    }
    pooled, kvo_replica, none_replica = paired_rows(_samples(ttft), "none")
    assert (pooled["config"], pooled["against"]) == ("kvo-eager (x2)", "none (x2)")
    assert pooled["ratio_p50"] == pytest.approx(((1.02 * 1.06) / (1.0 * 1.04)) ** 0.5, abs=1e-4)
    assert (none_replica["config"], none_replica["against"]) == ("none#2", "none")
    assert none_replica["ratio_p50"] == pytest.approx(1.04) and none_replica["faster_rounds"] == 0
    assert kvo_replica["ratio_p50"] == pytest.approx(1.06 / 1.02, abs=1e-4)


def test_server_labels_name_replicas_once() -> None:
    assert configs_arg("none,kvo-eager,kvo-eager#2,none#2") == [
        "none",
        "kvo-eager",
        "kvo-eager#2",
        "none#2",
    ]
    assert configs_arg("kvo-eager+store_threshold=2#2") == ["kvo-eager+store_threshold=2#2"]
    for bad in ("none,none", "none#1", "none#x", "bogus#2"):
        with pytest.raises(argparse.ArgumentTypeError):
            configs_arg(bad)


def test_bootstrap_interval_holds_the_median_and_narrows_with_more_pairs() -> None:
    few = [1.0, 1.02, 0.98, 1.05, 0.97, 1.01]
    lo, hi = bootstrap_median_ci(few)
    assert lo <= sorted(few)[3] and hi >= sorted(few)[2]
    lo2, hi2 = bootstrap_median_ci(few * 20)
    assert hi2 - lo2 < hi - lo


def test_bad_flags_are_refused_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["paired", "--configs", "none"])
    assert "--configs: give a baseline" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["paired", "--configs", "none,kvo-eager", "--rounds", "0"])
    assert "--rounds" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["paired", "--configs", "none,kvo-eager", "--warmup-concurrency", "0"])
    assert "--warmup-concurrency" in capsys.readouterr().err


@pytest.mark.vllm
@pytest.mark.process
@pytest.mark.slow
def test_two_cpu_servers_pair_rounds_and_kvo_stores(tmp_path: Path) -> None:
    out = tmp_path / "paired.json"
    cmd = [
        sys.executable,
        str(ROOT / "bench/serve.py"),
        "paired",
        "--model",
        str(ROOT / "tests/connector/models/tiny-llama"),
        "--configs",
        # the baseline on two servers
        "none,kvo-eager,none#2",
        "--dtype",
        "float32",
        "--graphs",
        "none",
        "--gpu-blocks",
        "16",
        "--max-model-len",
        "1024",
        "--max-num-seqs",
        "4",
        "--gpu-mem-util-total",  # on the CPU build: the share of host memory, split in two
        "0.36",
        "--cpu-gib",
        "0.25",
        "--rounds",
        "6",
        "--warmup-rounds",
        "1",
        "--warmup-burst",  # 3 unreported prompts to each server at once, 2 at a time
        "3",
        "--warmup-concurrency",
        "2",
        "--prompt-tokens",
        "600",  # one full chunk (4 blocks of 128 tokens, vLLM's CPU default) per prompt
        "--output-tokens",
        "4",
        "--gap-s",
        "0",
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    configs = ("none", "kvo-eager", "none#2")
    assert [r["config"] for r in report["rows"]] == list(configs)
    assert all(r["n"] == 6 for r in report["rows"])
    for config in configs:
        samples = report["samples"][config]
        assert [s["round"] for s in samples] == list(range(1, 7))  # warm-up round left out
        # 4 tokens streamed (vLLM may merge tokens into a chunk); the first before the last
        assert all(s["output_tokens"] == 4 and s["chunks"] >= 1 for s in samples), samples
        assert all(0 < s["ttft_s"] <= s["e2e_s"] for s in samples), samples
        sent = [s["sent"] for s in samples]  # wall clock at send
        assert sent == sorted(sent) and abs(sent[-1] - time.time()) < 900
        assert report["servers"][config]["warmup_burst"]["requests"] == 3
    kvo, offset = report["pairs"]
    assert (kvo["config"], kvo["against"], kvo["n"]) == ("kvo-eager", "none (x2)", 6)
    assert kvo["ratio_ci95"][0] <= kvo["ratio_p50"] <= kvo["ratio_ci95"][1]
    assert (offset["config"], offset["against"], offset["n"]) == ("none#2", "none", 6)
    # eager stored each random prompt's full chunk, and nothing hit
    (ns,) = report["servers"]["kvo-eager"]["sidecar_stats"]["namespaces"]
    # one pool slot (chunk) a prompt: the 7 prompts of the rounds store at most 7, so more
    # means the burst's prompts were served and stored too (the last store may still be out)
    assert int(ns["storedBlocks"]) >= 3 + 1 + 6 - 1 and int(ns.get("hitBlocks", 0)) == 0
    assert report["servers"]["none"]["sidecar_stats"] is None
    assert "--kv-transfer-config" not in report["servers"]["none#2"]["argv"]


def _report(pairs: dict[str, list[tuple[int, float]]]) -> dict:
    return {
        "args": {"configs": list(pairs)},  # started in this order
        "samples": {c: [{"round": r, "ttft_s": t} for r, t in xs] for c, xs in pairs.items()},
    }


def test_mode_split_gives_each_servers_slow_share_and_mode_medians() -> None:
    """Two servers, ten rounds: fast ~30 ms, slow ~40 ms; kvo slow in 5 rounds, none in 3."""
    fast, slow = [0.030, 0.031, 0.032], [0.040, 0.041, 0.042]

    def server(slow_rounds: int) -> list[dict]:
        return [
            {"round": i, "ttft_s": (slow if i < slow_rounds else fast)[i % 3]} for i in range(10)
        ]

    modes = mode_split({"none": server(3), "kvo": server(5)})
    assert 32 < modes["cut_ms"] < 40
    none, kvo = modes["rows"]
    assert (none["slow_share"], kvo["slow_share"]) == (0.3, 0.5)
    assert none["slow_p50_ms"] == 41.0 and none["fast_p50_ms"] == 31.0


def _ratios(row: dict) -> dict[str, float]:
    return {name: c["ratio"] for name, c in row["per_call"].items()}


def test_across_calls_takes_one_median_per_call_paired_by_round(tmp_path: Path, capsys) -> None:
    """A call whose kvo server sits 3% slower the whole call is one sample, not 3 rounds; rounds
    pair by number (a round only one server answered is left out); a call without the
    configuration does not count."""
    calls = {
        "a": _report(
            {"none": [(1, 1.0), (2, 2.0), (3, 4.0)], "kvo": [(1, 1.03), (2, 2.06), (3, 4.12)]}
        ),
        "b": _report(
            {"none": [(1, 1.0), (2, 1.0), (5, 9.0)], "kvo": [(1, 1.01), (2, 1.01), (4, 1.0)]}
        ),
        "c": _report({"none": [(1, 1.0)], "other": [(1, 1.0)]}),
        "d": _report({"kvo": [(1, 0.99), (2, 0.99)], "none": [(1, 1.0), (2, 1.0)]}),
    }
    row = across_calls(calls, "kvo", "none")
    assert row["calls"] == 3 and _ratios(row) == {"a": 1.03, "b": 1.01, "d": 0.99}
    assert row["per_call"]["b"]["rounds"] == 2
    # the geometric mean of the three calls, its standard error over calls (in log units)
    assert row["geo_mean"] == pytest.approx((1.03 * 1.01 * 0.99) ** (1 / 3), abs=1e-4)
    assert row["sem"] == pytest.approx(0.0115, abs=2e-4)
    # the start order is the dict order above: "none" first in a and b, "kvo" in d
    assert row["first_started"] == {"none": 2, "kvo": 1}
    for name, rep in calls.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(rep))
    out = tmp_path / "merged.json"
    files = [str(tmp_path / f"{n}.json") for n in calls]
    assert main(["merge", *files, "--pair", "kvo/none", "--out", str(out)]) == 0
    assert _ratios(json.loads(out.read_text())[0]) == {"a": 1.03, "b": 1.01, "d": 0.99}
    printed = capsys.readouterr().out
    assert "== kvo / none, per call ==" in printed and "1.03" in printed
    with pytest.raises(SystemExit):
        main(["merge", *files, "--pair", "kvo"])
    # Device calls each write pN/paired.json: same stems, so the folder names the call.
    for name, rep in calls.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "paired.json").write_text(json.dumps(rep))
    same_stem = [str(tmp_path / n / "paired.json") for n in calls]
    assert main(["merge", *same_stem, "--pair", "kvo/none", "--out", str(out)]) == 0
    assert set(json.loads(out.read_text())[0]["per_call"]) == {"a/paired", "b/paired", "d/paired"}
    with pytest.raises(SystemExit):
        main(["merge", files[0], files[0], "--pair", "kvo/none"])
    # Calls are kept as .json.xz: read as they are, named without both suffixes.
    import lzma

    packed = tmp_path / "a.json.xz"
    packed.write_bytes(lzma.compress(json.dumps(calls["a"]).encode()))
    mixed = [str(packed), *files[1:]]
    assert main(["merge", *mixed, "--pair", "kvo/none", "--out", str(out)]) == 0
    assert _ratios(json.loads(out.read_text())[0]) == {"a": 1.03, "b": 1.01, "d": 0.99}


def test_across_calls_splits_each_calls_gap_into_slow_share_and_fast_mode_cost() -> None:
    """Call a: kvo slow in 5 rounds of 10, none in 3, kvo's fast requests 1% slower; call b:
    both slow in 4, equally fast; call c: none never fast (no fast-mode ratio)."""

    def server(slow_rounds: int, fast_s: float) -> list[tuple[int, float]]:
        return [(i, 0.040 if i < slow_rounds else fast_s) for i in range(10)]

    calls = {
        "a": _report({"none": server(3, 0.030), "kvo": server(5, 0.0303)}),
        "b": _report({"none": server(4, 0.030), "kvo": server(4, 0.030)}),
        "c": _report({"none": server(10, 0.030), "kvo": server(2, 0.030)}),
    }
    row = across_calls(calls, "kvo", "none")
    a, b, c = (row["per_call"][k] for k in "abc")
    assert (a["slow_share"], a["fast_ratio"]) == ([0.5, 0.3], 1.01)
    assert a["fast_p50_ms"] == [[30.3], [30.0]]
    assert (b["slow_share"], b["fast_ratio"]) == ([0.4, 0.4], 1.0)
    assert c["fast_ratio"] is None
    assert row["slow_share_diff"] == pytest.approx((0.2 + 0.0 - 0.8) / 3, abs=1e-3)
    assert row["fast_ratio_geo_mean"] == pytest.approx(1.01**0.5, abs=1e-4)


def test_calls_started_a_b_b_a_count_as_both_start_orders() -> None:
    """A call that started kvo, none, none#2, kvo#2 is balanced within itself: its pooled
    ratio (every round the geometric mean of each side's two servers) is one balanced sample."""
    abba = _report(
        {
            "kvo": [(1, 1.02), (2, 2.04)],
            "none": [(1, 1.0), (2, 2.0)],
            "none#2": [(1, 1.0), (2, 2.0)],
            "kvo#2": [(1, 1.0), (2, 2.0)],
        }
    )
    kvo_first = _report({"kvo": [(1, 1.03)], "none": [(1, 1.0)]})
    none_first = _report({"none": [(1, 1.0)], "kvo": [(1, 0.99)]})
    row = across_calls({"abba": abba, "k": kvo_first, "n": none_first}, "kvo", "none")
    assert row["per_call"]["abba"]["ratio"] == pytest.approx(1.02**0.5, abs=1e-4)
    assert row["first_started"] == {"balanced": 1, "kvo": 1, "none": 1}
    assert row["geo_mean"] == pytest.approx((1.03 * 0.99 * 1.02**0.5) ** (1 / 3), abs=1e-4)
    # a replica against its configuration: the other servers of it, not itself
    abba["samples"]["none#2"] = [{"round": r, "ttft_s": t * 1.01} for r, t in ((1, 1.0), (2, 2.0))]
    offset = across_calls({"abba": abba}, "none#2", "none")
    assert offset["per_call"]["abba"]["ratio"] == pytest.approx(1.01)
    assert offset["first_started"] == {"none": 1}
    second = across_calls({"abba": abba}, "kvo#2", "none")
    assert second["per_call"]["abba"]["ratio"] == pytest.approx(1.01**-0.5, abs=1e-4)
    assert second["first_started"] == {"none": 1}
