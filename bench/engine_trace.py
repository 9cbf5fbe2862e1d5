"""Timeline of vLLM's engine-core loop around the kvoffload connector (a diagnostic).

`bench/serve_sweep.py --engine-trace DIR` starts kvo and noop configurations with this module as
the connector module: the connector is kvoffload's own (noop's, KVO_TRACED_CONNECTOR=noop, for a
baseline traced alike; its hooks keep the `kvo.` labels), and importing the module wraps, in the
engine-core process, the scheduler's `schedule`/`update_from_output`, the executor's
`execute_model`, the wait for a step's async output, the output thread's socket send, the
connector's step hooks, every call on the connector's RPC threads and every garbage
collection (`gc0`..`gc2`), each recorded as (label, thread, start, end). A thread appends
them to DIR/trace-PID.jsonl every few seconds.

Why: a request's time to first token is its prefill step plus whatever the engine's one
Python thread does before the output thread may send that step's tokens; this shows what.

    python bench/engine_trace.py DIR [DIR...]   # per prefill step: median offsets of events
"""

from __future__ import annotations

import bisect
import json
import os
import statistics
import sys
import threading
import time
from collections import deque
from pathlib import Path

_EVENTS: list[tuple[str, int, float, float]] = []
_MAX_EVENTS = 400_000
_PATCHED = False


def _record(label: str, t0: float) -> None:
    if len(_EVENTS) < _MAX_EVENTS:
        _EVENTS.append((label, threading.get_ident(), t0, time.perf_counter()))


def _wrap(owner: object, name: str, label: str, describe=None) -> None:
    fn = getattr(owner, name, None)
    if fn is None:
        return

    def wrapped(*a, **kw):
        t0 = time.perf_counter()
        out = fn(*a, **kw)
        _record(label if describe is None else f"{label}:{describe(a, out)}", t0)
        return out

    setattr(owner, name, wrapped)


def _wrap_execute(executor_cls: type) -> None:
    """`execute_model` as `_wrap` records it, plus the engine thread's CPU time in it
    (`execute_cpu`), the whole process's (`execute_proc`) and the GPU time between CUDA events
    recorded on the current stream before and after it (`execute_gpu`, read once the later
    event completes): a step slower on the GPU and one whose host launches are slower look
    alike in wall time alone."""
    import torch

    fn = executor_cls.execute_model
    pending: deque = deque()
    gpu = torch.cuda.is_available()  # the CPU build: CPU time only

    def wrapped(*a, **kw):
        while pending and pending[0][2].query():
            t_wall, e0, e1 = pending.popleft()
            gpu_s = e0.elapsed_time(e1) / 1e3
            _EVENTS.append(("execute_gpu", threading.get_ident(), t_wall, t_wall + gpu_s))
        events = (
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            if gpu
            else ()
        )
        cpu0 = _cpu()
        t0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
        if gpu:
            events[0].record()
        out = fn(*a, **kw)
        if gpu:
            events[1].record()
            pending.append((t0, *events))
        c1, p1 = time.thread_time(), time.process_time()
        _record("execute_model", t0)
        _EVENTS.append(("execute_cpu", threading.get_ident(), t0, t0 + (c1 - c0)))
        # every thread of the process: what the others took beside this one
        _EVENTS.append(("execute_proc", threading.get_ident(), t0, t0 + (p1 - p0)))
        # the CPUs the engine thread ran on as the step began and ended (placement: NUMA
        # node, a core shared with a busy thread)
        _EVENTS.append((f"execute_on:{cpu0}:{_cpu()}", threading.get_ident(), t0, t0))
        return out

    executor_cls.execute_model = wrapped


def _cpu() -> int:
    """The CPU this thread runs on now (glibc's sched_getcpu; -1 where it is missing)."""
    global _SCHED_GETCPU
    if _SCHED_GETCPU is None:
        import ctypes

        try:
            _SCHED_GETCPU = ctypes.CDLL(None, use_errno=True).sched_getcpu
        except (OSError, AttributeError):
            _SCHED_GETCPU = lambda: -1  # noqa: E731
    return int(_SCHED_GETCPU())


_SCHED_GETCPU = None


def _scheduled(a, out) -> str:
    return str(getattr(out, "total_num_scheduled_tokens", "?"))


DUMP_PERIOD_S = 3.0  # a client waits this long after its last request before stopping servers


def _dump_forever(out_dir: Path) -> None:
    """Append the events recorded since the last turn, one JSON line each: this thread shares
    the GIL with the engine it measures, so a turn costs what is new, not the whole run."""
    path = out_dir / f"trace-{os.getpid()}.jsonl"
    written = 0
    while True:
        time.sleep(DUMP_PERIOD_S)
        end = len(_EVENTS)
        if end > written:
            with path.open("a") as f:
                f.write("".join(json.dumps(e) + "\n" for e in _EVENTS[written:end]))
            written = end


def load_events(path: Path) -> list[list]:
    """The events of one trace file, as written by the engine's dump thread."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def install(out_dir: str, connector_cls: type) -> None:
    """Wrap vLLM's loop and the connector in this process (once)."""
    global _PATCHED
    if _PATCHED:
        return
    _PATCHED = True
    import zmq
    from vllm.v1.core.sched import scheduler
    from vllm.v1.executor import uniproc_executor

    _wrap(scheduler.Scheduler, "schedule", "schedule", _scheduled)
    _wrap(scheduler.Scheduler, "update_from_output", "update_from_output")
    _wrap_execute(uniproc_executor.UniProcExecutor)
    _wrap(uniproc_executor.UniProcExecutor, "sample_tokens", "sample_tokens")
    _wrap(uniproc_executor.AsyncOutputFuture, "result", "wait_output")
    _wrap(zmq.Socket, "send_multipart", "send")
    _wrap(zmq.Socket, "send", "send1")
    for hook in (
        "get_num_new_matched_tokens",
        "update_state_after_alloc",
        "build_connector_meta",
        "update_connector_output",
        "request_finished",
        "start_load_kv",
        "wait_for_save",
        "get_finished",
        "build_connector_worker_meta",
        "get_kv_connector_stats",
    ):
        _wrap(connector_cls, hook, f"kvo.{hook}")
    if connector_cls.__name__ == "KVOffloadConnector":
        _trace_rpcs()
    import gc

    gc_start: list[float] = []

    def on_gc(phase: str, info: dict) -> None:  # a collection pauses every thread
        if phase == "start":
            gc_start[:] = [time.perf_counter()]
        elif gc_start:
            _record(f"gc{info.get('generation', '?')}", gc_start[0])

    gc.callbacks.append(on_gc)
    ablate(os.environ.get("KVO_ABLATE", ""))
    # the events' clock (perf_counter) against the epoch the client stamps requests with
    _EVENTS.append(("clock", threading.get_ident(), time.perf_counter(), time.time()))
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    threading.Thread(target=_dump_forever, args=(Path(out_dir),), daemon=True).start()


def _trace_rpcs() -> None:
    """Every call kvoffload's connector runs on its RPC thread, as `rpc.NAME`, and each turn
    of its keep-attached threads that finds the session up (`keeper`: the socket's stat, five
    times a second per client, each wake taking the GIL from whatever runs)."""
    from kvoffload_connector import client

    _wrap(client.PoolClient, "_socket_now", "keeper")

    submit = client.RpcThread.submit

    def traced_submit(self, fn):
        label = f"rpc.{getattr(fn, '__name__', '?')}"

        def run():
            t0 = time.perf_counter()
            try:
                return fn()
            finally:
                _record(label, t0)

        return submit(self, run)

    client.RpcThread.submit = traced_submit


ABLATIONS = {"nodma": ("dma",), "nogather": ("gather",), "nocopy": ("dma", "gather")}


def ablate(name: str) -> None:
    """Diagnostic only (serve_sweep's `+ablate=NAME`, random prompts, 0% hits): leave out part
    of every STORE's GPU work while keeping its host side (reservation, enqueue, events,
    commit), to tell which part of an eager store slows the engine. The blocks it commits hold
    garbage, so a run with hits would change tokens: never use it beyond that diagnostic.
    nodma: no copy from the staging ring to the pool; nogather: no gather kernel into the ring;
    nocopy: neither."""
    if not name:
        return
    if name not in ABLATIONS:
        raise ValueError(f"KVO_ABLATE={name!r}; known: {', '.join(ABLATIONS)}")
    from kvoffload_connector.transfer import cuda

    skip = ABLATIONS[name]
    if "dma" in skip:
        dma = cuda.CudaEngine._dma

        def no_store_dma(self, runs, base, buf, to_pool, stream, raw):
            if not to_pool:
                dma(self, runs, base, buf, to_pool, stream, raw)

        cuda.CudaEngine._dma = no_store_dma
    if "gather" in skip:
        kernel = cuda.CudaEngine._copy_kernel

        def no_gather(self, p, ids_ptr, buf, stream, to_staging, ctas):
            if not to_staging:
                kernel(self, p, ids_ptr, buf, stream, to_staging, ctas)

        cuda.CudaEngine._copy_kernel = no_gather
    print(
        f"engine_trace: ABLATION {name}: stores skip {', '.join(skip)} (garbage blocks)", flush=True
    )


if os.environ.get("KVO_ENGINE_TRACE_DIR"):  # imported by vLLM as the connector module
    if os.environ.get("KVO_TRACED_CONNECTOR") == "noop":  # the traced baseline
        from noop_connector import NoopConnector

        install(os.environ["KVO_ENGINE_TRACE_DIR"], NoopConnector)
    else:
        from kvoffload_connector.connector import KVOffloadConnector

        install(os.environ["KVO_ENGINE_TRACE_DIR"], KVOffloadConnector)


def prefill_timelines(events: list, min_tokens: int = 512, window_s: float = 0.08) -> dict:
    """Per prefill step (a `schedule` of >= min_tokens tokens): each later event's start and
    end offset (ms) from that schedule's start, by label and occurrence, within window_s."""
    events = sorted(events, key=lambda e: e[2])
    starts = [
        e[2]
        for e in events
        if e[0].startswith("schedule:")
        and e[0].split(":")[1].isdigit()
        and int(e[0].split(":")[1]) >= min_tokens
    ]
    offsets: dict[str, list[tuple[float, float]]] = {}
    for s in starts:
        seen: dict[str, int] = {}
        for label, _tid, t0, t1 in events:
            if t0 < s or t0 > s + window_s:
                continue
            name = label.split(":")[0] if label.startswith("schedule:") else label
            k = seen.get(name, 0)
            seen[name] = k + 1
            offsets.setdefault(f"{name}#{k}", []).append(((t0 - s) * 1e3, (t1 - s) * 1e3))
    return {"prefills": len(starts), "offsets": offsets}


def request_phases(
    events: list, requests: list[dict], min_tokens: int = 512
) -> list[dict[str, float | None] | None]:
    """Where each request's time to first token went, from the client's `sent` epoch and
    `ttft_s` and one engine's trace (its `clock` event maps perf_counter to the epoch):
    `to_schedule_ms` until the engine's first prefill step (>= min_tokens) starts scheduling after
    it was sent (HTTP, the API server, the hop to the engine, the engine loop's wake-up);
    `schedule_ms`; `execute_ms` (the step's `execute_model`) and `execute_gpu_ms` (its GPU span);
    `after_ms`, the rest (output, the hop back, the stream to the client; from the schedule's
    end where no `execute_model` was traced: vLLM's CPU build runs its worker in another
    process). `cpu`: the vCPU that launched the prefill; `beside`: how many records of other
    threads (RPCs, keep-attached turns) began while it was launched. None where a request has
    no `sent` time or no prefill step was traced after it. Why: the GPU VM's TTFT has two
    modes ~9 ms apart, and only the phase that moves between them says where they come from."""
    clock = next((e for e in events if e[0] == "clock"), None)
    if clock is None:
        return [None] * len(requests)
    epoch_minus_perf = clock[3] - clock[2]
    events = sorted(events, key=lambda e: e[2])
    starts = [e[2] for e in events]
    out: list[dict[str, float | None] | None] = []
    for req in requests:
        sent = req.get("sent")
        found: dict[str, float | None] | None = None
        if sent is not None:
            t_sent = sent - epoch_minus_perf
            sched = execute = gpu = None
            cpu = -1
            for i in range(bisect.bisect_left(starts, t_sent), len(events)):
                e = events[i]
                label = e[0]
                if sched is None:
                    tokens = label.split(":")[1] if label.startswith("schedule:") else ""
                    if tokens.isdigit() and int(tokens) >= min_tokens:
                        sched = e
                    continue
                if execute is None:
                    if label == "execute_model":
                        execute = e
                    elif e[2] > sched[3] + 1.0:
                        break  # no traced execute (vLLM's CPU build runs it in a worker)
                    continue
                if e[2] != execute[2]:
                    break  # the step's own records (its vCPU, its GPU span) share its start
                if label.startswith("execute_on:"):
                    cpu = int(label.split(":")[1])
                elif label == "execute_gpu":
                    gpu = e
            if sched is not None:
                step_end = (execute or sched)[3]
                # other threads' records that began while the prefill step was launched
                beside = (
                    sum(
                        1
                        for j in range(
                            bisect.bisect_left(starts, execute[2]),
                            bisect.bisect_right(starts, execute[3]),
                        )
                        if events[j][1] != execute[1]
                    )
                    if execute
                    else None
                )
                found = {
                    "to_schedule_ms": 1e3 * (sched[2] - t_sent),
                    "schedule_ms": 1e3 * (sched[3] - sched[2]),
                    "execute_ms": 1e3 * (execute[3] - execute[2]) if execute else None,
                    "execute_gpu_ms": 1e3 * (gpu[3] - gpu[2]) if gpu else None,
                    "after_ms": 1e3 * (req["ttft_s"] - (step_end - t_sent)),
                    "cpu": cpu,  # the vCPU the prefill was launched from (-1: not traced)
                    "beside": beside,  # other threads' records begun during execute_model
                }
        out.append(found)
    return out


def main(dirs: list[str]) -> int:
    for d in dirs:
        files = sorted(Path(d).glob("trace-*.jsonl"))
        if not files:
            print(f"== {d}: no trace-*.jsonl files")
        for f in files:
            tl = prefill_timelines(load_events(f))
            n = tl["prefills"]
            print(f"== {f} ({n} prefill steps)")
            rows = []
            for key, v in tl["offsets"].items():
                if len(v) < max(3, n // 2):
                    continue
                rows.append(
                    (
                        statistics.median(x[0] for x in v),
                        key,
                        statistics.median(x[1] - x[0] for x in v),
                        len(v),
                    )
                )
            for start, key, dur, cnt in sorted(rows)[:60]:
                print(f"  {start:8.3f} ms  +{dur:7.3f}  {key:40s} n={cnt}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
