"""Per-thread CPU of processes whose command line matches, and all their descendants, printed
every WINDOW seconds (a diagnostic beside a serving run: which thread burns a core).

    python bench/thread_cpu.py --match vllm_cli.py --match kvoffload --window 15 --for 400
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def _stat(path: Path) -> tuple[str, list[str]] | None:
    try:
        s = path.read_text()
    except OSError:
        return None
    return s[s.index("(") + 1 : s.rindex(")")], s[s.rindex(")") + 2 :].split()


def _tree(patterns: list[str]) -> dict[int, str]:
    parent, names = {}, {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        st = _stat(d / "stat")
        if st is None:
            continue
        parent[int(d.name)] = int(st[1][1])
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            cmd = ""
        names[int(d.name)] = f"{st[0]}|{cmd[:60]}"
    keep = {p for p, n in names.items() if any(x in n for x in patterns) and p != os.getpid()}
    changed = True
    while changed:
        changed = False
        for p, pp in parent.items():
            if pp in keep and p not in keep:
                keep.add(p)
                changed = True
    return {p: names[p] for p in keep}


def _threads(pid: int) -> dict[tuple[int, int, str], float]:
    out = {}
    for t in Path(f"/proc/{pid}/task").glob("*"):
        st = _stat(t / "stat")
        if st is not None:
            out[(pid, int(t.name), st[0])] = (int(st[1][11]) + int(st[1][12])) / TICK
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
    prev: dict = {}
    while time.monotonic() < t_end:
        procs = _tree(a.match)
        now = {}
        for pid in procs:
            now.update(_threads(pid))
        rows = sorted(((v - prev[k]) / a.window, k) for k, v in now.items() if k in prev)
        if rows:
            print(f"-- {time.strftime('%H:%M:%S')} top threads (share of a core)", flush=True)
            for share, (pid, tid, comm) in rows[::-1][: a.top]:
                print(f"{share:6.1%} {pid:7d} {tid:7d} {comm:16s} {procs.get(pid, '')}", flush=True)
        prev = now
        time.sleep(a.window)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
