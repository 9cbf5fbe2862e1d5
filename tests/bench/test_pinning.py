"""bench/pinning.py: each benchmark server on whole cores of its own, checked on real threads."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from pinning import core_groups, pin_tasks, tree_cpus  # noqa: E402

# 8 vCPUs on 4 hyperthreaded cores, siblings 4 apart (as many VMs number them)
SIBLINGS = {str(c): [(c + 4) % 8] for c in range(8)}


def test_servers_get_whole_cores_evenly_and_leftovers_stay_out() -> None:
    assert core_groups(set(range(8)), SIBLINGS, 2) == [{0, 1, 4, 5}, {2, 3, 6, 7}]
    assert core_groups(set(range(8)), SIBLINGS, 4) == [{0, 4}, {1, 5}, {2, 6}, {3, 7}]
    # 3 servers on 4 cores: one core each, the fourth left to the client
    assert core_groups(set(range(8)), SIBLINGS, 3) == [{0, 4}, {1, 5}, {2, 6}]
    # a sibling this process may not use is not handed out
    assert core_groups({0, 1, 2, 3, 4}, SIBLINGS, 2) == [{0, 4, 1}, {2, 3}]
    assert core_groups({0, 1}, {}, 2) == [{0}, {1}]  # no topology: each vCPU a core
    # a probed topology that is not transitive (4 slows 1, 10 and 12; 12 slows 7 and 10):
    # vCPU 10 names two vCPUs already in cores, and the groups stay disjoint
    probed = {"1": [4], "4": [1, 10, 12], "7": [12], "10": [4, 12], "12": [4, 7, 10]}
    groups = core_groups(set(range(16)), probed, 4)
    assert all(not (a & b) for i, a in enumerate(groups) for b in groups[i + 1 :])
    assert {1, 4} in [g & {1, 4} for g in groups] and {7, 12} in [g & {7, 12} for g in groups]
    with pytest.raises(ValueError, match="4 cores for 5 servers"):
        core_groups(set(range(8)), SIBLINGS, 5)


def test_every_thread_of_a_real_process_tree_is_pinned_and_read_back() -> None:
    allowed = sorted(os.sched_getaffinity(0))
    target = {allowed[-1]}
    # a parent with three threads and a child process, all started before the pinning
    code = (
        "import subprocess, sys, threading, time\n"
        "for _ in range(3): threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print('ready', flush=True); time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    children: list[int] = []
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        assert tree_cpus(proc.pid) == set(allowed)  # not pinned yet
        assert pin_tasks(proc.pid, target) == 4  # the main thread and three more
        # the child was forked before: it is still free, so the tree reads wider than target
        assert tree_cpus(proc.pid) == set(allowed)
        for task in (Path("/proc") / str(proc.pid) / "task").iterdir():
            assert os.sched_getaffinity(int(task.name)) == target
        children += [
            int(p.parent.name)
            for p in Path("/proc").glob("[0-9]*/stat")
            if p.read_text().rpartition(")")[2].split()[1] == str(proc.pid)
        ]
        assert len(children) == 1
        pin_tasks(children[0], target)
        assert tree_cpus(proc.pid) == target
    finally:
        for pid in children:
            os.kill(pid, signal.SIGKILL)
        proc.kill()
        proc.wait(10)
