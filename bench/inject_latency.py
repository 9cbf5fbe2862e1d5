"""Injection cost per pod: the pure mutation (decide + render + JSON-patch diff) and the whole
admission path including kopf's HTTPS server, against the webhook's 5 s timeoutSeconds.

Pure path: every golden pod template of tests/operator/testdata through `inject_pod`.
HTTPS path: the operator (kopf + our handlers) in-process against the kmock API emulator, one
AdmissionReview v1 at a time over TLS from a client in another thread, N requests.

    python -m bench inject_latency [--requests 300] [--out bench/out/inject_latency.json]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]
from harness import percentile, report  # noqa: E402


def bench_pure(rounds: int) -> dict[str, float]:
    from kvoffload_operator.inject import inject_pod
    from kvoffload_operator.workloads import pod_templates

    from tests.operator.golden import DEFAULTS, cases

    work = [(t, c.policies()) for c in cases() for d in c.docs() for _, t in pod_templates(d)]
    samples = []
    for _ in range(rounds):
        for template, policies in work:
            start = time.perf_counter()
            inject_pod(template, policies, DEFAULTS)
            samples.append(time.perf_counter() - start)
    return {
        "path": "inject_pod (decide + render + JSON patch), every golden template",
        "n": len(samples),
        **{f"p{q}_ms": percentile(samples, q) * 1e3 for q in (50, 99)},
    }


async def bench_https(requests: int) -> dict[str, float]:
    import kmock

    from tests.operator.harness import POLICIES, put, running_operator

    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"labels": {"app": "vllm"}},
        "spec": {
            "containers": [
                {"name": "vllm", "image": "vllm/vllm-openai:v0.11.0", "args": ["--model", "m"]}
            ]
        },
    }
    policy = {
        "apiVersion": "kvoffload.io/v1alpha1",
        "kind": "KVOffloadPolicy",
        "metadata": {"name": "bench", "namespace": "bench"},
        "spec": {"selector": {"matchLabels": {"app": "vllm"}}, "pool": {"size": "16Gi"}},
    }
    async with kmock.KubernetesEmulator() as server, kmock.Server(server):
        put(server, POLICIES, policy)  # before the operator starts: it lists it
        async with running_operator(server, Path(tempfile.mkdtemp())) as op:
            return await _measure(op, pod, requests)


async def _measure(op: Any, pod: dict[str, Any], requests: int) -> dict[str, float]:
    deadline = time.monotonic() + 30
    while not (await asyncio.to_thread(op.review, pod, "bench")).get("patch"):
        if time.monotonic() > deadline:
            raise SystemExit("the webhook never injected (policy index not populated)")
        await asyncio.sleep(0.2)
    samples = []
    for _ in range(requests):
        start = time.perf_counter()
        response = await asyncio.to_thread(op.review, pod, "bench")
        samples.append(time.perf_counter() - start)
        assert response["allowed"] and response.get("patch")
    return {
        "path": "AdmissionReview over HTTPS, a new TLS connection per request",
        "n": requests,
        **{f"p{q}_ms": percentile(samples, q) * 1e3 for q in (50, 99)},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--out", default=str(ROOT / "bench/out/inject_latency.json"))
    args = parser.parse_args()
    rows = [bench_pure(args.rounds), asyncio.run(bench_https(args.requests))]
    report("inject_latency (the webhook's timeoutSeconds: 5000 ms)", rows, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
