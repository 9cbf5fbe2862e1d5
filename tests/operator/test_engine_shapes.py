"""Every entrypoint shape: injected where the engine starts, or skipped with a precise reason."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from kvoffload_operator.inject import SkipReason, inject_pod
from kvoffload_operator.inject.container import argv as argv_of
from kvoffload_operator.inject.render import kv_transfer_config
from kvoffload_operator.inject.site import ENV_VAR, EnvEdit
from kvoffload_operator.policy import PolicyError, policies_from_documents, policy_from_resource

TESTDATA = Path(__file__).parent / "testdata"

POLICY = policy_from_resource(
    {
        "kind": "KVOffloadPolicy",
        "metadata": {"name": "p", "namespace": "ns"},
        "spec": {"selector": {}, "pool": {"size": "1Gi"}},
    }
)
FLAG = "--kv-transfer-config"


def run(container: dict[str, Any], **meta: Any) -> Any:
    pod = {
        "metadata": {"name": "x", **meta},
        "spec": {"containers": [{"name": "c", "image": "example.com/app:1", **container}]},
    }
    return inject_pod(pod, [POLICY])


def engine_argv(result: Any) -> list[str]:
    c = result.pod["spec"]["containers"][0]
    return [*(c.get("command") or []), *(c.get("args") or [])]


INJECTED_ARGV = [
    pytest.param({"command": ["vllm", "serve", "m"]}, id="vllm-serve"),
    pytest.param({"command": ["/usr/local/bin/vllm", "serve"], "args": ["m"]}, id="vllm-path"),
    pytest.param({"command": ["vllm", "bench", "throughput", "--model", "m"]}, id="bench-tput"),
    pytest.param({"command": ["vllm", "bench", "latency", "--model", "m"]}, id="bench-latency"),
    pytest.param(
        {"command": ["python3", "-m", "vllm.entrypoints.openai.api_server", "--model", "m"]},
        id="api-server",
    ),
    pytest.param(
        {"command": ["python", "-u", "-m", "vllm.entrypoints.cli.main", "serve", "m"]},
        id="cli-main-serve",
    ),
    pytest.param({"image": "vllm/vllm-openai:v0.11.0", "args": ["m"]}, id="args-only-vllm-image"),
    pytest.param({"args": ["vllm", "serve", "m"]}, id="args-are-argv"),
    pytest.param({"command": ["vllm", "run-batch", "-i", "in.jsonl", "-o", "o"]}, id="run-batch"),
    pytest.param(
        {"command": ["python3", "-m", "vllm.entrypoints.openai.run_batch", "-i", "in.jsonl"]},
        id="run-batch-module",
    ),
    pytest.param(
        {"command": ["python", "-m", "vllm.entrypoints.cli.main", "run-batch", "-i", "x"]},
        id="cli-main-run-batch",
    ),
    pytest.param(
        {
            "command": ["/var/run/argo/argoexec", "emissary", "--loglevel", "info", "--"],
            "args": ["vllm", "serve", "m"],
        },
        id="argo-emissary",
    ),  # fmt: skip
    pytest.param({"command": ["tini", "--", "vllm", "serve", "m"]}, id="tini"),
    pytest.param(
        {"image": "kserve/huggingfaceserver:v0.15.0", "args": ["--model_id=m", "--backend=vllm"]},
        id="huggingfaceserver-vllm",
    ),
    pytest.param(
        {"command": ["python", "-m", "huggingfaceserver"], "args": ["--backend", "vllm"]},
        id="huggingfaceserver-module-vllm",
    ),
    pytest.param(
        {
            "image": "kserve/huggingfaceserver:v0.15.0",
            "args": ["--model_id=m", "--backend=vllm"],
            "env": [{"name": "LMCACHE_USE_EXPERIMENTAL", "value": "True"}],
        },
        id="lmcache-use-experimental-alone-configures-nothing",
    ),
    pytest.param(
        {"command": ["sh", "-c", "vllm serve a"]},
        id="ray-single-node-free",
    ),
    pytest.param(
        {"command": ["sh", "-c", 'exec "$@"', "--"], "args": ["vllm", "serve", "m"]},
        id="script-runs-its-arguments",
    ),
    pytest.param({"command": ["vllm", "serve", "m", "--"]}, id="bare-double-dash-in-command"),
    pytest.param(
        {"command": ["bash", "-c", 'exec "$@"', "--"], "args": ["vllm", "serve", "m", "--"]},
        id="bare-double-dash-in-arguments",
    ),
    pytest.param(
        {"command": ["sh", "-c", "cat <<'EOF'\nUsage: vllm serve MODEL\nEOF\nexec vllm serve m"]},
        id="heredoc-usage-text",
    ),
    pytest.param(
        {"command": ["bash", "-c", "cat > notes <<EOF\nDon't vllm serve\nEOF\nexec vllm serve m"]},
        id="heredoc-with-an-apostrophe",
    ),
]


@pytest.mark.parametrize("container", INJECTED_ARGV)
def test_engine_shapes_are_injected(container: dict[str, Any]) -> None:
    result = run(container)
    assert result.decision.inject, result.decision.message
    words = engine_argv(result)
    flags = [w for w in words if FLAG in w]
    assert len(flags) == 1


SHELL_CASES = [
    ("vllm serve m --port 8000", "vllm serve"),
    ("pip install x && exec vllm serve m & sleep 1", "exec vllm serve"),
    ("cd /w; python3 -m vllm.entrypoints.openai.api_server --model m", "api_server"),
    ("python -m vllm.entrypoints.cli.main serve m", "main serve"),
    ("ray start --head && vllm serve m --distributed-executor-backend ray", "vllm serve"),
    ("vllm bench throughput --model m\necho done", "bench throughput"),
]


@pytest.mark.parametrize(("script", "before"), SHELL_CASES)
@pytest.mark.parametrize("where", ["command", "args"])
def test_shell_scripts_get_the_flag_right_after_the_engine(
    script: str, before: str, where: str
) -> None:
    container = (
        {"command": ["/bin/bash", "-ec", script]}
        if where == "command"
        else {"command": ["/bin/bash"], "args": ["-c", script]}
    )
    result = run(container)
    assert result.decision.inject, result.decision.message
    new_script = engine_argv(result)[2]
    # the script parses as shell words with our JSON intact, placed right after the invocation
    words = shlex.split(new_script)
    at = words.index(FLAG)
    config = json.loads(words[at + 1])
    assert config["kv_connector"] == "KVOffloadConnector"
    assert new_script.split(f" {FLAG} ")[0].endswith(before)
    assert new_script.replace(f" {FLAG} {shlex.quote(words[at + 1])}", "") == script


SKIPPED = [
    ({"command": ["vllm", "bench", "serve", "--model", "m"]}, SkipReason.NO_ENGINE, "no vLLM"),
    ({"command": ["sh", "-c", "vllm bench serve --model m"]}, SkipReason.NO_ENGINE, "client"),
    ({"command": ["vllm", "chat"]}, SkipReason.NO_ENGINE, "`vllm chat`"),
    (
        {"command": ["sh", "-c", "vllm serve a & vllm serve b"]},
        SkipReason.SHELL_WRAPPER,
        "starts 2 vLLM engines",
    ),
    ({"command": ["sh", "-c", "./run-vllm.sh"]}, SkipReason.SHELL_WRAPPER, "no engine invocation"),
    (
        {"command": ["sh", "-c", 'echo "vllm serve m" && python app.py']},
        SkipReason.SHELL_WRAPPER,
        "inside a quoted string",
    ),
    (
        {"args": ["--model", "m", "--tensor-parallel-size", "2"]},
        SkipReason.OPAQUE_ENTRYPOINT,
        "its image's entrypoint (example.com/app:1",
    ),
    (
        {"name": "vllm", "command": ["/scripts/start.sh"]},
        SkipReason.OPAQUE_ENTRYPOINT,
        "`/scripts/start.sh`",
    ),
    (
        {"image": "kserve/huggingfaceserver:v0.15.0", "args": ["--model_id=m", "--dtype=auto"]},
        SkipReason.BACKEND_AUTO,
        "--backend auto",
    ),
    (
        {"image": "kserve/huggingfaceserver:v0.15.0", "args": ["--backend", "huggingface"]},
        SkipReason.NO_ENGINE,
        "--backend huggingface",
    ),
    (
        {"command": ["vllm", "serve", "--config", "/etc/vllm/config.yaml"]},
        SkipReason.CONFIG_FILE,
        "--config /etc/vllm/config.yaml",
    ),
    (
        {"command": ["sh", "-c", "vllm serve m --config=/cfg/vllm.yaml"]},
        SkipReason.CONFIG_FILE,
        "--config /cfg/vllm.yaml",
    ),
    (
        {
            "command": ["sh", "-c"],
            "args": [
                'cat > /tmp/c.yaml <<EOF\nkv-transfer-config: \'{"kv_connector":"X"}\'\n'
                "EOF\nvllm serve m --config /tmp/c.yaml"
            ],
        },
        SkipReason.HAS_KV_TRANSFER_CONFIG,
        "kv-transfer-config:",
    ),
    (
        {"command": ["vllm", "serve", "m", "--kv-transfer-config", "{}"]},
        SkipReason.HAS_KV_TRANSFER_CONFIG,
        "--kv-transfer-config",
    ),  # noqa: E501
    (
        {"command": ["vllm", "serve", "m", "--kv_transfer_config={}"]},
        SkipReason.HAS_KV_TRANSFER_CONFIG,
        "--kv_transfer_config",
    ),  # noqa: E501
    (
        {"command": ["sh", "-c", "vllm serve m --kv-transfer-config '{}'"]},
        SkipReason.HAS_KV_TRANSFER_CONFIG,
        "--kv-transfer-config",
    ),
    (
        {
            "command": ["vllm", "serve", "m"],
            "env": [{"name": "ARGS", "value": '{"kv_connector":"LMCacheConnectorV1"}'}],
        },  # noqa: E501
        SkipReason.HAS_KV_TRANSFER_CONFIG,
        "kv_connector",
    ),
    (
        {"command": ["vllm", "serve", "m"], "env": [{"name": "VLLM_KV_CONNECTOR", "value": "x"}]},
        SkipReason.HAS_KV_TRANSFER_CONFIG,
        "VLLM_KV_CONNECTOR",
    ),
    (
        {"command": ["vllm", "serve", "m", "--kv-offloading-size", "8"]},
        SkipReason.HAS_KV_OFFLOADING,
        "--kv-offloading-size",
    ),  # noqa: E501
    (
        {"command": ["vllm", "serve", "m", "--kv_offloading_backend=native"]},
        SkipReason.HAS_KV_OFFLOADING,
        "--kv_offloading_backend",
    ),  # noqa: E501
    (
        {
            "command": ["vllm", "serve"],
            "env": [{"name": "VLLM_USE_SIMPLE_KV_OFFLOAD", "value": "1"}],
        },  # noqa: E501
        SkipReason.HAS_KV_OFFLOADING,
        "VLLM_USE_SIMPLE_KV_OFFLOAD=1",
    ),
    (
        {
            "command": [
                "sh",
                "-c",
                "multi-node-serving.sh leader --ray_cluster_size=$(LWS_GROUP_SIZE); vllm serve m",
            ]
        },  # noqa: E501
        SkipReason.MULTI_NODE,
        "other pods",
    ),
    ({"command": ["vllm", "serve", "m", "--nnodes", "2"]}, SkipReason.MULTI_NODE, "--nnodes 2"),
    ({"command": ["python", "app.py"]}, SkipReason.NO_VLLM_CONTAINER, "spec.vllmContainer.name"),
    *[
        (
            {"command": ["vllm", "serve", "m"], "env": [{"name": name, "value": value}]},
            SkipReason.OTHER_KV_CACHE,
            f"sets {name} ({what}",
        )
        for name, value, what in (
            ("VLLM_USE_VINEYARD_CACHE", "1", "AIBrix's Vineyard"),
            ("AIBRIX_LLM_KV_CACHE", "1", "AIBrix's distributed KV cache"),
            ("AIBRIX_KV_CACHE_OL_L1_CACHE_ENABLED", "1", "AIBrix's KV cache offloading"),
            ("LMCACHE_LOCAL_CPU", "True", "LMCache"),
            ("LMCACHE_CONFIG_FILE", "/lmcache.yaml", "LMCache"),
            ("DYN_KVBM_CPU_CACHE_GB", "100", "Dynamo's KV block manager"),
            ("MOONCAKE_CONFIG_PATH", "/mooncake.json", "Mooncake"),
        )
    ],
    (
        {
            "command": ["vllm", "serve", "m"],
            "env": [
                {
                    "name": "VLLM_NIXL_SIDE_CHANNEL_HOST",
                    "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}},
                }
            ],
        },
        SkipReason.OTHER_KV_CACHE,
        "NIXL",
    ),
    (
        {"command": ["sh", "-c", "bash <<EOF\nvllm serve a\nEOF\nexec vllm serve m"]},
        SkipReason.SHELL_WRAPPER,
        "fed to `bash`",
    ),
    ({"command": ["sh", "-c", 'exec "$@"', "vllm", "serve", "m"]}, SkipReason.SHELL_WRAPPER, "$0"),
    ({"command": ["vllm", "serve", "m", "--port", "9400"]}, SkipReason.PORT_CLASH, "--port 9400"),
    (
        {
            "command": ["vllm", "serve", "m"],
            "volumeDevices": [{"name": "b", "devicePath": "/kvoffload"}],
        },
        SkipReason.PATH_CLASH,
        "volumeDevice at /kvoffload",
    ),
]


@pytest.mark.parametrize(("container", "reason", "text"), SKIPPED)
def test_conflicting_or_engineless_shapes_are_skipped_precisely(
    container: dict[str, Any], reason: SkipReason, text: str
) -> None:
    result = run(container)
    assert result.decision.reason is reason, result.decision.message
    assert text in result.decision.message
    assert result.pod["spec"] == run(container).pod["spec"]  # nothing but the annotation
    assert result.pod["metadata"]["annotations"]["kvoffload.io/skip-reason"] == reason.value


def test_simple_kv_offload_set_falsy_does_not_conflict() -> None:
    env = [{"name": "VLLM_USE_SIMPLE_KV_OFFLOAD", "value": "0"}]
    assert run({"command": ["vllm", "serve", "m"], "env": env}).decision.inject
    env = [{"name": "VLLM_USE_VINEYARD_CACHE", "value": "0"}]
    assert run({"command": ["vllm", "serve", "m"], "env": env}).decision.inject


def test_a_script_that_writes_its_config_file_is_read_not_guessed() -> None:
    script = "printf 'max-num-seqs: 8\\n' > /tmp/c.yaml && exec vllm serve m --config /tmp/c.yaml"
    assert run({"command": ["sh", "-c", script]}).decision.inject


@pytest.mark.parametrize(
    "meta",
    [
        {"annotations": {"leaderworkerset.sigs.k8s.io/size": "2"}},
        {"labels": {"ray.io/node-type": "head"}},
    ],
)
def test_pods_of_multi_pod_engines_are_skipped(meta: dict[str, Any]) -> None:
    result = run({"command": ["vllm", "serve", "m"]}, **meta)
    assert result.decision.reason is SkipReason.MULTI_NODE
    assert "pool regions are per pod" in result.decision.message


def test_single_pod_lws_group_is_injected() -> None:
    meta = {"annotations": {"leaderworkerset.sigs.k8s.io/size": "1"}}
    assert run({"command": ["vllm", "serve", "m"]}, **meta).decision.inject


@pytest.mark.parametrize("doc", ["docs/INSTALL.md", "docs/INJECTION.md"])
def test_every_skip_reason_is_documented(doc: str) -> None:
    from pathlib import Path

    text = (Path(__file__).parents[2] / doc).read_text()
    missing = [r.value for r in SkipReason if r.annotated and f"`{r.value}`" not in text]
    assert not missing, f"{doc} lacks skip reasons: {missing}"


@pytest.mark.vllm
@pytest.mark.parametrize(
    "container",
    [
        {"command": ["bash", "-c", "pip list && exec vllm serve facebook/opt-125m --port 8000"]},
        {"command": ["vllm", "serve", "facebook/opt-125m"], "args": ["--port", "8000"]},
    ],
    ids=["shell", "argv"],
)
def test_vllms_own_parser_reads_the_injected_config(container: dict[str, Any]) -> None:
    """The injected words, parsed by vLLM's real `vllm serve` argument parser."""
    from vllm.entrypoints.cli import serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    sub = parser.add_subparsers(dest="subparser")
    for cmd in serve.cmd_init():
        cmd.subparser_init(sub)
    result = run(container)
    words = engine_argv(result)
    if words[0] == "bash":
        words = shlex.split(words[2].split("exec ", 1)[1])
    ns = parser.parse_args(words[1:])
    assert ns.kv_transfer_config.kv_connector == "KVOffloadConnector"
    assert ns.kv_transfer_config.kv_load_failure_policy == "recompute"
    assert "chunk_size" not in ns.kv_transfer_config.kv_connector_extra_config
    assert (ns.model_tag, ns.port) == ("facebook/opt-125m", 8000)


# -- the injected command line, run by the shell that will run it -------------------------------
def run_argv(
    words: list[str], tmp_path: Path, env: dict[str, str] | None = None
) -> list[list[str]]:
    """Run ``words`` as the kubelet would (no shell of ours) with a stand-in ``vllm`` on PATH
    that records its argv; returns every recorded argv."""
    log = tmp_path / "argv.jsonl"
    stub = tmp_path / "bin" / "vllm"
    stub.parent.mkdir(exist_ok=True)
    stub.write_text(
        f"#!/bin/sh\nexec {sys.executable} -c 'import json, os, sys\n"
        'open(os.environ["ARGV_LOG"], "a").write(json.dumps(sys.argv[1:]) + "\\n")\' "$@"\n'
    )
    stub.chmod(0o755)
    path = f"{stub.parent}:/usr/local/bin:/usr/bin:/bin"
    res = subprocess.run(
        words, env={"PATH": path, "ARGV_LOG": str(log), **(env or {})},
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def delivered(result: Any, tmp_path: Path) -> list[str]:
    """The argv the stand-in vllm got from the injected container; asserts our config arrived
    once, as the exact JSON the renderer wrote."""
    (call,) = [a for a in run_argv(engine_argv(result), tmp_path) if a[:1] != ["--version"]]
    flags = [i for i, w in enumerate(call) if w == FLAG or w.startswith(FLAG + "=")]
    assert len(flags) == 1, call
    at = flags[0]
    value = call[at].split("=", 1)[1] if "=" in call[at] else call[at + 1]
    config = json.loads(value)
    assert config == kv_transfer_config(POLICY)
    return call


EVAL_SCRIPTS = [
    pytest.param('eval "exec vllm serve m --port 8000 $@"', ["m", "--port", "8000", "--x", "y"],
                 id="eval-double"),
    pytest.param("eval 'exec vllm serve m --port 8000 \"$@\"'", ["m", "--port", "8000", "--x", "y"],
                 id="eval-single"),
    pytest.param('eval exec vllm serve m --port 8000 "$@"', ["m", "--port", "8000", "--x", "y"],
                 id="eval-unquoted"),
    pytest.param('sh -c "exec vllm serve m --port 8000"', ["m", "--port", "8000"],
                 id="nested-sh-c"),
    pytest.param('A="--port 8000"\neval "exec vllm serve m \\\n  ${A} \\\n  $@"',
                 ["m", "--port", "8000", "--x", "y"], id="eval-continued-lines"),
    pytest.param("exec vllm serve m --port 8000", ["m", "--port", "8000"], id="plain"),
]  # fmt: skip


@pytest.mark.process
@pytest.mark.parametrize(("script", "rest"), EVAL_SCRIPTS)
def test_flag_survives_every_shell_parse(script: str, rest: list[str], tmp_path: Path) -> None:
    """`eval "exec vllm serve … $@"` (KServe's LLMInferenceService) parses its text twice: the
    injected JSON must reach vLLM intact, and the user's own words unchanged."""
    result = run({"command": ["/bin/bash", "-c", script, "--"], "args": ["--x", "y"]})
    assert result.decision.inject, result.decision.message
    call = delivered(result, tmp_path)
    assert call[0] == "serve"
    at = call.index(FLAG)
    assert call[1:at] + call[at + 2 :] == rest


@pytest.mark.process
@pytest.mark.parametrize(
    "case", ["kserve-llmisvc-eval", "kserve-llmisvc-kv-guard"], ids=lambda c: c
)
def test_kserve_llminferenceservice_template_gets_the_flag_through_eval(
    case: str, tmp_path: Path
) -> None:
    """KServe's rendered template, run by bash as the kubelet would, with a stand-in vllm."""
    (doc,) = yaml.safe_load_all((TESTDATA / f"{case}.yaml").read_text())
    result = inject_pod(doc, [POLICY])
    assert result.decision.inject, result.decision.message
    assert result.decision.edit is not None and result.decision.edit.parse.value == "eval-double"
    call = delivered(result, tmp_path)
    at = call.index(FLAG)
    assert call[:at] + call[at + 2 :] == [
        "serve", "/mnt/models", "--served-model-name", "llama", "publishers/team-a/models/llama",
        "--port", "8000", "--disable-uvicorn-access-log",
    ]  # fmt: skip


def test_kserve_template_with_its_own_offloading_is_skipped_for_that() -> None:
    (doc,) = yaml.safe_load_all((TESTDATA / "kserve-llmisvc-kv-offloading.yaml").read_text())
    result = inject_pod(doc, [POLICY])
    assert result.decision.reason is SkipReason.HAS_KV_TRANSFER_CONFIG
    assert "kv-transfer-config" in result.decision.message


# -- overrides: the user says how the config reaches vLLM -----------------------------------------
START_SH = {"name": "vllm", "command": ["/scripts/start.sh"], "volumeMounts": [
    {"name": "scripts", "mountPath": "/scripts"}]}  # fmt: skip
SCRIPTS_VOLUME = [{"name": "scripts", "configMap": {"name": "vllm-scripts"}}]


def run_pod(container: dict[str, Any], annotations: dict[str, str], policy: Any = POLICY) -> Any:
    pod = {
        "metadata": {"name": "x", "annotations": annotations},
        "spec": {"containers": [{"image": "example.com/app:1", **container}],
                 "volumes": SCRIPTS_VOLUME},
    }  # fmt: skip
    return inject_pod(pod, [policy])


def test_a_configmap_script_is_opaque_and_the_skip_names_it() -> None:
    result = run_pod(START_SH, {})
    assert result.decision.reason is SkipReason.OPAQUE_ENTRYPOINT
    assert "a script from ConfigMap 'vllm-scripts'" in result.decision.message
    assert "kvoffload.io/inject-via: args" in result.decision.message
    assert result.pod["spec"]["containers"][0] == {"image": "example.com/app:1", **START_SH}


def test_inject_via_args_appends_for_a_script_that_passes_its_arguments() -> None:
    result = run_pod(START_SH, {"kvoffload.io/inject-via": "args"})
    assert result.decision.inject, result.decision.message
    vllm = result.pod["spec"]["containers"][0]
    assert vllm["command"] == ["/scripts/start.sh"]
    (flag,) = vllm["args"]
    assert json.loads(flag.split("=", 1)[1]) == kv_transfer_config(POLICY)


def test_inject_via_env_leaves_argv_and_sets_the_variable() -> None:
    result = run_pod(START_SH, {"kvoffload.io/inject-via": "env"})
    assert result.decision.inject, result.decision.message
    vllm = result.pod["spec"]["containers"][0]
    assert argv_of(vllm) == ["/scripts/start.sh"]
    env = {e["name"]: e.get("value") for e in vllm["env"]}
    assert json.loads(env[ENV_VAR]) == kv_transfer_config(POLICY)
    assert (
        ENV_VAR in json.loads(result.pod["metadata"]["annotations"]["kvoffload.io/status"])["env"]
    )


def test_the_policy_can_say_inject_via_and_the_annotation_wins() -> None:
    policy = policy_from_resource(
        {"kind": "KVOffloadPolicy", "metadata": {"name": "p"},
         "spec": {"selector": {}, "pool": {"size": "1Gi"},
                  "vllmContainer": {"name": "vllm", "injectVia": "env"}}}
    )  # fmt: skip
    assert isinstance(run_pod(START_SH, {}, policy).decision.edit, EnvEdit)
    assert run_pod(START_SH, {"kvoffload.io/inject-via": "args"}, policy).decision.edit is None
    with pytest.raises(PolicyError, match="spec.vllmContainer.injectVia: 'argv' is not one of"):
        policy_from_resource(
            {"kind": "KVOffloadPolicy", "metadata": {"name": "p"},
             "spec": {"selector": {}, "pool": {"size": "1Gi"},
                      "vllmContainer": {"injectVia": "argv"}}}
        )  # fmt: skip


def test_a_bad_inject_via_is_an_invalid_override() -> None:
    result = run_pod(START_SH, {"kvoffload.io/inject-via": "argv"})
    assert result.decision.reason is SkipReason.INVALID_OVERRIDE
    assert "'argv' is not one of: auto, args, env" in result.decision.message


@pytest.mark.parametrize(
    "extra",
    [
        {"env": [{"name": "LMCACHE_LOCAL_CPU", "value": "True"}]},
        {"args": ["--kv-transfer-config", "{}"]},
    ],
)
def test_inject_via_never_overrides_a_clashing_setting(extra: dict[str, Any]) -> None:
    result = run_pod({**START_SH, **extra}, {"kvoffload.io/inject-via": "args"})
    assert not result.decision.inject
    assert result.decision.reason in (SkipReason.OTHER_KV_CACHE, SkipReason.HAS_KV_TRANSFER_CONFIG)


def test_inject_via_args_settles_a_config_file_and_backend_auto() -> None:
    via = {"kvoffload.io/inject-via": "args"}
    for container in (
        {"name": "c", "command": ["vllm", "serve", "--config", "/etc/vllm/c.yaml"]},
        {"name": "c", "image": "kserve/huggingfaceserver:v0.15.0", "args": ["--model_id=m"]},
    ):
        assert not run_pod(container, {}).decision.inject
        assert run_pod(container, via).decision.inject


# -- kvoffload wired by hand ----------------------------------------------------------------------
HAND_SIDECAR = {"name": "pool", "image": "ghcr.io/kvoffload/kvoffload:0.1.0",
                "command": ["kvoffload", "sidecar"], "args": ["--pool-size=8Gi"]}  # fmt: skip
RUN = "/kvoffload/run"
SERVE = {"name": "vllm", "image": "vllm/vllm-openai", "command": ["vllm", "serve", "m"]}


@pytest.mark.parametrize(
    ("spec", "text"),
    [
        ({"containers": [SERVE, HAND_SIDECAR]}, "already runs the kvoffload sidecar"),
        ({"containers": [{**SERVE, "volumeMounts": [{"name": "r", "mountPath": RUN}]}]},
         "already mounts /kvoffload/run"),
        ({"containers": [{**SERVE, "env": [{"name": "A", "value": "kvoffload_connector.x"}]}]},
         "already configures kvoffload_connector"),
    ],
)  # fmt: skip
def test_hand_wired_kvoffload_is_left_alone(spec: dict[str, Any], text: str) -> None:
    pod = {"metadata": {"name": "x"}, "spec": spec}
    result = inject_pod(pod, [POLICY])
    assert result.decision.reason is SkipReason.HAND_WIRED
    assert text in result.decision.message
    assert result.pod["spec"] == spec


# -- public deployment shapes (testdata/*.yaml with a `# source:` header) ----------------------
def _shape_cases() -> list[Path]:
    return sorted(
        p
        for p in TESTDATA.glob("*.yaml")
        if not p.name.endswith((".injected.yaml", ".policy.yaml"))
        and p.read_text().startswith("# source: ")
    )


def _expected(path: Path) -> tuple[str, str | None]:
    line = next(x for x in path.read_text().splitlines() if x.startswith("# expect:"))
    words = line.split(":", 1)[1].split()
    return words[0], (words[1] if len(words) > 1 else None)


def test_there_are_many_public_shapes() -> None:
    assert len(_shape_cases()) >= 20


@pytest.mark.parametrize("path", _shape_cases(), ids=lambda p: p.stem)
def test_public_shape_decision(path: Path) -> None:
    """Each shape's decision (the pure injector, no checks after it) is its `# expect:` line,
    and the header says where the shape comes from."""
    from kvoffload_operator.workloads import group_size, pod_templates

    head = path.read_text().split("\napiVersion", 1)[0]
    assert "http" in head.splitlines()[0], f"{path.name}: no source URL"
    verdict, reason = _expected(path)
    (policy,) = policies_from_documents(
        list(yaml.safe_load_all((TESTDATA / "policy.yaml").read_text()))
    )
    templates = [
        (doc, t)
        for doc in yaml.safe_load_all(path.read_text())
        if doc
        for _, t in pod_templates(doc)
    ]
    assert len(templates) == 1, path.name
    doc, template = templates[0]
    decision = inject_pod(template, [policy], group_size=group_size(doc)).decision
    if verdict == "inject":
        assert decision.inject, decision.message
    else:
        assert decision.reason is not None and decision.reason.value == reason, decision.message
        assert decision.message


@pytest.mark.vllm
def test_vllms_own_run_batch_parser_reads_the_injected_config() -> None:
    """`vllm run-batch` takes the engine's arguments (AsyncEngineArgs), ours among them."""
    run_batch = pytest.importorskip("vllm.entrypoints.cli.run_batch")
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    sub = parser.add_subparsers(dest="subparser")
    for cmd in run_batch.cmd_init():
        cmd.subparser_init(sub)
    result = run({"command": ["vllm", "run-batch", "-i", "in.jsonl", "-o", "out.jsonl"],
                  "args": ["--model", "facebook/opt-125m"]})  # fmt: skip
    ns = parser.parse_args(engine_argv(result)[1:])
    assert ns.kv_transfer_config.kv_connector == "KVOffloadConnector"
    assert (ns.input_file, ns.model) == ("in.jsonl", "facebook/opt-125m")
