"""Six ways an injector breaks or wastes a pod it touches, each asserted on public shapes:

1. a command run through ``eval`` gets the flag's JSON with its quotes stripped;
2. ``vllm run-batch`` (Jobs, CronJobs, pipeline steps) is taken for "no engine";
3. a container named ``vllm`` that runs a script is injected whatever the script does;
4. another stack's KV cache switched on by environment alone gets kvoffload stacked on top;
5. a pod that wires kvoffload by hand is injected again (mount paths twice: the API server
   refuses the pod);
6. args-only guesses: ``--dtype`` taken for a vLLM flag, ``--backend vllm`` not.

The tests use the injector's public entry point only (`inject_pod`, the decision's ``inject``
and skip reason's value, the pod it returns) and a stand-in ``vllm`` of their own, so they read
the same on any version of the operator package. An injected command line is run by the shell
that will run it, with nothing but stubs on ``PATH``: the engine must get
``--kv-transfer-config`` once, as the policy's JSON.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml
from kvoffload_operator.inject import inject_pod
from kvoffload_operator.inject.render import kv_transfer_config
from kvoffload_operator.policy import policy_from_resource
from kvoffload_operator.workloads import group_size, pod_templates

pytestmark = pytest.mark.process

TESTDATA = Path(__file__).parent / "testdata"
POLICY = policy_from_resource(
    {
        "kind": "KVOffloadPolicy",
        "metadata": {"name": "p", "namespace": "ns"},
        "spec": {"selector": {}, "pool": {"size": "1Gi"}},
    }
)
FLAG = re.compile(r"^--kv[-_]transfer[-_]config(=|$)")

# The stand-in engine: records its argv (vllm serve|run-batch, python -m vllm.entrypoints.*);
# `vllm --version` and every other python run record nothing.
_RECORDER = (
    "#!{python}\n"
    "import json, os, sys\n"
    "name, args = os.path.basename(sys.argv[0]), sys.argv[1:]\n"
    "module = args[args.index('-m') + 1] if '-m' in args[:-1] else ''\n"
    "engine = (name == 'vllm' and args[:1] != ['--version']) or module.startswith('vllm.')\n"
    "if engine:\n"
    "    open(os.environ['ARGV_LOG'], 'a').write(json.dumps([name, *args]) + '\\n')\n"
)


def shape(name: str) -> tuple[dict[str, Any], int | None]:
    """The one pod template of ``testdata/<name>.yaml`` and its LeaderWorkerSet group size."""
    found = [
        (dict(template), group_size(doc))
        for doc in yaml.safe_load_all((TESTDATA / f"{name}.yaml").read_text())
        if doc
        for _, template in pod_templates(doc)
    ]
    assert len(found) == 1, name
    return found[0]


def inject_shape(name: str) -> Any:
    template, size = shape(name)
    return inject_pod(template, [POLICY], group_size=size)


def pod_of(**container: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": "x"},
        "spec": {"containers": [{"name": "c", "image": "example.com/app:1", **container}]},
    }


def container_of(result: Any) -> dict[str, Any]:
    name = result.decision.container
    return next(c for c in result.pod["spec"]["containers"] if c["name"] == name)


def engine_calls(container: dict[str, Any], tmp_path: Path) -> list[list[str]]:
    """Run ``container``'s command + args (the kubelet execs them: no shell of ours) with only
    stubs on PATH: the recorder for vllm and python, a no-op for every other word the command
    line names. Returns each engine invocation's argv."""
    words = [*(container.get("command") or []), *(container.get("args") or [])]
    stubs = tmp_path / "bin"
    stubs.mkdir()
    recorder = stubs / "_recorder"
    recorder.write_text(_RECORDER.format(python=sys.executable))
    recorder.chmod(0o755)
    noop = stubs / "_noop"
    noop.write_text("#!/bin/sh\nexit 0\n")
    noop.chmod(0o755)
    for name in {"vllm", "python", "python3"}:
        (stubs / name).symlink_to(recorder)
    for name in ("sh", "bash", "dash"):
        (stubs / name).symlink_to(f"/bin/{name}")
    for name in set(re.findall(r"(?<![\w$/.-])[A-Za-z_][\w.-]*", " ".join(words))):
        if not (stubs / name).exists():
            (stubs / name).symlink_to(noop)
    first = words[0] if words[0].startswith("/") else str(stubs / words[0])
    log = tmp_path / "argv.jsonl"
    env = {"PATH": str(stubs), "ARGV_LOG": str(log), "HOME": str(tmp_path)}
    for e in container.get("env") or []:
        if "value" in e:
            env.setdefault(e["name"], str(e["value"]))
    res = subprocess.run(
        [first, *words[1:]], env=env, cwd=tmp_path, capture_output=True, text=True,
        timeout=30, check=False,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def flag_values(argv: list[str]) -> list[str]:
    out = []
    for i, w in enumerate(argv):
        m = FLAG.match(w)
        if m:
            out.append(w[m.end() :] if m.group(1) else (argv[i + 1 : i + 2] or [""])[0])
    return out


def assert_delivered(result: Any, tmp_path: Path) -> list[str]:
    """The injected vLLM container, run as the kubelet runs it, starts one engine whose argv
    carries the policy's JSON once."""
    assert result.decision.inject, result.decision.message
    (call,) = engine_calls(container_of(result), tmp_path)
    values = flag_values(call)
    assert len(values) == 1, call
    try:
        config = json.loads(values[0])
    except ValueError as exc:
        pytest.fail(f"the engine got --kv-transfer-config {values[0][:80]!r}: not JSON ({exc})")
    assert config == kv_transfer_config(POLICY)
    return call


def assert_skipped(result: Any, original: dict[str, Any], reason: str) -> None:
    decision = result.decision
    assert not decision.inject, f"injected; expected a skip ({reason})"
    assert decision.reason is not None and decision.reason.value == reason, decision.message
    assert result.pod.get("spec") == original.get("spec")


# -- 1. eval ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["kserve-llmisvc-eval", "kserve-llmisvc-kv-guard"])
def test_1_kserve_eval_template_gets_intact_json(name: str, tmp_path: Path) -> None:
    """KServe's LLMInferenceService runs `bash -c '… eval "exec vllm serve … $@"'`; the later
    template only reads --kv-transfer-config in a guard, which configures nothing."""
    call = assert_delivered(inject_shape(name), tmp_path)
    assert call[:2] == ["vllm", "serve"] and "/mnt/models" in call


@pytest.mark.parametrize(
    "script",
    [
        'eval "exec vllm serve m --port 8000 $@"',
        "eval 'exec vllm serve m --port 8000 \"$@\"'",
        'sh -c "exec vllm serve m --port 8000"',
    ],
    ids=["eval-double", "eval-single", "nested-sh-c"],
)
def test_1_every_second_parse_gets_intact_json(script: str, tmp_path: Path) -> None:
    result = inject_pod(pod_of(command=["/bin/bash", "-c", script, "--"], args=["--x", "y"]),
                        [POLICY])  # fmt: skip
    call = assert_delivered(result, tmp_path)
    assert [w for w in call if w in ("m", "--port", "8000")] == ["m", "--port", "8000"]


# -- 2. run-batch -----------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["job-run-batch", "cronjob-run-batch"])
def test_2_run_batch_jobs_are_injected_and_delivered(name: str, tmp_path: Path) -> None:
    call = assert_delivered(inject_shape(name), tmp_path)
    assert "run-batch" in call or "vllm.entrypoints.openai.run_batch" in call


@pytest.mark.parametrize("name", ["argo-workflow-run-batch", "kubeflow-pipeline-run-batch"])
def test_2_run_batch_pipeline_steps_are_injected(name: str) -> None:
    result = inject_shape(name)
    assert result.decision.inject, result.decision.message
    c = container_of(result)
    words = [*(c.get("command") or []), *(c.get("args") or [])]
    (value,) = flag_values(words)
    assert json.loads(value) == kv_transfer_config(POLICY)


@pytest.mark.parametrize(
    "command",
    [
        ["vllm", "run-batch", "-i", "in.jsonl", "-o", "out.jsonl", "--model", "m"],
        ["python3", "-m", "vllm.entrypoints.openai.run_batch", "-i", "in.jsonl", "--model", "m"],
    ],
    ids=["cli", "module"],
)
def test_2_both_forms_of_run_batch_are_engines(command: list[str], tmp_path: Path) -> None:
    assert_delivered(inject_pod(pod_of(command=command), [POLICY]), tmp_path)


# -- 3. a container named vllm ----------------------------------------------------------------
@pytest.mark.parametrize("container_name", ["vllm", "server"])
def test_3_a_configmap_script_is_not_injected_whatever_the_name(container_name: str) -> None:
    """`/scripts/start.sh` from a ConfigMap the webhook cannot read: a flag appended to args
    would be the script's $1, and the pod would reserve a pool nobody uses."""
    template, _ = shape("kubeblocks-vllm-configmap-script")
    template["spec"]["containers"][0]["name"] = container_name
    assert_skipped(inject_pod(template, [POLICY]), template, "opaque-entrypoint")


def test_3_named_vllm_with_an_unknown_image_entrypoint_is_not_injected() -> None:
    original = pod_of(args=["--model", "m"])
    original["spec"]["containers"][0]["name"] = "vllm"
    assert_skipped(inject_pod(original, [POLICY]), original, "opaque-entrypoint")


# -- 4. offload by environment ----------------------------------------------------------------
@pytest.mark.parametrize(
    "name",
    ["aibrix-vineyard-env", "production-stack-lmcache-env-only", "llm-d-decode-nixl-env-config"],
)
def test_4_other_kv_caches_set_by_env_are_not_stacked_on(name: str) -> None:
    template, size = shape(name)
    assert_skipped(inject_pod(template, [POLICY], group_size=size), template, "other-kv-cache")


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("VLLM_USE_VINEYARD_CACHE", "1"),
        ("AIBRIX_LLM_KV_CACHE", "1"),
        ("AIBRIX_KV_CACHE_OL_L1_CACHE_ENABLED", "1"),
        ("LMCACHE_LOCAL_CPU", "True"),
        ("DYN_KVBM_CPU_CACHE_GB", "100"),
        ("MOONCAKE_CONFIG_PATH", "/mooncake.json"),
    ],
)
def test_4_each_stacks_switch_is_seen(variable: str, value: str) -> None:
    original = pod_of(command=["vllm", "serve", "m"], env=[{"name": variable, "value": value}])
    assert_skipped(inject_pod(original, [POLICY]), original, "other-kv-cache")


# -- 5. kvoffload wired by hand ---------------------------------------------------------------
def _api_server_refusals(pod: dict[str, Any]) -> list[str]:
    spec = pod["spec"]
    out = []
    containers = [*(spec.get("initContainers") or []), *spec["containers"]]
    for name, n in Counter(c["name"] for c in containers).items():
        if n > 1:
            out.append(f"container {name} twice")
    for c in containers:
        mounts = [m["mountPath"] for m in c.get("volumeMounts") or []]
        mounts += [d["devicePath"] for d in c.get("volumeDevices") or []]
        paths = Counter(m.rstrip("/") for m in mounts)
        for path, n in paths.items():
            if n > 1:
                out.append(f"{c['name']}: mountPath {path} must be unique")
    for name, n in Counter(v["name"] for v in spec.get("volumes") or []).items():
        if n > 1:
            out.append(f"volume {name} twice")
    return out


def test_5_a_hand_wired_pod_is_left_as_written() -> None:
    template, _ = shape("hand-wired-kvoffload")
    assert _api_server_refusals(template) == []
    result = inject_pod(template, [POLICY])
    assert _api_server_refusals(result.pod) == []
    assert_skipped(result, template, "hand-wired")


def test_5_a_hand_run_sidecar_alone_is_hand_wired() -> None:
    original = {
        "metadata": {"name": "x"},
        "spec": {"containers": [
            {"name": "vllm", "image": "vllm/vllm-openai", "command": ["vllm", "serve", "m"]},
            {"name": "pool", "image": "ghcr.io/kvoffload/kvoffload:0.1.0",
             "command": ["kvoffload", "sidecar"], "args": ["--pool-size=8Gi"]},
        ]},
    }  # fmt: skip
    assert_skipped(inject_pod(original, [POLICY]), original, "hand-wired")


VLLM = {"name": "vllm", "image": "vllm/vllm-openai:v0.11.0", "command": ["vllm", "serve", "m"]}


@pytest.mark.parametrize(
    "spec",
    [
        {"containers": [{**VLLM, "volumeMounts": [{"name": "kvoffload-pool", "mountPath": "/d"}]}],
         "volumes": [{"name": "kvoffload-pool", "emptyDir": {}}]},
        {"containers": [{**VLLM, "ports": [{"containerPort": 9400}, {"containerPort": 9401}]}]},
        {"containers": [{**VLLM, "volumeDevices": [{"name": "b",
                                                    "devicePath": "/kvoffload/pool"}]}],
         "volumes": [{"name": "b", "persistentVolumeClaim": {"claimName": "c"}}]},
    ],
    ids=["own-volume-named-kvoffload-pool", "own-ports-9400-9401", "own-device-at-pool-path"],
)  # fmt: skip
def test_5_the_webhook_never_answers_a_pod_the_api_server_would_refuse(
    spec: dict[str, Any],
) -> None:
    """A pod that already uses a name, path or port kvoffload writes: whatever the injector
    decides, what the webhook answers has no duplicate and no clash."""
    from kvoffload_operator.admission import admit_pod
    from kvoffload_operator.inject import RenderDefaults

    original = {"metadata": {"name": "x"}, "spec": spec}
    admitted = admit_pod(original, [POLICY], RenderDefaults()).pod
    assert _api_server_refusals(admitted) == []
    ports = Counter(
        p["containerPort"]
        for c in [*(admitted["spec"].get("initContainers") or []), *admitted["spec"]["containers"]]
        for p in c.get("ports") or []
    )
    assert [p for p, n in ports.items() if n > 1] == []


# -- 6. args-only guesses ---------------------------------------------------------------------
def test_6_huggingfaceserver_on_its_hf_backend_gets_no_sidecar() -> None:
    template, _ = shape("kserve-hf-huggingface-backend")
    result = inject_pod(template, [POLICY])
    assert not result.decision.inject, "--dtype is the HF backend's flag too"
    assert result.pod.get("spec") == template.get("spec")


@pytest.mark.parametrize(
    "args",
    [["--model", "m", "--dtype", "bfloat16"], ["--model_id=m", "--dtype=float16"]],
    ids=["unknown-image", "no-backend"],
)
def test_6_dtype_alone_is_no_proof_of_vllm(args: list[str]) -> None:
    original = pod_of(args=args)
    if "--model_id=m" in args:
        original["spec"]["containers"][0]["image"] = "kserve/huggingfaceserver:v0.15.0"
    result = inject_pod(original, [POLICY])
    assert not result.decision.inject
    assert result.pod.get("spec") == original.get("spec")


@pytest.mark.parametrize(
    "container",
    [
        {"image": "kserve/huggingfaceserver:v0.15.0", "args": ["--model_id=m", "--backend=vllm"]},
        {"command": ["python", "-m", "huggingfaceserver"],
         "args": ["--backend", "vllm", "--model_id", "m"]},
    ],
    ids=["image-entrypoint", "module"],
)  # fmt: skip
def test_6_huggingfaceserver_backend_vllm_is_injected_once(container: dict[str, Any]) -> None:
    original = pod_of(**container)
    result = inject_pod(original, [POLICY])
    assert result.decision.inject, result.decision.message
    c = container_of(result)
    assert c.get("command") == original["spec"]["containers"][0].get("command")
    before = original["spec"]["containers"][0]["args"]
    assert c["args"][: len(before)] == before and len(c["args"]) == len(before) + 1
    (value,) = flag_values(c["args"])
    assert json.loads(value) == kv_transfer_config(POLICY)


def test_the_stand_in_catches_json_that_eval_strips(tmp_path: Path) -> None:
    """The runner is not a rubber stamp: JSON quoted for one parse, inside an eval'd string,
    reaches the stand-in vllm without its quotes."""
    text = json.dumps(kv_transfer_config(POLICY), separators=(",", ":"))
    quoted = "'" + text + "'"
    script = f'eval "exec vllm serve m --kv-transfer-config {quoted} $@"'
    (call,) = engine_calls({"command": ["/bin/bash", "-c", script, "--"]}, tmp_path)
    (value,) = flag_values(call)
    assert value != text and value.startswith("{kv_connector:")
    assert os.path.exists(tmp_path / "argv.jsonl")
