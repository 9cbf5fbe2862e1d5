"""Where an engine step's time goes, for `bench/e2e_gpu.py --profile` (issue 6's "find out why").

Three views, each read as a delta over one measured phase:

- connector hooks: wall time and calls of every hook the active connector class defines itself
  (scheduler and worker side; base-class defaults are left alone, so vLLM's "does the connector
  override X" checks see the same functions as without profiling);
- engine steps: count and wall time of `EngineCore.step_fn` (in-process engine only);
- threads: CPU seconds per thread from /proc (Python thread names where known), which shows
  background work competing with the step thread for the GIL;
- garbage collection: collections and pause time per generation (`gc.callbacks`);
- steps, one row each: what the scheduler planned (requests, tokens, new requests and the
  context they bring, the connector's loads and stores where its metadata says) beside the
  step's host wall time and its GPU time (CUDA events on the step thread's stream, read at the
  phase's end), so a slow phase shows whether its steps were longer at the same batch or
  different batches.
"""

from __future__ import annotations

import functools
import gc
import os
import threading
import time
from collections import defaultdict
from typing import Any

from connector_overhead import SCHED_HOOKS, WORKER_HOOKS  # bench/ is on sys.path

# every hook vLLM calls on the step path (the same list the CPU overhead bench times)
HOOKS = tuple(dict.fromkeys((*SCHED_HOOKS, *WORKER_HOOKS)))


class StepProfile:
    """Accumulates hook and step timings; `snapshot()`/`since()` give per-phase deltas."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._lock = threading.Lock()
        self._gc_start = 0.0
        gc.callbacks.append(self._on_gc)
        self.steps: list[dict[str, Any]] = []
        self._planned: dict[str, Any] | None = None

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            self.add(f"gc/gen{info.get('generation', '?')}", time.perf_counter() - self._gc_start)

    def add(self, name: str, seconds: float) -> None:
        with self._lock:
            self.seconds[name] += seconds
            self.calls[name] += 1

    def wrap(self, name: str, fn: Any) -> Any:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(name, time.perf_counter() - t0)

        return timed

    def patch_connector(self, cls: type) -> list[str]:
        """Wrap the hooks `cls` defines in its own class body (not inherited defaults)."""
        patched = []
        for name in HOOKS:
            fn = cls.__dict__.get(name)
            if callable(fn):
                setattr(cls, name, self.wrap(f"hook/{name}", fn))
                patched.append(name)
        return patched

    def patch_engine(self, core: Any) -> bool:
        """Time the engine step and its parts: schedule, execute, sample, update; and keep one
        row per step (see the module docstring)."""
        fn = getattr(core, "step_fn", None)
        if fn is None:
            return False
        core.step_fn = self._traced_step(self.wrap("engine/step", fn))
        sched = getattr(core, "scheduler", None)
        for owner, name in (
            (sched, "schedule"),
            (sched, "update_from_output"),
            (getattr(core, "model_executor", None), "execute_model"),
            (getattr(core, "model_executor", None), "sample_tokens"),
        ):
            part = getattr(owner, name, None)
            if part is not None:
                setattr(owner, name, self.wrap(f"engine/{name}", part))
        if sched is not None and hasattr(sched, "schedule"):
            timed = sched.schedule

            def schedule(*args: Any, **kwargs: Any) -> Any:
                out = timed(*args, **kwargs)
                self._planned = plan_row(out, sched)
                return out

            sched.schedule = schedule
        return True

    def _traced_step(self, fn: Any) -> Any:
        try:
            import torch

            cuda = torch.cuda if torch.cuda.is_available() else None
        except ImportError:
            cuda = None

        @functools.wraps(fn)
        def step(*args: Any, **kwargs: Any) -> Any:
            self._planned = None
            ev = None
            if cuda is not None:
                ev = (cuda.Event(enable_timing=True), cuda.Event(enable_timing=True))
                ev[0].record()
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                if ev is not None:
                    ev[1].record()
                with self._lock:
                    self.steps.append({"host_ms": 1e3 * dt, "ev": ev, **(self._planned or {})})

        return step

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "seconds": dict(self.seconds),
                "calls": dict(self.calls),
                "threads": thread_cpu(),
                "t": time.perf_counter(),
                "steps": len(self.steps),
                "_rows": self.steps,  # read by since(); rows are only appended
            }

    @staticmethod
    def since(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
        """Per-phase view: ms and calls per hook, engine steps, CPU ms per thread."""
        wall = after["t"] - before["t"]
        hooks = {}
        for name, s in after["seconds"].items():
            calls = after["calls"][name] - before["calls"].get(name, 0)
            if calls:
                ms = 1e3 * (s - before["seconds"].get(name, 0.0))
                hooks[name] = {"calls": calls, "ms": round(ms, 2)}
        threads = {}
        for name, cpu in after["threads"].items():
            delta = cpu - before["threads"].get(name, 0.0)
            if delta > 0.0005:
                threads[name] = round(1e3 * delta, 1)
        steps = hooks.get("engine/step", {"calls": 0, "ms": 0.0})
        conn_ms = sum(v["ms"] for k, v in hooks.items() if k.startswith("hook/"))
        per_step = {
            k.split("/", 1)[1]: round(v["ms"] / steps["calls"], 3)
            for k, v in hooks.items()
            if steps["calls"] and (k.startswith("engine/") or k.startswith("gc/"))
        }
        rows = step_rows(after.get("_rows", []), before.get("steps", 0), after.get("steps", 0))
        return {
            "wall_ms": round(1e3 * wall, 1),
            "steps": steps["calls"],
            "step_ms_mean": round(steps["ms"] / steps["calls"], 3) if steps["calls"] else None,
            "connector_ms_per_step": round(conn_ms / steps["calls"], 3) if steps["calls"] else None,
            "engine_and_gc_ms_per_step": per_step,
            "hooks": hooks,
            "thread_cpu_ms": dict(sorted(threads.items(), key=lambda kv: -kv[1])),
            "step_kinds": step_kinds(rows),
            "step_rows": rows,
        }


STEP_FIELDS = (
    "host_ms", "gpu_ms", "reqs", "tokens", "longest", "new", "new_ctx", "resumed", "waiting",
    "load_jobs", "layered_jobs", "load_blocks", "store_blocks",
)  # fmt: skip


def plan_row(out: Any, sched: Any) -> dict[str, Any]:
    """What one SchedulerOutput planned (vLLM 0.26-0.33 field names; missing ones read 0)."""
    nst = getattr(out, "num_scheduled_tokens", None) or {}
    new = getattr(out, "scheduled_new_reqs", None) or []
    cached = getattr(out, "scheduled_cached_reqs", None)
    resumed = getattr(cached, "resumed_from_preemption", None)
    if resumed is None:
        resumed = getattr(cached, "resumed_req_ids", None) or ()
    meta = getattr(out, "kv_connector_metadata", None)
    loads = getattr(meta, "loads", None) or ()
    stores = getattr(meta, "stores", None) or ()
    return {
        "reqs": len(nst),
        "tokens": int(getattr(out, "total_num_scheduled_tokens", 0) or 0),
        "longest": max(nst.values(), default=0),
        "new": len(new),
        "new_ctx": sum(int(getattr(r, "num_computed_tokens", 0) or 0) for r in new),
        "resumed": sum(1 for r in resumed if r is not False),
        "waiting": len(getattr(sched, "waiting", ()) or ()),
        "load_jobs": len(loads),
        "layered_jobs": sum(1 for j in loads if getattr(j, "layered", False)),
        "load_blocks": sum(len(t.gpu_blocks) for j in loads for t in j.transfers),
        "store_blocks": sum(len(t.gpu_blocks) for j in stores for t in j.transfers),
    }


def step_rows(steps: list[dict[str, Any]], first: int, last: int) -> list[list[float]]:
    """Rows ``first..last-1`` as lists in STEP_FIELDS order; waits for their end events."""
    rows = []
    for st in steps[first:last]:
        ev = st.get("ev")
        gpu = None
        if ev is not None:
            ev[1].synchronize()
            gpu = ev[0].elapsed_time(ev[1])
        row = {**st, "gpu_ms": gpu}
        rows.append(
            [
                round(row[f], 3) if isinstance(row.get(f), float) else row.get(f, 0)
                for f in STEP_FIELDS
            ]
        )
    return rows


def step_kinds(rows: list[list[float]]) -> dict[str, dict[str, float]]:
    """Steps split into decode-only (every request schedules one token) and the rest: count,
    mean host/GPU ms, mean requests and tokens, loads."""
    ix = {f: i for i, f in enumerate(STEP_FIELDS)}
    out: dict[str, dict[str, float]] = {}
    for kind, pick in (
        ("decode", lambda r: r[ix["longest"]] <= 1),
        ("mixed", lambda r: r[ix["longest"]] > 1),
    ):
        sel = [r for r in rows if pick(r) and r[ix["reqs"]]]
        if not sel:
            continue
        mean = {
            f: round(sum(r[ix[f]] or 0 for r in sel) / len(sel), 2)
            for f in ("host_ms", "gpu_ms", "reqs", "tokens", "new", "load_blocks", "store_blocks")
        }
        out[kind] = {
            "steps": len(sel),
            **mean,
            "host_ms_sum": round(sum(r[ix["host_ms"]] for r in sel), 1),
        }
    return out


def thread_cpu() -> dict[str, float]:
    """CPU seconds (user + system) per thread of this process, keyed by thread name (Python's
    where the native id is known, else the kernel's comm) plus the native id."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        cpu = (int(fields[11]) + int(fields[12])) / tick  # utime, stime (fields 14, 15)
        label = names.get(int(tid), comm)
        out[f"{label}[{tid}]"] = cpu
    return out
