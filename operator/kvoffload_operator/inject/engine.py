"""Where a container starts the vLLM engine, and what in it conflicts with ours (pure).

A container's engine site is one of:
- ``argv``: the engine is the process (``vllm serve|run-batch``, ``vllm bench
  throughput|latency``, ``python -m vllm.entrypoints...``, KServe's huggingfaceserver with
  ``--backend vllm``), possibly behind an exec wrapper (``tini --``, Argo's ``argoexec emissary
  --``, ``env``), or the entrypoint of a vLLM image (no ``command``): our flag is appended to
  ``args``;
- ``shell``: ``sh -c "<script>"`` with exactly one engine invocation in the script: the
  ``--kv-transfer-config <json>`` goes right after that invocation's words, quoted for every
  parse the text goes through (an ``eval "exec vllm serve …"`` parses it twice: `shell`).
What the injector cannot see into is a precise skip, never a guess: a script file or an image
entrypoint it does not know (``opaque-entrypoint``), a ``--config`` file (``config-file``),
huggingfaceserver's ``--backend auto`` (``backend-auto``). So are a client without an engine
(``vllm bench serve``), several engines in one script, settings that would configure KV transfer
or another KV cache twice, a pod that already wires kvoffload by hand, and an engine whose other
ranks run in other pods (multi-node: pool regions are per pod).
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from kvoffload_operator.inject import shell

SHELLS = shell.SHELLS
# vllm subcommands that run an engine in this process (bench throughput/latency: offline engine)
ENGINE_SUBCOMMANDS = (
    ("serve",),
    ("run-batch",),
    ("bench", "throughput"),
    ("bench", "latency"),
)
# args-only containers whose flags look like the engine's: a hint that the container is vLLM's,
# never proof (the image's entrypoint decides what reads them)
ENGINE_FLAGS = frozenset(
    {
        "--model",
        "--tensor-parallel-size",
        "--pipeline-parallel-size",
        "--max-model-len",
        "--gpu-memory-utilization",
        "--served-model-name",
        "--max-num-seqs",
        "--enable-prefix-caching",
    }
)
# exec wrappers that run the rest of their argv: (basename, runs what follows "--" only)
WRAPPERS = {"tini": False, "dumb-init": False, "env": False, "argoexec": True, "launch": True}
LWS_SIZE_ANNOTATION = "leaderworkerset.sigs.k8s.io/size"
RAY_NODE_TYPE_LABEL = "ray.io/node-type"
ENV_VAR = "KVOFFLOAD_KV_TRANSFER_CONFIG"  # `inject-via: env`: the script passes it to vllm itself
KVOFFLOAD_DIR = "/kvoffload"

_PY = r"(?:[\w./-]*/)?python[\d.]*(?:\s+-[A-Za-z]+)*\s+-m\s+"
_SUB = r"(?:serve|run-batch|bench\s+(?:throughput|latency))"
_ENGINE_RE = re.compile(
    r"(?<![\w.-])(?:"
    rf"(?:[\w./-]*/)?vllm\s+{_SUB}"
    rf"|{_PY}vllm\.entrypoints\.(?:openai\.)?(?:api_server|run_batch)"
    rf"|{_PY}vllm\.entrypoints\.cli\.main\s+{_SUB}"
    r")(?![\w.-])"
)
_CLIENT_RE = re.compile(
    rf"(?<![\w.-])(?:(?:[\w./-]*/)?vllm|{_PY}vllm\.entrypoints\.cli\.main)\s+bench\s+serve(?![\w-])"
)
# flags, and their keys in a --config YAML file the script writes (``kv-transfer-config: ...``)
_KV_TRANSFER_RE = re.compile(
    r"--kv[-_]transfer[-_]config(?![\w-])|\bkv_connector\b|--kv-connector"
    r"|(?<![\w-])kv[-_]transfer[-_]config\s*:"
)
_KV_OFFLOAD_RE = re.compile(
    r"--kv[-_]offloading[-_](?:size|backend)(?![\w-])|(?<![\w-])kv[-_]offloading[-_]size\s*:"
)
_CONFIG_RE = re.compile(r"(?<![\w-])--config(?:=|\s+)(['\"]?)([^\s'\";&|]+)\1")
_KVOFFLOAD_RE = re.compile(r"kvoffload_connector|KVOffloadConnector")
_MULTI_NODE_RE = re.compile(
    r"LWS_GROUP_SIZE|ray_cluster_size|multi-node-serving\.sh|\bray\s+start\b[^\n;&|]*--address"
)
_NNODES_RE = re.compile(r"--nnodes[=\s]+(\d+)")
_FALSY = frozenset({"", "0", "false", "no", "off"})

# Environment that turns on another stack's KV cache or KV transfer (each with its source):
# (name or prefix, whether a prefix, whether only a truthy value counts, what it is)
OTHER_KV_ENV: tuple[tuple[str, bool, bool, str], ...] = (
    # AIBrix's vLLM fork: Vineyard KV cache (samples/kvcache/vineyard in vllm-project/aibrix)
    ("VLLM_USE_VINEYARD_CACHE", False, True, "AIBrix's Vineyard KV cache"),
    ("VINEYARD_CACHE_", True, False, "AIBrix's Vineyard KV cache"),
    ("AIBRIX_LLM_KV_CACHE", True, False, "AIBrix's distributed KV cache"),
    # AIBrix KV cache offloading framework (python/aibrix_kvcache: AIBRIX_KV_CACHE_OL_*)
    ("AIBRIX_KV_CACHE_OL_", True, False, "AIBrix's KV cache offloading"),
    # LMCache's configuration by environment (LMCACHE_LOCAL_CPU, LMCACHE_CONFIG_FILE, ...)
    ("LMCACHE_", True, False, "LMCache's KV cache"),
    # NVIDIA Dynamo's KV block manager (DYN_KVBM_CPU_CACHE_GB, DYN_KVBM_DISK_CACHE_GB)
    ("DYN_KVBM_", True, False, "Dynamo's KV block manager (KVBM)"),
    # vLLM's NixlConnector side channel (vllm/envs.py), set by llm-d's P/D pods
    ("VLLM_NIXL_SIDE_CHANNEL_", True, False, "vLLM's NIXL KV transfer"),
    # Mooncake's transfer engine and store (vllm/envs.py VLLM_MOONCAKE_*, MOONCAKE_CONFIG_PATH)
    ("VLLM_MOONCAKE_", True, False, "Mooncake KV transfer"),
    ("MOONCAKE_", True, False, "Mooncake KV transfer"),
)
# LMCACHE_* names that configure nothing by themselves (KServe's huggingfaceserver runtime sets
# LMCACHE_USE_EXPERIMENTAL on every pod; LMCache runs only once a connector loads it)
NEUTRAL_ENV = frozenset({"LMCACHE_USE_EXPERIMENTAL", "LMCACHE_LOG_LEVEL", "LMCACHE_TRACK_USAGE"})


class Problem(str, Enum):
    """Why a container cannot take our flag (mapped onto `SkipReason` by `decide`)."""

    NO_ENGINE = "no-engine"
    SHELL_WRAPPER = "shell-wrapper"
    OPAQUE_ENTRYPOINT = "opaque-entrypoint"
    CONFIG_FILE = "config-file"
    BACKEND_AUTO = "backend-auto"
    HAS_KV_TRANSFER_CONFIG = "has-kv-transfer-config"
    HAS_KV_OFFLOADING = "has-kv-offloading"
    OTHER_KV_CACHE = "other-kv-cache"
    HAND_WIRED = "hand-wired"
    MULTI_NODE = "multi-node"

    @property
    def overridable(self) -> bool:
        """Problems of not seeing what runs, which the user may settle (``inject-via``); the
        others are settings that would clash whatever the user says."""
        return self in (
            Problem.SHELL_WRAPPER,
            Problem.OPAQUE_ENTRYPOINT,
            Problem.CONFIG_FILE,
            Problem.BACKEND_AUTO,
        )


@dataclass(frozen=True)
class ShellEdit:
    """Insert our flag into the script word ``argv(container)[word]`` at character ``offset``,
    quoted for ``parse`` (how many shell parses the text goes through)."""

    word: int
    offset: int
    parse: shell.Parse = shell.Parse.ONCE


@dataclass(frozen=True)
class EnvEdit:
    """Put our config in the container's environment as ``name`` (the user's script passes it)."""

    name: str = ENV_VAR


Edit = ShellEdit | EnvEdit | None  # None: append ``--kv-transfer-config=<json>`` to args


@dataclass(frozen=True)
class Site:
    """The outcome for one container: an engine site (``edit`` None: append to args) or not
    (``problem`` set when the container is, or may be, vLLM's and why it cannot be injected)."""

    engine: bool
    edit: Edit = None
    problem: Problem | None = None
    message: str = ""


NOT_VLLM = Site(False)


def argv(container: Mapping[str, Any]) -> list[str]:
    return [str(a) for a in (container.get("command") or [])] + [
        str(a) for a in (container.get("args") or [])
    ]


def unwrap(words: Sequence[str]) -> int:
    """Index of the real program in ``words`` past exec wrappers (``tini --``, ``env A=b``,
    Argo's ``argoexec emissary … --``, Kubeflow's ``launch … --``), 0 when there are none."""
    i = 0
    while i < len(words):
        base = posixpath.basename(words[i])
        if base not in WRAPPERS:
            return i
        rest = list(words[i + 1 :])
        if WRAPPERS[base]:
            if "--" not in rest:
                return i
            i += rest.index("--") + 2
            continue
        j = i + 1
        while j < len(words) and (words[j].startswith("-") or (base == "env" and "=" in words[j])):
            j += 1
            if words[j - 1] == "--":
                break
        i = j
    return i


def shell_script(container: Mapping[str, Any]) -> int | None:
    """Index in `argv` of the script of ``sh -c "<script>"`` (also ``-ec``, ``-lc``), or None."""
    words = argv(container)
    start = unwrap(words)
    if start >= len(words) or posixpath.basename(words[start]) not in SHELLS:
        return None
    for i, w in enumerate(words[start + 1 :], start + 1):
        if w.startswith("-") and not w.startswith("--") and "c" in w:
            return i + 1 if i + 1 < len(words) else None
        if not w.startswith("-"):
            return None  # `bash script.sh`: a script file
    return None


def _who(container: Mapping[str, Any]) -> str:
    return f"container {container['name']!r}" if container.get("name") else "the pod"


def _vllm_subcommand(container: Mapping[str, Any], rest: list[str]) -> Site:
    if tuple(rest[:1]) in ENGINE_SUBCOMMANDS or tuple(rest[:2]) in ENGINE_SUBCOMMANDS:
        return Site(True)
    what = " ".join(rest[:2]) or "(no subcommand)"
    return Site(
        False,
        problem=Problem.NO_ENGINE,
        message=f"{_who(container)} runs `vllm {what}`, which runs no vLLM engine",
    )


def _image_repo(container: Mapping[str, Any]) -> str:
    return str(container.get("image", "")).split("@")[0].rsplit("/", 1)[-1].split(":")[0]


def _image_is_vllm(container: Mapping[str, Any]) -> bool:
    return "vllm" in _image_repo(container)


def _flag_value(words: Sequence[str], flag: str) -> str | None:
    """The last value given for ``flag`` (``--flag v`` or ``--flag=v``; ``_``/``-`` alike)."""
    names = {flag, flag.replace("-", "_").replace("__", "--")}
    value = None
    for i, w in enumerate(words):
        name, eq, v = w.partition("=")
        if name in names:
            value = v if eq else (words[i + 1] if i + 1 < len(words) else "")
    return value


def _huggingfaceserver(container: Mapping[str, Any], words: list[str]) -> Site:
    """KServe's huggingfaceserver: with the vLLM backend it builds vLLM's parser
    (``make_arg_parser``) and ``AsyncEngineArgs.from_cli_args``, so our flag reaches the engine;
    with ``--backend huggingface`` there is no vLLM; ``auto`` (the default) chooses at start."""
    who = _who(container)
    backend = (_flag_value(words, "--backend") or "auto").strip().lower()
    if backend == "vllm":
        return Site(True)
    if backend == "huggingface":
        return Site(
            False,
            problem=Problem.NO_ENGINE,
            message=f"{who} runs KServe's huggingfaceserver with --backend huggingface "
            "(Hugging Face transformers), which runs no vLLM engine",
        )
    return Site(
        False,
        problem=Problem.BACKEND_AUTO,
        message=f"{who} runs KServe's huggingfaceserver with --backend {backend}: it uses vLLM "
        "only when vLLM supports the model's architecture, found out at start, and the Hugging "
        "Face backend would refuse --kv-transfer-config as an unknown argument; set "
        "--backend=vllm to get kvoffload",
    )


def _shell_site(container: Mapping[str, Any], index: int) -> Site:
    script = argv(container)[index]
    ctx = shell.contexts(script)
    text = shell.blank_reads(script)
    who = _who(container)
    runs, data = [], 0
    for m in _ENGINE_RE.finditer(text):
        parse = shell.consumer(script, m.start(), ctx)
        if parse is None or ctx[m.end()] != ctx[m.start()]:
            data += 1  # quoted text for another command (echo, grep), or quoting not followed
            continue
        runs.append((m, parse))
    if len(runs) == 1:
        m, parse = runs[0]
        return Site(True, edit=ShellEdit(index, m.end(), parse))
    if len(runs) > 1:
        return Site(
            False,
            problem=Problem.SHELL_WRAPPER,
            message=f"{who} starts {len(runs)} vLLM engines in one shell script; which one to "
            "configure is ambiguous",
        )
    if data:
        return Site(
            False,
            problem=Problem.SHELL_WRAPPER,
            message=f"{who} has a vLLM engine invocation only inside a quoted string that is "
            "not handed to `eval` or `sh -c` (or nested deeper than one level), so where it "
            "runs and how it is parsed cannot be told",
        )
    if _CLIENT_RE.search(text):
        return Site(
            False,
            problem=Problem.NO_ENGINE,
            message=f"{who} runs `vllm bench serve`, a client with no engine",
        )
    if "vllm" in text:
        return Site(
            False,
            problem=Problem.SHELL_WRAPPER,
            message=f"{who} mentions vllm in a shell script but no engine invocation "
            "(`vllm serve`, `python -m vllm.entrypoints...`) was recognised",
        )
    return NOT_VLLM


def _looks_like_vllm(container: Mapping[str, Any]) -> bool:
    args = {str(a).split("=", 1)[0] for a in container.get("args") or []}
    name = str(container.get("name", ""))
    return (
        "vllm" in name
        or _image_is_vllm(container)
        or bool(ENGINE_FLAGS & args)
        or any("vllm" in w for w in argv(container))
    )


def _opaque(
    container: Mapping[str, Any], words: list[str], volumes: Mapping[str, str], named: bool
) -> Site:
    """A container that may run vLLM through something the injector cannot read."""
    who = _who(container)
    if not container.get("command"):
        what = f"its image's entrypoint ({container.get('image', '?')}, not a known vLLM image)"
    else:
        what = f"`{words[unwrap(words)] if words else '?'}`"
        exe = words[unwrap(words)] if words else ""
        for mount in container.get("volumeMounts") or []:
            path = str(mount.get("mountPath", "")).rstrip("/")
            if path and exe.startswith(path + "/") and mount.get("name") in volumes:
                what += f", a script from {volumes[str(mount['name'])]}"
                break
    lead = "is named as the vLLM container, but" if named else "looks like vLLM's, but"
    return Site(
        False,
        problem=Problem.OPAQUE_ENTRYPOINT,
        message=f"{who} {lead} runs {what}, which the injector cannot see into: where "
        "--kv-transfer-config would go, and whether vLLM would read it, is unknown. If it "
        'passes its arguments on to vllm ("$@"), set kvoffload.io/inject-via: args; if it '
        f"passes ${ENV_VAR} as --kv-transfer-config, set kvoffload.io/inject-via: env",
    )


def engine_site(
    container: Mapping[str, Any], named: bool = False, volumes: Mapping[str, str] | None = None
) -> Site:
    """Where ``container`` starts the engine. ``named``: the user named it as the vLLM
    container, so anything unrecognised is an `OPAQUE_ENTRYPOINT` (not "not vLLM").
    ``volumes``: the pod's volume names → what they are (``ConfigMap 'x'``), for messages."""
    script = shell_script(container)
    if script is not None:
        site = _shell_site(container, script)
        if site is NOT_VLLM and named:
            return _opaque(container, argv(container), volumes or {}, named)
        return site
    words = argv(container)
    start = unwrap(words)
    prog = words[start:]
    if prog and not prog[0].startswith("-"):
        exe = posixpath.basename(prog[0])
        if exe == "vllm":
            return _vllm_subcommand(container, prog[1:])
        if exe.startswith("python") and "-m" in prog:
            at = prog.index("-m") + 1
            module = prog[at] if at < len(prog) else ""
            if module == "vllm.entrypoints.cli.main":
                return _vllm_subcommand(container, prog[at + 1 :])
            if module.startswith("vllm.entrypoints"):
                return Site(True)
            if module == "huggingfaceserver":
                return _huggingfaceserver(container, prog[at + 1 :])
    if not container.get("command"):
        if "huggingfaceserver" in _image_repo(container):
            return _huggingfaceserver(container, words)
        if _image_is_vllm(container):
            return Site(True)  # the image's entrypoint is vLLM's server
    if named or _looks_like_vllm(container):
        return _opaque(container, words, volumes or {}, named)
    return NOT_VLLM


def env_names(container: Mapping[str, Any]) -> list[str]:
    return [str(e.get("name")) for e in container.get("env") or [] if e.get("name")]


def _env_values(container: Mapping[str, Any]) -> dict[str, str]:
    return {
        str(e.get("name")): str(e.get("value", ""))
        for e in container.get("env") or []
        if "value" in e
    }


def _texts(container: Mapping[str, Any]) -> list[str]:
    """What configures the engine: argv (shell scripts without comments and tests), env values."""
    words = argv(container)
    script = shell_script(container)
    if script is not None:
        words[script] = shell.blank_reads(words[script])
    return [*words, *_env_values(container).values()]


def other_kv_env(container: Mapping[str, Any]) -> Site | None:
    """A skip when the environment turns on another stack's KV cache (`OTHER_KV_ENV`)."""
    values = _env_values(container)
    for name in env_names(container):
        if name in NEUTRAL_ENV:
            continue
        for key, prefix, truthy, what in OTHER_KV_ENV:
            if not (name.startswith(key) if prefix else name == key):
                continue
            if truthy and values.get(name, "1").strip().lower() in _FALSY:
                continue
            return Site(
                False,
                problem=Problem.OTHER_KV_CACHE,
                message=f"{_who(container)} sets {name} ({what}): kvoffload beside another KV "
                "cache would keep the same blocks twice and fight over loads",
            )
    return None


def conflicts(container: Mapping[str, Any]) -> Site | None:
    """A skip when the container already configures KV transfer, offloading or another KV
    cache (args, shell text or env), else None: two connectors, or ours beside vLLM's own
    offloading, would fight."""
    who = _who(container)
    env = _env_values(container)
    texts = _texts(container)
    for pattern, problem, what in (
        (_KV_TRANSFER_RE, Problem.HAS_KV_TRANSFER_CONFIG, "already configures a KV connector"),
        (_KV_OFFLOAD_RE, Problem.HAS_KV_OFFLOADING, "already uses vLLM's KV offloading"),
    ):
        for text in texts:
            m = pattern.search(text)
            if m:
                return Site(False, problem=problem, message=f"{who} {what} ({m.group(0)})")
    simple = env.get("VLLM_USE_SIMPLE_KV_OFFLOAD")
    if simple is not None and simple.strip().lower() not in _FALSY:
        return Site(
            False,
            problem=Problem.HAS_KV_OFFLOADING,
            message=f"{who} sets VLLM_USE_SIMPLE_KV_OFFLOAD={simple}",
        )
    connector_env = sorted(
        k for k in env_names(container) if "KV_CONNECTOR" in k or "KV_TRANSFER" in k
    )
    if connector_env:
        return Site(
            False,
            problem=Problem.HAS_KV_TRANSFER_CONFIG,
            message=f"{who} sets {connector_env[0]}",
        )
    return other_kv_env(container)


def _config_path(container: Mapping[str, Any]) -> tuple[str, str] | None:
    """(path, the text it was found in) of vLLM's ``--config FILE``, or None."""
    words = argv(container)
    script = shell_script(container)
    if script is not None:
        text = shell.blank_reads(words[script])
        m = _CONFIG_RE.search(text)
        return (m.group(2), text) if m else None
    for i, w in enumerate(words):
        if w == "--config" and i + 1 < len(words):
            return words[i + 1], ""
        if w.startswith("--config="):
            return w.split("=", 1)[1], ""
    return None


def config_file(container: Mapping[str, Any]) -> Site | None:
    """A skip when vLLM reads a ``--config`` YAML file the pod spec does not carry: it may set
    ``kv-transfer-config`` or ``kv-offloading-*``, and a flag on the command line would silently
    replace what it says (vLLM: command line > config file > defaults). A file the script
    writes itself was read with the script (`conflicts`)."""
    found = _config_path(container)
    if found is None:
        return None
    path, text = found
    if text and re.search(rf"(?:>\s*|\btee\s+(?:-a\s+)?){re.escape(path)}", text):
        return None
    return Site(
        False,
        problem=Problem.CONFIG_FILE,
        message=f"{_who(container)} starts vLLM with --config {path}, a file not in the pod "
        "spec (a ConfigMap?): it may already set kv-transfer-config or kv-offloading, which "
        "a flag on the command line would silently replace. If it sets neither, set "
        "kvoffload.io/inject-via: args",
    )


def hand_wired(pod: Mapping[str, Any], container: Mapping[str, Any] | None) -> Site | None:
    """A skip when the pod already runs kvoffload without the injector (README: ``kvoffload
    sidecar`` beside vLLM, the connector configured by flag, env or ``--config``): a second
    sidecar and the same mount paths twice would make the API server reject the pod."""
    spec = pod.get("spec") or {}
    for c in (spec.get("initContainers") or []) + (spec.get("containers") or []):
        words = argv(c)
        image = str(c.get("image", "")).split("@")[0].rsplit(":", 1)[0]
        runs_sidecar = any(
            posixpath.basename(w) == "kvoffload" and words[i + 1 : i + 2] == ["sidecar"]
            for i, w in enumerate(words)
        )
        if runs_sidecar or image.endswith("/kvoffload") or image == "kvoffload":
            return Site(
                False,
                problem=Problem.HAND_WIRED,
                message=f"{_who(c)} already runs the kvoffload sidecar "
                f"({' '.join(words[:2]) or image}): the pod wires kvoffload by hand",
            )
    targets = [container] if container is not None else list(spec.get("containers") or [])
    for c in targets:
        for mount in c.get("volumeMounts") or []:
            path = str(mount.get("mountPath", ""))
            if path == KVOFFLOAD_DIR or path.startswith(KVOFFLOAD_DIR + "/"):
                return Site(
                    False,
                    problem=Problem.HAND_WIRED,
                    message=f"{_who(c)} already mounts {path}: the pod wires kvoffload by hand",
                )
        for text in _texts(c):
            m = _KVOFFLOAD_RE.search(text)
            if m:
                return Site(
                    False,
                    problem=Problem.HAND_WIRED,
                    message=f"{_who(c)} already configures {m.group(0)}: the pod wires "
                    "kvoffload by hand",
                )
    return None


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
        text = "\n".join(_texts(container)[: len(argv(container))])
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


def insert_flag(container: dict[str, Any], edit: Edit, flag: str, value: str) -> None:
    """Add ``flag value`` to ``container`` in place: appended to args, into the shell script
    (quoted for the parses it goes through), or as an env var the user's script passes on."""
    if isinstance(edit, EnvEdit):
        env = [e for e in container.get("env") or [] if e.get("name") != edit.name]
        container["env"] = [*env, {"name": edit.name, "value": value}]
        return
    if edit is None:
        container["args"] = [*(container.get("args") or []), f"{flag}={value}"]
        return
    n_command = len(container.get("command") or [])
    in_command = edit.word < n_command
    key, index = ("command", edit.word) if in_command else ("args", edit.word - n_command)
    words = [str(w) for w in container[key]]
    script = words[index]
    text = shell.flag_text(edit.parse, flag, value)
    words[index] = f"{script[: edit.offset]}{text}{script[edit.offset :]}"
    container[key] = words
