"""Per-thread wake-ups and CPU time of a process tree: which thread burns a core, which one
wakes on a timer.

    python bench/thread_cpu.py --match vllm_cli.py --match kvoffload --window 15 --for 400

Why: on the GPU VM a prefill runs ~45% slower whenever its vCPU shares a physical core with a
busy one (session 30), and kvoffload's servers fell in that slow mode a few points more often
than vLLM's alone. Anything kvoffload runs beside the engine thread (a thread that wakes on a
timer, a sidecar loop, a spinning copy) is a candidate; this counts it. Two snapshots of
`/proc/PID/task/TID/{stat,status,schedstat}` over a tree give each thread's context switches
(its wake-ups, near enough) and run time between them. `serve_paired.py` takes one of every
server (with its sidecar) at the start and the end of the measured rounds.

Thread names: the kernel's (`comm`), which Python threads on 3.11-3.13 leave at the process's;
`python_thread_names` maps tids to Python's own names with `py-spy dump` where it is installed.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")


@dataclass(frozen=True)
class ThreadSample:
    pid: int
    tid: int
    process: str  # the process's comm
    name: str  # the thread's comm
    switches: int  # voluntary + involuntary context switches so far
    run_ns: int  # time on a CPU so far
    cpu: int  # the vCPU it last ran on


def descendants(roots: list[int], proc_root: Path = PROC) -> list[int]:
    """`roots` and every process below them (the ones alive now), each once: one pass over
    /proc however many roots."""
    children: dict[int, list[int]] = {}
    for stat in proc_root.glob("[0-9]*/stat"):
        try:
            # pid (comm) state ppid ...: comm may hold spaces and parentheses
            ppid = int(stat.read_text().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    out, seen, todo = [], set(), list(roots)
    while todo:
        p = todo.pop()
        if p in seen:  # a root below another root
            continue
        seen.add(p)
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def _thread(pid: int, task: Path, process: str) -> ThreadSample | None:
    try:
        stat = (task / "stat").read_text()
        status = (task / "status").read_text()
        run_ns = int((task / "schedstat").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None  # the thread ended
    name = stat[stat.index("(") + 1 : stat.rindex(")")]
    fields = stat.rpartition(")")[2].split()  # fields[0] is field 3 (state)
    switches = sum(int(ln.split()[1]) for ln in status.splitlines() if "ctxt_switches:" in ln)
    return ThreadSample(pid, int(task.name), process, name, switches, run_ns, int(fields[36]))


def snapshot(root_pids: list[int], proc_root: Path = PROC) -> dict[int, ThreadSample]:
    """Every thread of the trees under `root_pids`, by tid."""
    out: dict[int, ThreadSample] = {}
    for pid in descendants(root_pids, proc_root):
        try:
            process = (proc_root / str(pid) / "comm").read_text().strip()
            tasks = list((proc_root / str(pid) / "task").iterdir())
        except OSError:
            continue
        for task in tasks:
            t = _thread(pid, task, process)
            if t is not None:
                out[t.tid] = t
    return out


def activity(
    before: dict[int, ThreadSample],
    after: dict[int, ThreadSample],
    seconds: float,
    names: dict[int, str] | None = None,
    top: int = 12,
    by: str = "wakes_per_s",
) -> dict:
    """Per-second wake-ups and CPU milliseconds between two snapshots: the tree's totals and
    its `top` threads by `by` (`wakes_per_s` or `cpu_ms_per_s`; threads born in between count
    from zero)."""
    if seconds <= 0:
        raise ValueError("seconds must be > 0")
    rows = []
    for tid, t in after.items():
        b = before.get(tid)
        wakes = (t.switches - (b.switches if b else 0)) / seconds
        cpu_ms = (t.run_ns - (b.run_ns if b else 0)) / seconds / 1e6
        rows.append({
            "pid": t.pid,
            "tid": tid,
            "process": t.process,
            "thread": (names or {}).get(tid, t.name),
            "wakes_per_s": round(wakes, 1),
            "cpu_ms_per_s": round(cpu_ms, 2),
            "last_cpu": t.cpu,
        })  # fmt: skip
    rows.sort(key=lambda r: -r[by])
    return {
        "seconds": round(seconds, 1),
        "threads_seen": len(rows),
        "processes": sorted({f"{t.process} ({t.pid})" for t in after.values()}),
        "wakes_per_s": round(sum(r["wakes_per_s"] for r in rows), 1),
        "cpu_ms_per_s": round(sum(r["cpu_ms_per_s"] for r in rows), 1),
        "top": rows[:top],
    }


_PY_SPY_THREAD = re.compile(r'^Thread (0x[0-9a-fA-F]+|\d+) \((?:active|idle)[^)]*\): "(.*)"')


def parse_py_spy_dump(text: str) -> dict[int, str]:
    """tid -> Python thread name from `py-spy dump` output (native tids are decimal)."""
    out = {}
    for line in text.splitlines():
        m = _PY_SPY_THREAD.match(line)
        if m and m.group(1).isdigit():
            out[int(m.group(1))] = m.group(2)
    return out


def python_thread_names(pids: list[int], py_spy: str | None = None) -> dict[int, str]:
    """Python's thread names of `pids` where py-spy is installed ({} where not)."""
    exe = py_spy or shutil.which("py-spy")
    if not exe:
        return {}
    out: dict[int, str] = {}
    for pid in pids:
        try:
            r = subprocess.run(
                [exe, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=20
            )
        except (OSError, subprocess.TimeoutExpired):
            continue
        out.update(parse_py_spy_dump(r.stdout))
    return out


def table(label: str, report: dict, rows: int = 8) -> str:
    """A short printout: the totals, then the busiest threads."""
    lines = [
        f"{label}: {report['wakes_per_s']:.0f} wakes/s, {report['cpu_ms_per_s']:.0f} CPU ms/s "
        f"over {report['threads_seen']} threads ({report['seconds']:.0f} s)"
    ]
    for r in report["top"][:rows]:
        lines.append(
            f"    {r['process'][:16]:<16} {r['thread'][:28]:<28} {r['wakes_per_s']:>8.1f}/s "
            f"{r['cpu_ms_per_s']:>8.2f} ms/s  cpu {r['last_cpu']}"
        )
    return "\n".join(lines)


def matching_roots(patterns: list[str], proc_root: Path = PROC) -> dict[int, str]:
    """Processes whose comm or command line holds one of `patterns` (this one excepted)."""
    out = {}
    for d in proc_root.glob("[0-9]*"):
        try:
            comm = (d / "comm").read_text().strip()
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        name = f"{comm}|{cmd[:60]}"
        if any(x in name for x in patterns) and int(d.name) != os.getpid():
            out[int(d.name)] = name
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--match", action="append", default=[])
    ap.add_argument("--window", type=float, default=15.0)
    ap.add_argument("--for", dest="total", type=float, default=300.0)
    ap.add_argument("--top", type=int, default=10)
    a = ap.parse_args()
    if not a.match:
        ap.error("--match: give at least one command-line pattern")
    if a.window <= 0 or a.total < a.window:
        ap.error(f"--window must be > 0 and --for at least one window, got {a.window}, {a.total}")
    t_end = time.monotonic() + a.total
    prev, t_prev = None, 0.0
    while time.monotonic() < t_end:
        now, t_now = snapshot(list(matching_roots(a.match))), time.monotonic()
        if prev is not None:
            seen = {tid: t for tid, t in now.items() if tid in prev}  # whole windows only
            rows = activity(prev, seen, t_now - t_prev, top=a.top, by="cpu_ms_per_s")["top"]
            print(f"-- {time.strftime('%H:%M:%S')} top threads (share of a core)", flush=True)
            for r in rows:
                print(
                    f"{r['cpu_ms_per_s'] / 1e3:6.1%} {r['pid']:7d} {r['tid']:7d} "
                    f"{r['thread']:16s} {r['wakes_per_s']:8.1f} wakes/s {r['process']}",
                    flush=True,
                )
        prev, t_prev = now, t_now
        time.sleep(a.window)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
