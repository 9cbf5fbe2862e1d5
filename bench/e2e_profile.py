"""Where an engine step's time goes, for `bench/e2e_gpu.py --profile` (issue 6's "find out why").

Three views, each read as a delta over one measured phase:

- connector hooks: wall time and calls of every hook the active connector class defines itself
  (scheduler and worker side; base-class defaults are left alone, so vLLM's "does the connector
  override X" checks see the same functions as without profiling);
- engine steps: count and wall time of `EngineCore.step_fn` (in-process engine only);
- threads: CPU seconds per thread from /proc (Python thread names where known), which shows
  background work competing with the step thread for the GIL;
- garbage collection: collections and pause time per generation (`gc.callbacks`).
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
        """Time the engine step and its parts: schedule, execute, sample, update."""
        fn = getattr(core, "step_fn", None)
        if fn is None:
            return False
        core.step_fn = self.wrap("engine/step", fn)
        for owner, name in (
            (getattr(core, "scheduler", None), "schedule"),
            (getattr(core, "scheduler", None), "update_from_output"),
            (getattr(core, "model_executor", None), "execute_model"),
            (getattr(core, "model_executor", None), "sample_tokens"),
        ):
            part = getattr(owner, name, None)
            if part is not None:
                setattr(owner, name, self.wrap(f"engine/{name}", part))
        return True

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "seconds": dict(self.seconds),
                "calls": dict(self.calls),
                "threads": thread_cpu(),
                "t": time.perf_counter(),
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
        return {
            "wall_ms": round(1e3 * wall, 1),
            "steps": steps["calls"],
            "step_ms_mean": round(steps["ms"] / steps["calls"], 3) if steps["calls"] else None,
            "connector_ms_per_step": round(conn_ms / steps["calls"], 3) if steps["calls"] else None,
            "engine_and_gc_ms_per_step": per_step,
            "hooks": hooks,
            "thread_cpu_ms": dict(sorted(threads.items(), key=lambda kv: -kv[1])),
        }


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
