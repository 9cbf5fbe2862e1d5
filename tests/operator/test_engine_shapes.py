"""Every entrypoint shape: injected where the engine starts, or skipped with a precise reason."""

from __future__ import annotations

import json
import shlex
from typing import Any

import pytest
from kvoffload_operator.inject import SkipReason, inject_pod
from kvoffload_operator.policy import policy_from_resource

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
    pytest.param({"args": ["--model", "m", "--tensor-parallel-size", "2"]}, id="args-engine-flags"),
    pytest.param({"args": ["vllm", "serve", "m"]}, id="args-are-argv"),
    pytest.param(
        {"command": ["sh", "-c", "vllm serve a"]},
        id="ray-single-node-free",
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


def test_every_skip_reason_is_listed_in_the_readme() -> None:
    from pathlib import Path

    readme = (Path(__file__).parents[2] / "README.md").read_text()
    missing = [r.value for r in SkipReason if r.annotated and f"`{r.value}`" not in readme]
    assert not missing, f"README.md lacks skip reasons: {missing}"


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
    serve = pytest.importorskip("vllm.entrypoints.cli.serve")
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
