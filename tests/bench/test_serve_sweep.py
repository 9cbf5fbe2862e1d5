"""`python -m bench serve sweep` end to end on the CPU build: real `vllm serve` processes,
vLLM's own `vllm bench serve` client, the kvoffload sidecar; and the served model's tokenizer.

The sweep's GPU numbers come from the same code (`bench/gpu_run.sh serve`); a tiny Llama
with a GPU KV cache of a dozen 128-token blocks makes the prefixes leave the GPU cache, so the
kvoffload server must serve hits from the host tier while the one without a connector cannot.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from serve import (  # noqa: E402
    build_model_dir,
    build_tokenizer,
    configs_arg,
    kv_transfer_config,
    pool_gib,
)


def test_the_served_tokenizer_round_trips_every_id_as_one_word(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    out = build_model_dir(ROOT / "tests/connector/models/tiny-llama/config.json", tmp_path / "m")
    config = json.loads((out / "config.json").read_text())
    tok = AutoTokenizer.from_pretrained(str(out))
    vocab = config["vocab_size"]
    assert len(tok) == vocab == build_tokenizer(vocab).get_vocab_size()
    ids = [0, 5, 77, config["vocab_size"] - 6]
    text = tok.decode(ids)
    assert text.split() == [f"w{i}" for i in ids]
    assert tok.encode(text, add_special_tokens=False) == ids  # N words = N tokens, exactly
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "w1 w2 w3"}], tokenize=False, add_generation_prompt=True
    )
    assert "w1 w2 w3" in chat and chat.rstrip().endswith("<|end_header_id|>")
    assert config["eos_token_id"] == tok.convert_tokens_to_ids("<|eot_id|>")


GATED = "kvo-eager+store_threshold=2"


@pytest.mark.vllm
@pytest.mark.process
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_cpu_sweep_serves_every_point_and_kvoffload_hits_the_host_tier(tmp_path: Path) -> None:
    out = tmp_path / "sweep.json"
    cmd = [
        sys.executable,
        str(ROOT / "bench/serve.py"),
        "sweep",
        "--model",
        str(ROOT / "tests/connector/models/tiny-llama"),
        "--configs",
        f"none,kvo-eager,{GATED}",
        "--dtype",
        "float32",
        "--graphs",
        "none",
        "--gpu-blocks",
        "12",
        "--max-model-len",
        "1024",
        "--max-num-seqs",
        "4",
        "--gpu-mem-util",  # on the CPU build: the share of host memory vLLM may take
        "0.3",
        "--cpu-gib",
        "0.25",
        "--rates",
        "8",
        "--random-rates",
        "8",
        "--point-s",
        "2",
        "--min-requests",
        "16",
        "--max-requests",
        "16",
        "--prefix-len",
        "512",
        "--suffix-len",
        "64",
        "--num-prefixes",
        "4",
        "--output-len",
        "4",
        "--random-input-len",
        "256",
        "--budget-s",
        "420",
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=540, check=False)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert proc.returncode == 0, (report.get("servers"), proc.stdout[-2000:])
    assert {c: s["status"] for c, s in report["servers"].items()} == {
        "none": "ok",
        "kvo-eager": "ok",
        GATED: "ok",
    }
    # each configuration was warmed up with unreported requests before its first point
    assert all(s["warmup"]["rc"] == 0 for s in report["servers"].values())
    rows = {(r["config"], r["point"]): r for r in report["rows"]}
    configs = ("none", "kvo-eager", GATED)
    assert set(rows) == {(c, p) for c in configs for p in ("random@8", "prefix@8")}
    for row in rows.values():
        assert row["rc"] == 0 and row["completed"] == 16 and row["failed"] == 0
        assert len(row["ttfts_ms"]) == 16 and row["median_ttft_ms"] > 0
        assert row["counters"]["vllm:generation_tokens"] == 16 * 4  # --ignore-eos: exact
        # by source, once per request: the three shares cover every prompt token
        shares = [row[k] for k in ("computed_share", "gpu_cached_share", "host_cached_share")]
        assert abs(sum(shares) - 1) < 1e-3, shares
    # 0% hits: random prompts share nothing, on either tier
    assert rows[("kvo-eager", "random@8")]["host_hit_rate"] == 0
    # prefixes repeat 4x and leave the 12-block GPU cache: only kvoffload serves them again
    assert rows[("none", "prefix@8")]["host_hit_rate"] is None  # no connector, no queries
    assert rows[("kvo-eager", "prefix@8")]["host_hit_rate"] > 0
    assert rows[("kvo-eager", "prefix@8")]["host_cached_share"] > 0
    assert rows[("none", "prefix@8")]["host_cached_share"] == 0
    assert rows[("kvo-eager", "random@8")]["computed_share"] == 1
    stats = report["servers"]["kvo-eager"]["sidecar_stats"]
    (ns,) = stats["namespaces"]
    assert int(ns["hitBlocks"]) > 0 and int(ns["storedBlocks"]) > 0
    assert "## prefix@8" in proc.stdout and "Verdict" in proc.stdout  # the call's report
    # store_threshold=2: a prefix's first request skips its store (vLLM's /metrics counts the
    # chunks); the second stores it, so the later ones hit the pool
    skipped = "kvoffload_connector_below_threshold_store_chunks"
    assert rows[(GATED, "prefix@8")]["counters"][skipped] > 0
    assert rows[("kvo-eager", "prefix@8")]["counters"][skipped] == 0
    assert rows[(GATED, "prefix@8")]["host_cached_share"] > 0


def test_pool_gib_sizes_one_kvo_servers_sidecar_and_stays_out_of_the_connector_keys() -> None:
    assert pool_gib("kvo-eager+pool_gib=1.5", 24.0) == 1.5
    assert pool_gib("kvo-eager", 24.0) == 24.0
    kv = kv_transfer_config("kvo-eager+pool_gib=1+store_threshold=2", "/s.sock", 1 << 30)
    assert kv["kv_connector_module_path"] == "kvoffload_connector.connector"
    assert kv["kv_connector_extra_config"] == {
        "socket": "/s.sock",
        "mode": "eager",
        "store_threshold": "2",
    }
    assert kv_transfer_config("none", "", 1 << 30) is None
    with pytest.raises(ValueError, match="unknown configuration"):
        kv_transfer_config("noop", "", 1 << 30)
    assert configs_arg("none,kvo-eager+pool_gib=1,kvo-eager")[1] == "kvo-eager+pool_gib=1"
    for bad in ("kvo-eager+pool_gib=0", "kvo-eager+pool_gib=x", "none+pool_gib=1"):
        with pytest.raises(argparse.ArgumentTypeError, match="pool_gib"):
            configs_arg(bad)
