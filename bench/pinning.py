"""Give each benchmark server its own whole cores (serve_paired/serve_sweep `--pin-cpus`).

Why: on the GPU VM a prefill's host work runs ~45% slower on some vCPUs than on others, and
the engine thread of each `vllm serve` lands wherever Linux puts it (session 29). Unpinned,
two configurations compare their vCPU luck as much as their code. Pinned, each server (its
`vllm serve` processes and its sidecar, as one pod would be) has cores no other server runs
on, the way Kubernetes' static CPU manager gives a Guaranteed pod exclusive cores.
"""

from __future__ import annotations

import os
from pathlib import Path

from cpu_sampler import parse_cpu_list, read_siblings
from thread_cpu import descendants


def core_groups(allowed: set[int], siblings: dict[str, list[int]], n: int) -> list[set[int]]:
    """`allowed` vCPUs as `n` sets of whole cores (a vCPU with its hyperthread siblings), as
    even as the cores allow, in vCPU order; leftover cores are left out. ValueError when there
    are fewer cores than sets."""
    cores: list[tuple[int, ...]] = []
    seen: set[int] = set()
    for cpu in sorted(allowed):
        if cpu in seen:
            continue
        # a measured topology (sibling_probe.py) need not be transitive: a vCPU joins the
        # first core that names it, so no two groups share one
        mates = (c for c in siblings.get(str(cpu), []) if c in allowed and c not in seen)
        core = tuple(sorted({cpu, *mates}))
        seen.update(core)
        cores.append(core)
    if n < 1 or len(cores) < n:
        raise ValueError(f"--pin-cpus: {len(cores)} cores for {n} servers")
    per = len(cores) // n
    return [{c for core in cores[i * per : (i + 1) * per] for c in core} for i in range(n)]


def server_cpu_groups(n: int, siblings: dict[str, list[int]] | None = None) -> list[set[int]]:
    """This machine's groups for `n` servers, from this process's allowed vCPUs; hyperthread
    siblings from sysfs unless given (sibling_probe.py finds those a VM hides)."""
    known = read_siblings() if siblings is None else siblings
    return core_groups(os.sched_getaffinity(0), known, n)


def pin_tasks(pid: int, cpus: set[int], proc_root: Path = Path("/proc")) -> int:
    """Every thread of `pid` onto `cpus` (threads made later inherit it); how many were
    pinned. A thread that ends meanwhile is skipped."""
    pinned = 0
    for task in (proc_root / str(pid) / "task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cpus)
            pinned += 1
        except ProcessLookupError:
            continue
    return pinned


def tree_cpus(pid: int, proc_root: Path = Path("/proc")) -> set[int]:
    """The vCPUs any thread of `pid` or of its descendants may run on (what pinning gave
    them, read back for the report)."""
    cpus: set[int] = set()
    for p in descendants([pid], proc_root):
        for status in (proc_root / str(p) / "task").glob("*/status"):
            try:
                text = status.read_text()
            except OSError:
                continue  # the thread ended
            for line in text.splitlines():
                if line.startswith("Cpus_allowed_list:"):
                    cpus.update(parse_cpu_list(line.split(":", 1)[1]))
    return cpus
