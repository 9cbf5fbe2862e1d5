"""One entry point for every benchmark: `python -m bench NAME [args]` runs the script NAME.py
beside this file as `__main__` (`NAME --help`: its flags); `python -m bench` lists them. The GPU
machine runs the same through `bash bench/gpu_run.sh NAME`; bench/README.md: machines, minutes.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

# name -> the question it answers (bench/README.md has the commands, machines and minutes)
BENCHMARKS = {
    "sidecar_rpc": "what a lookup or reservation round trip to the sidecar costs",
    "index_ops": "how many block operations a second the pool's index does",
    "connector_overhead": "what the connector's hooks cost an engine step at 0% hits",
    "inject_latency": "how long the webhook takes to admit a pod",
    "adoption": "how fast a restarted sidecar adopts its pool",
    "node_prefault": "what making a node pool tenant's memfd resident costs per GiB",
    "node_front": "what the agent's pool.sock front (attest, bound, splice) adds to control RPCs",
    "transfer": "how close GPU <-> pool copies come to the PCIe ceiling",
    "e2e_gpu": "TTFT of a pool hit, multi-turn throughput, the first request after a restart",
    "serve": "`vllm serve` under load (sweep, report) and at 0% hits against vLLM alone (paired)",
    "router": "routing on the host tier (Dynamo's KV indexer) against round-robin",
}


def usage() -> str:
    width = max(map(len, BENCHMARKS))
    lines = [f"  {name:<{width}}  {what}" for name, what in BENCHMARKS.items()]
    return "usage: python -m bench NAME [args]   (NAME --help for its flags)\n\n" + "\n".join(lines)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "list"):
        print(usage())
        return 0
    name, *rest = argv
    if name not in BENCHMARKS:
        print(f"unknown benchmark {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    script = HERE / f"{name}.py"
    sys.argv = [str(script), *rest]
    sys.path.insert(0, str(HERE))  # the scripts import each other and harness.py by name
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
