"""Realistic vLLM pods through `kvoffload inject` and the pod harness.

- every fixture's decision (the real CLI, as a subprocess) matches its `# expect:` line, and a
  skipped pod is unchanged apart from the skip annotation;
- every injected server pod serves with pool hits in round 2 and the tokens of the same pod
  without kvoffload (baselines cached per translated engine argv: most fixtures share one);
- pod-level faults on one injected fixture end with the engine serving and identical tokens;
- node placement: two pods of the restricted fixture injected with a `placement: node` policy,
  of two uids, share one real node agent (the harness publishes their CSI volume as the
  kubelet does): the second pod's first requests hit what the first stored, same tokens.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pod_harness as harness
import pod_translate as translate
import pytest
import yaml

from tests.operator.pss import restricted_violations

HERE = Path(__file__).resolve().parent
MANIFESTS = sorted((HERE / "manifests").glob("*.yaml"))
POLICY = HERE / "policy.yaml"
NODE_POLICY = HERE / "policy-node.yaml"  # placement node: tenant pod-tests of node pool pod-tests
KVOFFLOAD = harness.images.VENV / "bin" / "kvoffload"
SKIP_ANNOTATION = "kvoffload.io/skip-reason"
FAULT_FIXTURE = HERE / "manifests" / "args-only-vllm-openai.yaml"
MAX_TOKENS = 8
PROMPT_LEN = 900  # > one chunk (4 blocks of 128 at CPU defaults) so every prompt stores one


def prompts(seed: int, n: int = 2) -> list[list[int]]:
    x = seed * 7919 + 17
    out = []
    for _ in range(n):
        toks = []
        for _ in range(PROMPT_LEN):
            x = (x * 1103515245 + 12345) % (1 << 31)
            toks.append(3 + x % 500)
        out.append(toks)
    return out


PROMPT_SETS = {name: prompts(i) for i, name in enumerate(
    ("round", "missing", "mid_store", "mid_load", "restarted", "socket", "truncated",
     "adopted"))}  # fmt: skip
# traffic while the sidecar dies: enough new prompts that the kill lands among their stores
PROMPT_SETS["adopt_load"] = prompts(len(PROMPT_SETS), 16)


def expectation(path: Path) -> tuple[str, str | None]:
    for line in path.read_text().splitlines():
        if line.startswith("# expect:"):
            words = line.split(":", 1)[1].split()
            return words[0], (words[1] if len(words) > 1 else None)
    raise AssertionError(f"{path.name} has no '# expect:' line")


def inject(path: Path, policy: Path = POLICY) -> list[dict[str, Any]]:
    r = subprocess.run(
        [str(KVOFFLOAD), "inject", "-f", str(path), "--policy", str(policy)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, f"kvoffload inject {path.name}: rc {r.returncode}\n{r.stderr}"
    return [d for d in yaml.safe_load_all(r.stdout) if d]


def load(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def is_server(doc: dict[str, Any]) -> bool:
    _, spec = harness.pod_spec(doc)
    c = next(c for c in spec["containers"] if harness.Pod._image_kind(c) == "vllm")
    try:
        translate.translate(c)
    except ValueError:
        return False
    return True


INJECTED = [p for p in MANIFESTS if expectation(p)[0] == "inject"]
# the fault tests' fixture last: its pod, started by its own pool-hit test, serves them next
SERVERS = sorted((p for p in INJECTED if is_server(load(p))), key=lambda p: p == FAULT_FIXTURE)


# -- decisions (fast) ---------------------------------------------------------------------------
@pytest.mark.pod
@pytest.mark.process
def test_at_least_15_fixtures_with_sources() -> None:
    assert len(MANIFESTS) >= 15
    for p in MANIFESTS:
        head = p.read_text().split("\napiVersion", 1)[0]
        assert "# source: " in head and "http" in head, f"{p.name}: no source URL"


@pytest.mark.pod
@pytest.mark.process
@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.stem)
def test_decision(path: Path) -> None:
    verdict, reason = expectation(path)
    (out,) = inject(path)
    original = load(path)
    meta, _ = harness.pod_spec(out)
    annotations = meta.get("annotations") or {}
    if verdict == "inject":
        assert (meta.get("labels") or {}).get("kvoffload.io/injected") == "true", annotations
        assert SKIP_ANNOTATION not in annotations
        return
    assert annotations.get(SKIP_ANNOTATION) == reason, annotations
    assert _without_skip_annotation(out) == original, "a skipped pod changed"


def _without_skip_annotation(node: Any) -> Any:
    """`node` without any `kvoffload.io/skip-reason` annotation (and annotations left empty)."""
    if isinstance(node, list):
        return [_without_skip_annotation(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for k, v in node.items():
        if k == "annotations" and isinstance(v, dict) and SKIP_ANNOTATION in v:
            v = {a: b for a, b in v.items() if a != SKIP_ANNOTATION}
            if not v:
                continue
        v = _without_skip_annotation(v)
        if k == "metadata" and v == {}:
            continue  # created only to hold the skip annotation
        out[k] = v
    return out


# -- running pods -------------------------------------------------------------------------------
_NOT_RUNNABLE = harness.can_run_pods()
needs_pods = pytest.mark.skipif(_NOT_RUNNABLE is not None, reason=str(_NOT_RUNNABLE))
_BASELINES: dict[tuple[str, ...], dict[str, list[list[int]]]] = {}


# Flags that change no token of a greedy completion: the name the model is served under, and
# vLLM's own defaults spelled out (prefix caching, chunked prefill; the tiny model runs no
# remote code). Pods that differ only in these share one baseline.
_SAME_TOKENS = {"--served-model-name": 1, "--enable-prefix-caching": 0}
_SAME_TOKENS |= {"--enable-chunked-prefill": 0, "--trust-remote-code": 0}


def engine_key(doc: dict[str, Any]) -> tuple[str, ...]:
    """The translated engine flags without kvoffload's (entry form and TP 1 normalised) and
    without those that change no token (`_SAME_TOKENS`)."""
    _, spec = harness.pod_spec(doc)
    c = next(c for c in spec["containers"] if harness.Pod._image_kind(c) == "vllm")
    words = translate.without_kvoffload(translate.translate(c))
    if words[0].rsplit("/", 1)[-1] in translate.SHELLS:
        words = translate.shlex.split(words[-1])
    start = translate._engine_start(words) or 0
    flags = [w for w in words[start:] if w not in ("--model", str(translate.TINY_MODEL))]
    text = " ".join(flags).replace("--tensor-parallel-size 1", "")
    key, words = [], text.split()
    while words:
        flag, value = words.pop(0).partition("=")[::2]
        if flag in _SAME_TOKENS:
            if _SAME_TOKENS[flag] and not value:
                words.pop(0)
            continue
        key.append(f"{flag}={value}" if value else flag)
    return tuple(key)


def baseline(path: Path, workdir: Path) -> dict[str, list[list[int]]]:
    """Tokens of every prompt set from the pod WITHOUT kvoffload (cached per engine argv)."""
    doc = load(path)
    key = engine_key(doc)
    if key not in _BASELINES:
        uid = harness.harness_uid(path.read_text())
        with harness.running(doc, workdir / "baseline", uid_override=uid) as (pod, _):
            _BASELINES[key] = {n: pod.complete(p, MAX_TOKENS) for n, p in PROMPT_SETS.items()}
    return _BASELINES[key]


def settle(pod: harness.Pod, socket: str, at_least: int, max_s: float = 30) -> dict[str, Any]:
    """Stats once `at_least` slots are committed and none is reserved (stores are async)."""
    end = time.monotonic() + max_s
    stats: dict[str, Any] | None = None
    while time.monotonic() < end:
        stats = pod.pool_stats(socket)
        nss = (stats or {}).get("namespaces", [])
        if sum(n["committed_slots"] for n in nss) >= at_least and not any(
            n["reserved_slots"] for n in nss
        ):
            break
        time.sleep(0.2)
    return stats or {}


def workdir_for(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    d = tmp_path_factory.mktemp(name)
    (d / "baseline").mkdir()
    return d


@pytest.mark.pod
@pytest.mark.process
@pytest.mark.vllm
@pytest.mark.slow
@needs_pods
@pytest.mark.parametrize("path", SERVERS, ids=lambda p: p.stem)
def test_injected_pod_serves_with_pool_hits(
    path: Path, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> None:
    if path == FAULT_FIXTURE:  # the fault tests' pod, as injected and not yet faulted
        pod, (engine, want) = request.getfixturevalue("fault_pod")
        _serves_with_pool_hits(pod, engine, want["round"])
        return
    wd = workdir_for(tmp_path_factory, path.stem)
    want = baseline(path, wd)["round"]
    (doc,) = inject(path)
    uid = harness.harness_uid(path.read_text())
    with harness.running(doc, wd, uid_override=uid) as (pod, engine):
        _serves_with_pool_hits(pod, engine, want)


def _serves_with_pool_hits(pod: harness.Pod, engine: Any, want: list[list[int]]) -> None:
    socket = harness.socket_of(pod.sidecar())
    first = pod.complete(PROMPT_SETS["round"], MAX_TOKENS)
    settle(pod, socket, at_least=len(PROMPT_SETS["round"]))
    before = harness.pool_hits(pod.pool_stats(socket))
    pod.reset_prefix_cache()
    second = pod.complete(PROMPT_SETS["round"], MAX_TOKENS)
    hits = harness.pool_hits(pod.pool_stats(socket)) - before
    assert first == want and second == want, "tokens differ from the pod without kvoffload"
    assert hits > 0, f"no pool hits in round 2:\n{engine.text()[-3000:]}"
    assert engine.alive()
    cg = pod.memory_cgroup_of(pod.sidecar()["name"])
    if cg is not None:  # the injected limit holds the pre-faulted pool, with room to spare
        pool_bytes = int((pod.pool_stats(socket) or {}).get("pool_bytes", 0))
        charged = int((cg / "memory.usage_in_bytes").read_text())
        assert 0 < pool_bytes <= charged  # the pool's pages are the sidecar's, as a kubelet's
        assert int((cg / "memory.failcnt").read_text()) == 0


# -- faults at pod level --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fault_pod(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[harness.Pod, Any]]:
    if _NOT_RUNNABLE:
        pytest.skip(_NOT_RUNNABLE)
    wd = workdir_for(tmp_path_factory, "faults")
    want = baseline(FAULT_FIXTURE, wd)
    (doc,) = inject(FAULT_FIXTURE)
    with harness.running(doc, wd) as (pod, engine):
        pod.restart_always(pod.sidecar()["name"])
        yield pod, (engine, want)


def _during(pod: harness.Pod, name: str, action: Any, delay: float) -> list[list[int]]:
    """Complete prompt set `name` while `action()` runs `delay` seconds into the request."""
    result: dict[str, Any] = {}

    def go() -> None:
        result["tokens"] = pod.complete(PROMPT_SETS[name], MAX_TOKENS)

    t = threading.Thread(target=go)
    t.start()
    time.sleep(delay)
    action()
    t.join(timeout=180)
    assert not t.is_alive(), "request wedged after the fault"
    return result["tokens"]


def _wait_sidecar_back(pod: harness.Pod, restarts: int, max_s: float = 30) -> None:
    """Until the restarted sidecar answers Stats on its socket. Not its startupProbe: `kvoffload
    probe` passes once its deadline from the pod's first probe is over, whatever the sidecar's
    state (so that vLLM never waits longer), and a restarted sidecar still importing on a busy
    machine is not serving yet."""
    sidecar = pod.sidecar()
    socket = harness.socket_of(sidecar)
    end = time.monotonic() + max_s
    while time.monotonic() < end:
        p = pod.procs[sidecar["name"]]
        if p.restarts >= restarts and p.alive() and pod.pool_stats(socket) is not None:
            return
        time.sleep(0.3)
    raise AssertionError(f"sidecar not back:\n{pod.procs[sidecar['name']].text()[-3000:]}")


FAULTS = [pytest.mark.pod, pytest.mark.process, pytest.mark.vllm, pytest.mark.slow, needs_pods]


def _mark(f: Any) -> Any:
    for m in FAULTS:
        f = m(f)
    return f


def _sidecar_of(doc: dict[str, Any]) -> dict[str, Any]:
    _, spec = harness.pod_spec(doc)
    return next(c for c in spec["initContainers"] if c.get("restartPolicy") == "Always")


@_mark
def test_fault_sidecar_that_never_serves_holds_vllm_only_until_the_probe_deadline(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """A hung sidecar (here one that never opens its socket) gates vLLM only until its startup
    probe's deadline (`spec.sidecar.startupTimeoutSeconds`, 5 s by default); then vLLM starts
    and serves the same tokens without the pool. (The connector meets what it meets when the
    sidecar never started: no socket at its path.)"""
    wd = workdir_for(tmp_path_factory, "hung")
    want = baseline(FAULT_FIXTURE, wd)["missing"]
    (doc,) = inject(FAULT_FIXTURE)
    sidecar = _sidecar_of(doc)
    probe = sidecar["startupProbe"]["exec"]["command"]
    deadline = float(probe[probe.index("--deadline") + 1])
    sidecar["command"], sidecar["args"] = ["sleep", "infinity"], []
    with harness.Pod(doc, wd) as pod:
        began = time.monotonic()
        engine = pod.start()  # init containers, the gated sidecar, then vLLM
        held = time.monotonic() - began
        pod.wait_serving(engine)
        assert deadline - 1 <= held <= deadline + 6, f"vLLM held {held:.1f}s, deadline {deadline}"
        assert pod.complete(PROMPT_SETS["missing"], MAX_TOKENS) == want
        pod.reset_prefix_cache()
        assert pod.complete(PROMPT_SETS["missing"], MAX_TOKENS) == want
        assert engine.alive()


@_mark
def test_fault_sidecar_without_a_pool_serves_degraded_and_vllm_serves(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """A sidecar that cannot build its pool (a NUMA node the machine lacks) starts degraded:
    vLLM is not held back, serves the same tokens, and the reason is in `kvoffload stats`."""
    wd = workdir_for(tmp_path_factory, "degraded")
    want = baseline(FAULT_FIXTURE, wd)["missing"]
    (doc,) = inject(FAULT_FIXTURE)
    sidecar = _sidecar_of(doc)
    sidecar["args"] = [*sidecar["args"], "--numa-node=999"]
    with harness.running(doc, wd) as (pod, engine):
        for _ in range(2):
            assert pod.complete(PROMPT_SETS["missing"], MAX_TOKENS) == want
            pod.reset_prefix_cache()
        stats = pod.pool_stats(harness.socket_of(sidecar)) or {}
        assert "node 999" in stats.get("degraded_reason", ""), stats
        log = pod.procs[sidecar["name"]].text()
        assert log.count("kvoffload sidecar: degraded, serving without a pool: ") == 1, log
        assert engine.alive()


@_mark
def test_fault_sidecar_memory_limit_below_its_pool_serves_degraded_not_oom_killed(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Out of memory: a sidecar whose container limit (here lowered by hand below the 256 MiB
    pool, as a policy's `spec.sidecar.resources` could) cannot hold its pool. Under the
    kubelet's memory cgroup the pre-fault would be OOM-killed, and again after each restart;
    the sidecar measures its cgroup first and serves degraded instead, vLLM serves the same
    tokens, and `kvoffload stats` says why. And the injected limit itself holds the pool: the
    other pod tests run their sidecars under it."""
    wd = workdir_for(tmp_path_factory, "oom")
    want = baseline(FAULT_FIXTURE, wd)["missing"]
    (doc,) = inject(FAULT_FIXTURE)
    sidecar = _sidecar_of(doc)
    sidecar["resources"]["limits"]["memory"] = sidecar["resources"]["requests"]["memory"] = "160Mi"
    with harness.running(doc, wd) as (pod, engine):
        cg = pod.memory_cgroup_of(sidecar["name"])
        if cg is None:
            pytest.skip("no memory cgroup to enforce the limit with on this box")
        for _ in range(2):
            assert pod.complete(PROMPT_SETS["missing"], MAX_TOKENS) == want
            pod.reset_prefix_cache()
        stats = pod.pool_stats(harness.socket_of(sidecar)) or {}
        reason = stats.get("degraded_reason", "")
        assert "does not fit the sidecar container's memory limit" in reason, stats
        proc = pod.procs[sidecar["name"]]
        assert proc.alive() and proc.restarts == 0, proc.text()[-2000:]
        assert int((cg / "memory.failcnt").read_text()) == 0  # never reached the limit
        assert engine.alive()


@_mark
def test_fault_sidecar_killed_mid_store(fault_pod: Any) -> None:
    pod, (engine, want) = fault_pod
    name = pod.sidecar()["name"]
    got = _during(pod, "mid_store", lambda: pod.kill(name), delay=0.5)
    assert got == want["mid_store"]
    _wait_sidecar_back(pod, restarts=1)
    assert pod.complete(PROMPT_SETS["mid_store"], MAX_TOKENS) == want["mid_store"]
    assert engine.alive()


@_mark
def test_fault_sidecar_killed_mid_load(fault_pod: Any) -> None:
    pod, (engine, want) = fault_pod
    name = pod.sidecar()["name"]
    socket = harness.socket_of(pod.sidecar())
    restarts = pod.procs[name].restarts
    assert pod.complete(PROMPT_SETS["mid_load"], MAX_TOKENS) == want["mid_load"]
    settle(pod, socket, at_least=2)
    pod.reset_prefix_cache()
    got = _during(pod, "mid_load", lambda: pod.kill(name), delay=0.2)
    assert got == want["mid_load"]
    _wait_sidecar_back(pod, restarts=restarts + 1)
    assert engine.alive()


@_mark
def test_fault_sidecar_restarted_serves_again(fault_pod: Any) -> None:
    """After the kubelet restarted the sidecar, the engine uses the fresh pool again."""
    pod, (engine, want) = fault_pod
    socket = harness.socket_of(pod.sidecar())
    _wait_sidecar_back(pod, restarts=1)
    hits = 0
    for _ in range(5):  # the connector re-registers on its own schedule
        assert pod.complete(PROMPT_SETS["restarted"], MAX_TOKENS) == want["restarted"]
        settle(pod, socket, at_least=2, max_s=10)
        before = harness.pool_hits(pod.pool_stats(socket))
        pod.reset_prefix_cache()
        assert pod.complete(PROMPT_SETS["restarted"], MAX_TOKENS) == want["restarted"]
        hits = harness.pool_hits(pod.pool_stats(socket)) - before
        if hits > 0:
            break
        time.sleep(2)
    assert hits > 0, f"no pool hits after the restart:\n{engine.text()[-3000:]}"


@_mark
def test_fault_socket_replaced_by_plain_file(fault_pod: Any) -> None:
    pod, (engine, want) = fault_pod
    socket = harness.socket_of(pod.sidecar())
    name = pod.sidecar()["name"]
    restarts = pod.procs[name].restarts
    pod.ns(["sh", "-c", f"rm -f {socket} && echo not-a-socket > {socket} && chmod 666 {socket}"])
    pod.kill(name)  # the engine must reconnect to a path that is now a plain file
    for _ in range(2):
        assert pod.complete(PROMPT_SETS["socket"], MAX_TOKENS) == want["socket"]
        pod.reset_prefix_cache()
    _wait_sidecar_back(pod, restarts=restarts + 1)
    assert pod.complete(PROMPT_SETS["socket"], MAX_TOKENS) == want["socket"]
    assert engine.alive()
    # the restarted sidecar took its socket path back (the run dir is its own) and has a pool
    stats = pod.pool_stats(socket) or {}
    log = pod.procs[name].text()[-3000:]
    assert stats.get("pool_bytes") and not stats.get("degraded_reason"), (
        f"{stats} {pod.last_stats_error}\n{log}"
    )


@_mark
def test_fault_pool_file_truncated(fault_pod: Any) -> None:
    """`truncate -s 0` on the pool file under a live sidecar and engine (both mmap it).

    Whoever notices first says why, once. The next pool hit finds the file short: the worker
    fails that load (vLLM recomputes, same tokens) instead of touching the mapping (SIGBUS would
    kill the engine), says why once, and serves without the pool. Or the sidecar's reaper tick
    comes first (on a busy machine it often does): it rebuilds the file under a new generation
    and ends the sessions, and the connector serves without the pool until it registered again.
    Either way the tokens are the same, the engine lives, and hits come back from the rebuilt
    pool. (The worker's own short-file path is proven without that race by
    tests/connector/test_pool_truncated.py, a real engine included.)"""
    pod, (engine, want) = fault_pod
    sidecar = pod.sidecar()
    socket = harness.socket_of(sidecar)
    pool_dir = harness.pool_dir_of(sidecar)
    prompts_, tokens = PROMPT_SETS["truncated"], want["truncated"]
    _pool_serving(pod, socket)  # an earlier fault test may have left the sidecar degraded
    line, rebuilt = "shrank under the mapping", "rebuilt it (generation"
    closed = "the sidecar closed the framed session"
    seen, seen_closed = engine.text().count(line), engine.text().count(closed)
    sidecar_log = pod.procs[sidecar["name"]].text
    rebuilds = sidecar_log().count(rebuilt)
    _stored(pod, socket, prompts_, tokens)  # the next round hits the pool
    generation = (pod.pool_stats(socket) or {}).get("pool_generation")
    pod.reset_prefix_cache()
    pod.ns(["sh", "-c", f'for f in {pool_dir}/*; do truncate -s 0 "$f"; done'])
    assert pod.complete(prompts_, MAX_TOKENS) == tokens
    assert engine.alive(), f"engine died after the truncate:\n{engine.text()[-4000:]}"
    # the sidecar rebuilt its pool (a new generation)
    end = time.monotonic() + 15
    while (pod.pool_stats(socket) or {}).get("pool_generation") in (generation, None):
        assert time.monotonic() < end, sidecar_log()[-3000:]
        time.sleep(0.5)
    assert sidecar_log().count(rebuilt) == rebuilds + 1, sidecar_log()[-3000:]
    log = engine.text()
    said = [ln for ln in log.splitlines() if line in ln]
    if len(said) > seen:  # the worker met the short file before the sidecar's rebuild
        assert "serving without the pool until the sidecar rebuilds it" in said[-1], said[-1]
        assert len(said) == seen + 1, said  # once, not once per job or step
    else:  # the rebuild came first: the connector was told by its sessions ending
        assert log.count(closed) > seen_closed, log[-4000:]
    # the sidecar rebuilt its pool (a new generation) and the engine gets hits from it again
    hits = 0
    for _ in range(5):  # the connector re-registers and re-maps on its own schedule
        _stored(pod, socket, prompts_, tokens)
        before = harness.pool_hits(pod.pool_stats(socket))
        pod.reset_prefix_cache()
        assert pod.complete(prompts_, MAX_TOKENS) == tokens
        hits = harness.pool_hits(pod.pool_stats(socket)) - before
        if hits > 0:
            break
        time.sleep(2)
    assert hits > 0, f"no pool hits after the rebuild:\n{engine.text()[-3000:]}"
    assert engine.alive()


def _pool_serving(pod: harness.Pod, socket: str) -> None:
    """Make sure the sidecar serves a pool: one degraded by an earlier test (a plain file at
    its socket path) is given its socket path back and restarted."""
    stats = pod.pool_stats(socket) or {}
    if stats.get("pool_bytes") and not stats.get("degraded_reason"):
        return
    name = pod.sidecar()["name"]
    restarts = pod.procs[name].restarts
    pod.ns(["sh", "-c", f"[ -S {socket} ] || rm -f {socket}"])
    pod.kill(name)
    _wait_sidecar_back(pod, restarts=restarts + 1)
    stats = pod.pool_stats(socket) or {}
    assert stats.get("pool_bytes") and not stats.get("degraded_reason"), stats


def _stored(pod: harness.Pod, socket: str, prompts_: Any, tokens: Any, rounds: int = 5) -> None:
    """Complete `prompts_` (asserting `tokens`) until the pool holds their chunks: right after
    the engine starts, or after a rebuild, the connector serves without the pool for a moment."""
    for _ in range(rounds):
        assert pod.complete(prompts_, MAX_TOKENS) == tokens
        nss = settle(pod, socket, at_least=len(prompts_), max_s=10).get("namespaces", [])
        if sum(n["committed_slots"] for n in nss) >= len(prompts_):
            return
        pod.reset_prefix_cache()
    raise AssertionError(f"nothing stored in {rounds} rounds: {pod.pool_stats(socket)}")


def _uid_of(pid: int) -> int:
    """The real uid of a process (the container's entrypoint after nsenter/setpriv exec'd)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    raise AssertionError(f"no Uid line for pid {pid}")


class _Load:
    """Completions of one prompt set, one after another in a loop on a thread, until the
    block ends: the traffic in flight while a fault hits. Keeps each answer and when it ran."""

    def __init__(self, pod: harness.Pod, name: str) -> None:
        self.pod, self.prompts = pod, PROMPT_SETS[name]
        self.done: list[tuple[int, float, float, list[int]]] = []  # (prompt, start, end, tokens)
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            began = time.monotonic()
            try:
                (tokens,) = self.pod.complete([self.prompts[i]], MAX_TOKENS)
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                self.errors.append(exc)
                return
            self.done.append((i, began, time.monotonic(), tokens))
            i = (i + 1) % len(self.prompts)

    def __enter__(self) -> _Load:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=180)
        assert not self._thread.is_alive(), "a request wedged"

    def wait_for(self, n: int, max_s: float = 120) -> None:
        end = time.monotonic() + max_s
        while len(self.done) < n:
            assert not self.errors, self.errors
            assert time.monotonic() < end, f"{len(self.done)} of {n} requests done"
            time.sleep(0.05)

    def in_flight_at(self, t: float) -> bool:
        return any(began < t < ended for _, began, ended, _ in self.done)

    def wrong(self, want: list[list[int]]) -> list[int]:
        """Prompts whose answer differs from `want` (and any request that failed)."""
        assert not self.errors, self.errors
        return [i for i, _, _, tokens in self.done if tokens != want[i]]


def _serving_stats(pod: harness.Pod, socket: str, max_s: float = 30) -> dict[str, Any]:
    """Stats once the sidecar answers them (its startup probe may pass before: `kvoffload
    probe` also passes N s after the pod's first probe)."""
    end = time.monotonic() + max_s
    while (stats := pod.pool_stats(socket)) is None:
        assert time.monotonic() < end, "the restarted sidecar never answered Stats"
        time.sleep(0.2)
    return stats


@_mark
@pytest.mark.timeout(900)  # a fresh vLLM engine in the fault pod on a busy 2-core box
def test_fault_sidecar_sigkill_under_load_keeps_the_pool_for_a_fresh_engine(
    fault_pod: Any,
) -> None:
    """Restarts lose nothing in a pod: the sidecar container SIGKILLed with requests in
    flight and restarted by the kubelet adopts the pool file it left in the pod's emptyDir
    (the committed blocks visible again, same generation), and a vLLM container started
    afterwards (a fresh engine, same args and uid) gets pool hits with the tokens of the pod
    without kvoffload for the prompts stored before the kill. The sidecar and vLLM run as
    different non-root uids, the pool dir is the injector's size-limited memory emptyDir. The
    fault tests' pod, last of them (its engine is replaced here)."""
    pod, (engine, want) = fault_pod
    sidecar = pod.sidecar()
    name, socket = sidecar["name"], harness.socket_of(sidecar)
    pool_dir = harness.pool_dir_of(sidecar)
    restarts = pod.procs[name].restarts
    # the pod as injected: two non-root uids, the pool on a tmpfs of the emptyDir's limit
    sidecar_uid, vllm_uid = _uid_of(pod.procs[name].popen.pid), _uid_of(engine.popen.pid)
    assert 0 not in (sidecar_uid, vllm_uid) and sidecar_uid != vllm_uid
    volume = next(m["name"] for m in sidecar["volumeMounts"] if m["mountPath"] == pool_dir)
    limit = next(v["emptyDir"]["sizeLimit"] for v in pod.spec["volumes"]
                 if v["name"] == volume)  # fmt: skip
    fs, blocks, bsize = pod.ns(["stat", "-f", "-c", "%T %b %S", pool_dir]).split()
    assert fs == "tmpfs" and int(blocks) * int(bsize) == harness.quantity(limit)
    owner = pod.ns(["sh", "-c", f"stat -c %u {pool_dir}/*.shm"]).split()
    assert owner == [str(sidecar_uid)], owner

    stored, tokens = PROMPT_SETS["adopted"], want["adopted"]
    _stored(pod, socket, stored, tokens)
    with _Load(pod, "adopt_load") as load:
        load.wait_for(2)
        at_kill = pod.pool_stats(socket) or {}
        killed_at = time.monotonic()
        pod.kill(name)
        _wait_sidecar_back(pod, restarts=restarts + 1)
        stats = _serving_stats(pod, socket)
        load.wait_for(len(load.done) + 2)  # requests went on after the restart
    assert load.in_flight_at(killed_at), "no request was in flight at the kill"
    assert load.wrong(want["adopt_load"]) == [], "wrong tokens under the fault"
    adoption = stats.get("adoption") or {}
    assert adoption.get("outcome") == "adopted", f"{stats}\n{pod.procs[name].text()[-3000:]}"
    committed = sum(n["committed_slots"] for n in at_kill.get("namespaces", []))
    assert committed >= len(stored), at_kill
    # every block committed at the snapshot (taken just before the kill), and at most those
    # and one chunk per request of the load (900-token prompts) that could commit between
    # the snapshot and the kill: none made up, none lost
    most = committed + len(PROMPT_SETS["adopt_load"])
    assert committed <= adoption["adopted_blocks"] <= most, (adoption, at_kill)
    assert stats["pool_generation"] == at_kill["pool_generation"]

    # a fresh vLLM engine: the container restarted, its first requests hit the adopted pool
    engine = pod.restart(pod.vllm_container()["name"])
    pod.wait_serving(engine)
    assert _uid_of(engine.popen.pid) == vllm_uid
    before = pod.pool_stats(socket) or {}
    assert pod.complete(stored, MAX_TOKENS) == tokens
    after = pod.pool_stats(socket) or {}
    assert harness.pool_hits(after) - harness.pool_hits(before) >= len(stored), (
        f"no pool hits for the fresh engine:\n{engine.text()[-3000:]}"
    )
    stored_blocks = [sum(n["stored_blocks"] for n in s["namespaces"]) for s in (before, after)]
    assert stored_blocks[0] == stored_blocks[1], "the fresh engine stored them anew"
    assert after["pool_generation"] == at_kill["pool_generation"]
    assert engine.alive() and pod.procs[name].restarts == restarts + 1


# -- node placement -------------------------------------------------------------------------------
NODE_FIXTURE = HERE / "manifests" / "restricted-psa-uid1000.yaml"
NODE_POOL = {  # the admin's node pool as the agent reads it: the policy's tenant, granted to
    "name": "pod-tests",  # the pods' namespace (harness pods are in `default`)
    "tenants": [{"name": "pod-tests", "shareBytes": 64 << 20, "namespaces": ["default"]}],
}


def _as_uid(path: Path, uid: int, out: Path) -> Path:
    """`path`'s manifest with the pod's securityContext running as `uid` (its group too) and no
    fsGroup: another replica's pod as another team's template would write it."""
    doc = load(path)
    _, spec = harness.pod_spec(doc)
    sc = spec["securityContext"]
    sc.update(runAsUser=uid, runAsGroup=uid)
    sc.pop("fsGroup", None)
    out.write_text(yaml.safe_dump(doc))
    return out


@_mark
@pytest.mark.timeout(900)  # two vLLM pods (and the baseline when run alone) on a busy 2-core box
def test_node_placement_two_pods_share_one_agent_and_the_second_hits_the_first(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Two replicas of the restricted fixture, injected by the real injector with a `placement:
    node` policy (one tenant), as two pods: A runs as uid 1000 with fsGroup 1000, B as uid 1001
    without one, each with its own tmpfs emptyDirs. One real node agent serves both; the
    harness publishes each pod's `kvoffload-node` volume through the agent's CSI Node service
    with the kubelet's pod info, at the kubelet's target path, and the vLLM container sees it
    at /var/run/kvoffload. A serves the prompts (stored in the tenant's pool); B's first
    requests are pool hits (the agent's Stats for the tenant, through B's own pool.sock), with
    the tokens of the pod without kvoffload, and B stores none of them again; A serves them
    again after its prefix cache reset, with hits. Each pod's Stats relays its own connector
    status files, written by its non-root container into the volume's `status/`. The injected
    pods pass Pod Security "restricted" (no hostPath, no hostIPC, no added capability)."""
    wd = workdir_for(tmp_path_factory, "node")
    prompts_ = PROMPT_SETS["round"]
    want = baseline(NODE_FIXTURE, wd)["round"]
    (doc_a,) = inject(NODE_FIXTURE, NODE_POLICY)
    (doc_b,) = inject(_as_uid(NODE_FIXTURE, 1001, wd / "uid1001.yaml"), NODE_POLICY)
    for doc in (doc_a, doc_b):
        _, spec = harness.pod_spec(doc)
        assert restricted_violations({"spec": spec}) == []
        assert not any("hostPath" in v for v in spec["volumes"]) and not spec.get("hostIPC")
        assert all("add" not in ((c.get("securityContext") or {}).get("capabilities") or {})
                   for c in [*spec.get("initContainers", []), *spec["containers"]])  # fmt: skip
        assert not any(c.get("restartPolicy") == "Always" for c in spec.get("initContainers", []))
        (csi,) = [v for v in spec["volumes"] if "csi" in v]
        assert csi == {"name": "kvoffload-node", "csi": {"driver": harness.NodeAgent.DRIVER,
                       "readOnly": False, "volumeAttributes": {"tenant": "pod-tests"}}}  # fmt: skip
    socket = "/var/run/kvoffload/pool.sock"
    with contextlib.ExitStack() as stack:
        agent = stack.enter_context(harness.NodeAgent(NODE_POOL, wd))
        (wd / "a").mkdir()
        (wd / "b").mkdir()
        pod_a, engine_a = stack.enter_context(
            harness.running(doc_a, wd / "a", csi=[agent.driver], name="vllm-restricted-0")
        )
        assert pod_a.complete(prompts_, MAX_TOKENS) == want
        settle(pod_a, socket, at_least=len(prompts_))
        pod_b, engine_b = stack.enter_context(
            harness.running(doc_b, wd / "b", csi=[agent.driver], name="vllm-restricted-1")
        )
        # two uids, each pod its own tmpfs and its own directory of the agent's
        assert (_uid_of(engine_a.popen.pid), _uid_of(engine_b.popen.pid)) == (1000, 1001)
        tmpfs = [pod.ns(["stat", "-f", "-c", "%T", "/kvoffload/python"]).strip()
                 + pod.ns(["stat", "-c", " %d", "/kvoffload/python"])
                 for pod in (pod_a, pod_b)]  # fmt: skip
        (fs_a, dev_a), (fs_b, dev_b) = (t.split() for t in tmpfs)
        assert fs_a == fs_b == "tmpfs" and dev_a != dev_b, tmpfs
        listing = [pod.ns(["ls", "/var/run/kvoffload"]).split() for pod in (pod_a, pod_b)]
        assert all({"memory.sock", "pool.sock"} <= set(names) for names in listing), listing
        inodes = [pod.ns(["stat", "-c", "%i", "/var/run/kvoffload"]) for pod in (pod_a, pod_b)]
        assert inodes[0] != inodes[1], "both pods see one directory"

        before = pod_b.pool_stats(socket) or {}
        assert pod_b.complete(prompts_, MAX_TOKENS) == want
        after = settle(pod_b, socket, at_least=len(prompts_))
        assert harness.pool_hits(after) - harness.pool_hits(before) >= len(prompts_), (
            f"pod B's requests were not pool hits: {after}\n{engine_b.text()[-3000:]}\n"
            f"{agent.text()[-3000:]}"
        )
        stored = [sum(n["stored_blocks"] for n in st["namespaces"]) for st in (before, after)]
        assert stored[0] == stored[1], "pod B stored A's prefixes again"
        # one tenant pool behind both pods' sockets
        stats_a = pod_a.pool_stats(socket) or {}
        assert stats_a.get("pool_generation") == after.get("pool_generation") is not None

        pod_a.reset_prefix_cache()
        assert pod_a.complete(prompts_, MAX_TOKENS) == want
        again = pod_a.pool_stats(socket) or {}
        assert harness.pool_hits(again) - harness.pool_hits(after) >= len(prompts_), again
        # each pod's Stats relays its own connectors' status files, which its non-root vLLM
        # container wrote into the volume's status/ (A's through fsGroup 1000, B's sticky 1777)
        for st in (again, pod_b.pool_stats(socket) or {}):
            entries = json.loads(st.get("connector_status") or "[]")
            assert sorted((e.get("role"), e.get("rank")) for e in entries) == [
                ("scheduler", 0), ("worker", 0)], entries  # fmt: skip
            assert all(e.get("state") == "active" and e.get("placement") == "node"
                       and not e.get("no_pool") for e in entries), entries  # fmt: skip
        assert engine_a.alive() and engine_b.alive()
