"""Where a container starts the vLLM engine, and what in it conflicts with ours (pure).

A container's engine site is one of:
- ``argv``: the engine is the process (``vllm serve``, ``vllm bench throughput|latency``,
  ``python -m vllm.entrypoints.openai.api_server``, ``python -m vllm.entrypoints.cli.main serve``)
  or the image's entrypoint (no ``command``; a vllm image, or args that are vLLM engine flags):
  our flag is appended to ``args``;
- ``shell``: ``sh -c "<script>"`` with exactly one engine invocation in the script: the
  shlex-quoted ``--kv-transfer-config <json>`` goes right after that invocation's words (the end of
  the command is unknowable in shell text: pipes, ``&&``, line continuations, ``"$@"``).
Everything else is a precise skip: a client without an engine (``vllm bench serve``), a script
with several engine invocations, settings that would configure KV transfer twice, or an engine
whose other ranks run in other pods (multi-node: pool regions are per pod).
"""

from __future__ import annotations

import posixpath
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

SHELLS = frozenset({"sh", "bash", "dash", "ash", "zsh", "busybox"})
# vllm subcommands that run an engine in this process (bench throughput/latency: offline engine)
ENGINE_SUBCOMMANDS = (("serve",), ("bench", "throughput"), ("bench", "latency"))
# args-only containers whose first flags look like the engine's (the image's entrypoint runs it)
ENGINE_FLAGS = frozenset(
    {
        "--model",
        "--tensor-parallel-size",
        "--pipeline-parallel-size",
        "--max-model-len",
        "--gpu-memory-utilization",
        "--served-model-name",
        "--dtype",
        "--max-num-seqs",
        "--enable-prefix-caching",
    }
)
LWS_SIZE_ANNOTATION = "leaderworkerset.sigs.k8s.io/size"
RAY_NODE_TYPE_LABEL = "ray.io/node-type"

_PY = r"(?:[\w./-]*/)?python[\d.]*(?:\s+-[A-Za-z]+)*\s+-m\s+"
_ENGINE_RE = re.compile(
    r"(?<![\w.-])(?:"
    r"(?:[\w./-]*/)?vllm\s+(?:serve|bench\s+(?:throughput|latency))"
    rf"|{_PY}vllm\.entrypoints\.openai\.api_server"
    rf"|{_PY}vllm\.entrypoints\.cli\.main\s+(?:serve|bench\s+(?:throughput|latency))"
    r")(?![\w.-])"
)
_CLIENT_RE = re.compile(
    rf"(?<![\w.-])(?:(?:[\w./-]*/)?vllm|{_PY}vllm\.entrypoints\.cli\.main)\s+bench\s+serve(?![\w-])"
)
_KV_TRANSFER_RE = re.compile(r"--kv[-_]transfer[-_]config(?![\w-])|\bkv_connector\b|--kv-connector")
_KV_OFFLOAD_RE = re.compile(r"--kv[-_]offloading[-_](?:size|backend)(?![\w-])")
_MULTI_NODE_RE = re.compile(
    r"LWS_GROUP_SIZE|ray_cluster_size|multi-node-serving\.sh|\bray\s+start\b[^\n;&|]*--address"
)
_NNODES_RE = re.compile(r"--nnodes[=\s]+(\d+)")
_FALSY = frozenset({"", "0", "false", "no", "off"})


class Problem(str, Enum):
    """Why a container cannot take our flag (mapped onto `SkipReason` by `decide`)."""

    NO_ENGINE = "no-engine"
    SHELL_WRAPPER = "shell-wrapper"
    HAS_KV_TRANSFER_CONFIG = "has-kv-transfer-config"
    HAS_KV_OFFLOADING = "has-kv-offloading"
    MULTI_NODE = "multi-node"


@dataclass(frozen=True)
class ShellEdit:
    """Insert our flag into the script word ``argv(container)[word]`` at character ``offset``."""

    word: int
    offset: int


@dataclass(frozen=True)
class Site:
    """The outcome for one container: an engine site (``edit`` None: append to args) or not."""

    engine: bool
    edit: ShellEdit | None = None
    problem: Problem | None = None
    message: str = ""


NOT_VLLM = Site(False)


def argv(container: Mapping[str, Any]) -> list[str]:
    return [str(a) for a in (container.get("command") or [])] + [
        str(a) for a in (container.get("args") or [])
    ]


def shell_script(container: Mapping[str, Any]) -> int | None:
    """Index in `argv` of the script of ``sh -c "<script>"`` (also ``-ec``, ``-lc``), or None."""
    words = argv(container)
    if not words or posixpath.basename(words[0]) not in SHELLS:
        return None
    for i, w in enumerate(words[1:], 1):
        if w.startswith("-") and not w.startswith("--") and "c" in w:
            return i + 1 if i + 1 < len(words) else None
    return None


def _vllm_subcommand(rest: list[str]) -> Site:
    if tuple(rest[:1]) in ENGINE_SUBCOMMANDS or tuple(rest[:2]) in ENGINE_SUBCOMMANDS:
        return Site(True)
    what = " ".join(rest[:2]) or "(no subcommand)"
    return Site(False, problem=Problem.NO_ENGINE, message=f"`vllm {what}` runs no vLLM engine")


def _image_is_vllm(container: Mapping[str, Any]) -> bool:
    repo = str(container.get("image", "")).split("@")[0].rsplit("/", 1)[-1].split(":")[0]
    return "vllm" in repo


def _shell_site(container: Mapping[str, Any], index: int) -> Site:
    script = argv(container)[index]
    engines = list(_ENGINE_RE.finditer(script))
    name = container.get("name")
    if len(engines) == 1:
        return Site(True, edit=ShellEdit(index, engines[0].end()))
    if len(engines) > 1:
        return Site(
            False,
            problem=Problem.SHELL_WRAPPER,
            message=f"container {name!r} starts {len(engines)} vLLM engines in one shell "
            "script; which one to configure is ambiguous",
        )
    if _CLIENT_RE.search(script):
        return Site(
            False,
            problem=Problem.NO_ENGINE,
            message=f"container {name!r} runs `vllm bench serve`, a client with no engine",
        )
    if "vllm" in script:
        return Site(
            False,
            problem=Problem.SHELL_WRAPPER,
            message=f"container {name!r} mentions vllm in a shell script but no engine "
            "invocation (`vllm serve`, `python -m vllm.entrypoints...`) was recognised",
        )
    return NOT_VLLM


def engine_site(container: Mapping[str, Any], named: bool = False) -> Site:
    """Where ``container`` starts the engine. ``named``: the user named it as the vLLM container,
    so an unrecognised command still takes the flag appended."""
    script = shell_script(container)
    if script is not None:
        return _shell_site(container, script)
    words = argv(container)
    if words and not words[0].startswith("-"):
        exe = posixpath.basename(words[0])
        if exe == "vllm":
            return _vllm_subcommand(words[1:])
        if exe.startswith("python") and "-m" in words:
            at = words.index("-m") + 1
            module = words[at] if at < len(words) else ""
            if module == "vllm.entrypoints.cli.main":
                return _vllm_subcommand(words[at + 1 :])
            if module.startswith("vllm.entrypoints"):
                return Site(True)
    if not container.get("command"):
        args = [str(a).split("=", 1)[0] for a in container.get("args") or []]
        if _image_is_vllm(container) or ENGINE_FLAGS & set(args):
            return Site(True)  # the image's entrypoint runs the engine
    if named or container.get("name") == "vllm":
        return Site(True)
    return NOT_VLLM


def _env_values(container: Mapping[str, Any]) -> dict[str, str]:
    return {
        str(e.get("name")): str(e.get("value", ""))
        for e in container.get("env") or []
        if "value" in e
    }


def conflicts(container: Mapping[str, Any]) -> Site | None:
    """A skip when the container already configures KV transfer or offloading (args, shell
    text or env), else None: two connectors, or ours beside vLLM's own offloading, would fight."""
    name = container.get("name")
    env = _env_values(container)
    texts = [*argv(container), *env.values()]
    for pattern, problem, what in (
        (_KV_TRANSFER_RE, Problem.HAS_KV_TRANSFER_CONFIG, "already configures a KV connector"),
        (_KV_OFFLOAD_RE, Problem.HAS_KV_OFFLOADING, "already uses vLLM's KV offloading"),
    ):
        for text in texts:
            m = pattern.search(text)
            if m:
                message = f"container {name!r} {what} ({m.group(0)})"
                return Site(False, problem=problem, message=message)
    simple = env.get("VLLM_USE_SIMPLE_KV_OFFLOAD")
    if simple is not None and simple.strip().lower() not in _FALSY:
        return Site(
            False,
            problem=Problem.HAS_KV_OFFLOADING,
            message=f"container {name!r} sets VLLM_USE_SIMPLE_KV_OFFLOAD={simple}",
        )
    connector_env = sorted(k for k in env if "KV_CONNECTOR" in k or "KV_TRANSFER" in k)
    if connector_env:
        return Site(
            False,
            problem=Problem.HAS_KV_TRANSFER_CONFIG,
            message=f"container {name!r} sets {connector_env[0]}",
        )
    return None


def _who(container: Mapping[str, Any]) -> str:
    return f"container {container['name']!r}" if container.get("name") else "the pod"


def multi_node(
    pod: Mapping[str, Any], container: Mapping[str, Any], group_size: int | None
) -> Site | None:
    """A skip when the engine's other ranks run in other pods (LeaderWorkerSet groups, Ray
    clusters): pool regions are per pod, so ranks elsewhere could never share this pod's pool."""
    meta = pod.get("metadata") or {}
    size = group_size
    raw = (meta.get("annotations") or {}).get(LWS_SIZE_ANNOTATION)
    if size is None and raw is not None and str(raw).isdigit():
        size = int(raw)
    env_size = _env_values(container).get("LWS_GROUP_SIZE", "")
    if size is None and env_size.isdigit():
        size = int(env_size)
    why = None
    if size is not None and size > 1:
        why = f"a group of {size} pods (LeaderWorkerSet)"
    elif (meta.get("labels") or {}).get(RAY_NODE_TYPE_LABEL):
        why = "a Ray cluster node (label ray.io/node-type)"
    else:
        text = "\n".join(argv(container))
        m = _MULTI_NODE_RE.search(text)
        nnodes = _NNODES_RE.search(text)
        if m:
            why = f"a multi-node launcher ({m.group(0)})"
        elif nnodes and int(nnodes.group(1)) > 1:
            why = f"--nnodes {nnodes.group(1)}"
    if why is None:
        return None
    return Site(
        False,
        problem=Problem.MULTI_NODE,
        message=f"{_who(container)} is part of {why}: the engine's other ranks run in other "
        "pods, and pool regions are per pod",
    )


def insert_flag(container: dict[str, Any], edit: ShellEdit | None, flag: str, value: str) -> None:
    """Add ``flag value`` to ``container`` in place: appended to args, or into the shell script."""
    if edit is None:
        container["args"] = [*(container.get("args") or []), f"{flag}={value}"]
        return
    n_command = len(container.get("command") or [])
    in_command = edit.word < n_command
    key, index = ("command", edit.word) if in_command else ("args", edit.word - n_command)
    words = [str(w) for w in container[key]]
    script = words[index]
    words[index] = f"{script[: edit.offset]} {flag} {shlex.quote(value)}{script[edit.offset :]}"
    container[key] = words
