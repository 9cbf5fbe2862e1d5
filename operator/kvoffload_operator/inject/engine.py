"""Where a container starts the vLLM engine, and how our flag gets there (pure).

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
(``vllm bench serve``) and several engines in one script. What else in a pod conflicts with
ours: conflicts.py.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Mapping, Sequence
from typing import Any

from kvoffload_operator.inject import shell
from kvoffload_operator.inject.container import argv, shell_script, unwrap, who_of
from kvoffload_operator.inject.site import (
    ENV_VAR,
    NOT_VLLM,
    Edit,
    EnvEdit,
    Problem,
    ShellEdit,
    Site,
)

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


def _vllm_subcommand(container: Mapping[str, Any], rest: list[str]) -> Site:
    if tuple(rest[:1]) in ENGINE_SUBCOMMANDS or tuple(rest[:2]) in ENGINE_SUBCOMMANDS:
        return Site(True)
    what = " ".join(rest[:2]) or "(no subcommand)"
    return Site(
        False,
        problem=Problem.NO_ENGINE,
        message=f"{who_of(container)} runs `vllm {what}`, which runs no vLLM engine",
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
    who = who_of(container)
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
    who = who_of(container)
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
    who = who_of(container)
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
