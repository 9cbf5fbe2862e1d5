"""The engine tests' pre-imported launcher (tests/vllm_zygote.py) starts programs as a fresh
interpreter would: arguments, working directory, environment, streams, exit status, a
timeout's kill, and it keeps what an interpreter fixes at start-up apart (hash seed, other
start-up variables) by serving only the environment it started with."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import vllm_zygote

pytestmark = [pytest.mark.process, pytest.mark.timeout(300)]


@pytest.fixture(autouse=True)
def no_zygotes_yet():
    """This process's zygotes closed first: earlier tests of this worker may hold the most
    it keeps (MAX_ZYGOTES), and then it would start plain processes."""
    vllm_zygote._close_all()
    yield


ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONHASHSEED="0")
PROBE = (
    "import os, sys; print(sys.argv[1:], os.getcwd(), os.getpid(), os.getppid(),"
    " os.environ.get('VLLM_PORT'), os.environ.get(sys.argv[1]), 'vllm' in sys.modules,"
    " hash('kvo')); sys.exit(int(sys.argv[2]))"
)


def _probe(tmp_path, env, *args: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    r = vllm_zygote.run(
        [sys.executable, "-c", PROBE, *args], env=env, cwd=tmp_path, capture_output=True,
        text=True, timeout=240,
    )  # fmt: skip
    return r, r.stdout.split()


def test_children_run_as_fresh_interpreters_of_their_own_environment(tmp_path):
    r, words = _probe(tmp_path, dict(ENV, VLLM_PORT="20000"), "HOME", "3")
    assert r.returncode == 3, r.stderr
    assert words[0:2] == ["['HOME',", "'3']"] and words[2] == str(tmp_path)
    assert int(words[3]) != os.getpid() and int(words[4]) != os.getpid()  # forked by a zygote
    assert words[5] == "20000" and words[6] == os.environ["HOME"] and words[7] == "True"
    zygotes = dict(vllm_zygote._zygotes)
    # a variable read when an engine is built differs: the same zygote serves it
    r2, words2 = _probe(tmp_path, dict(ENV, VLLM_PORT="20016"), "HOME", "0")
    assert r2.returncode == 0 and words2[5] == "20016" and words2[4] == words[4]
    assert vllm_zygote._zygotes == zygotes
    # the hash seed is fixed at start-up: another seed is another interpreter (zygote)
    r3, words3 = _probe(tmp_path, dict(ENV, PYTHONHASHSEED="1"), "HOME", "0")
    assert r3.returncode == 0 and words3[8] != words[8] and words3[4] != words[4]
    # no fixed seed: a plain process (each draws its own), not a zygote's child
    no_seed = {k: v for k, v in ENV.items() if k != "PYTHONHASHSEED"}
    r4, words4 = _probe(tmp_path, no_seed, "HOME", "0")
    assert r4.returncode == 0 and int(words4[4]) == os.getpid()


def test_a_timeout_kills_the_child_and_stdin_pipes_and_failures_come_through(tmp_path):
    with pytest.raises(subprocess.TimeoutExpired):
        vllm_zygote.run([sys.executable, "-c", "import time; time.sleep(60)"], env=ENV,
                        capture_output=True, timeout=1)  # fmt: skip
    out = tmp_path / "out.txt"
    with open(out, "w") as f:
        p = vllm_zygote.popen(
            [sys.executable, "-c", "import sys; print('got', sys.stdin.readline().strip())"],
            env=ENV, stdin=subprocess.PIPE, stdout=f, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    assert isinstance(p, vllm_zygote.Forked)
    p.stdin.write(b"go\n")
    p.stdin.close()
    assert p.wait(60) == 0 and out.read_text().strip() == "got go"
    r = vllm_zygote.run([sys.executable, "-c", "raise ValueError('boom')"], env=ENV,
                        capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 1 and "ValueError: boom" in r.stderr
    # a child asks its own zygote for the processes it starts (a drill's reference engine)
    nested = (
        "import os, sys; from tests import vllm_zygote as z; "
        "r = z.run([sys.executable, '-c', 'import os; print(os.getppid())'], "
        "capture_output=True, text=True, timeout=60); print(r.stdout.strip(), len(z._zygotes))"
    )
    r = vllm_zygote.run([sys.executable, "-c", nested], env=ENV, cwd=ROOT, capture_output=True,
                        text=True, timeout=120)  # fmt: skip
    parent, own = r.stdout.split()
    assert r.returncode == 0 and own == "0", r.stderr  # no zygote of its own
    assert int(parent) in {z.proc.pid for z in vllm_zygote._zygotes.values() if z.proc}
