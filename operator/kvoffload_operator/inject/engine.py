"""Where a container starts the vLLM engine, and how our flag gets there (pure).

A container's engine site is one of:
- ``argv``: the engine is the process (``vllm serve|run-batch``, ``vllm bench
  throughput|latency``, ``python -m vllm.entrypoints...``, KServe's huggingfaceserver with
  ``--backend vllm``), possibly behind an exec wrapper (``tini --``, Argo's ``argoexec emissary
  --``, ``env``), or the entrypoint of a vLLM image (no ``command``): our flag is appended to
  ``args``;
- ``shell``: ``sh -c "<script>"`` with exactly one engine invocation in the script: the
  ``--kv-transfer-config <json>`` goes right after that invocation's words, quoted for every
  parse the text goes through (an ``eval "exec vllm serve …"`` parses it twice: `shell`). A
  here-document's text is data, not an invocation, unless it may run (`shell.heredoc_runs`:
  then which engine is configured cannot be told);
- ``arguments``: ``sh -c 'exec "$@"' -- vllm serve …``, a script that runs its positional
  parameters (the words after ``$0``): those words are read as the engine's argv, and the flag
  goes into them as into any argv.
In an argv the flag is appended; where the engine's arguments hold a bare ``--`` it goes first
among them, right after ``vllm serve`` (after the ``--`` it would be a positional argument, and
argparse refuses a ``--`` left over after options: ``vllm serve m --kv-transfer-config=… --``
fails where ``vllm serve --kv-transfer-config=… m --`` parses).
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
    ArgvEdit,
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


def before_dashes(words: Sequence[str], first: int) -> ArgvEdit | None:
    """Where the flag goes in ``words`` whose engine arguments start at ``first``: first among
    them when they hold a bare ``--`` (before it and before any positional), else appended to
    args (None)."""
    return ArgvEdit(first) if "--" in words[first:] else None


def first_argument(container: Mapping[str, Any]) -> int:
    """Index in `argv` of the first word the program reads as its own argument: after the
    program past exec wrappers, after ``$0`` of a ``sh -c`` script, 0 with no ``command``
    (the image's entrypoint comes first)."""
    if not container.get("command"):
        return 0
    script = shell_script(container)
    return script + 2 if script is not None else unwrap(argv(container)) + 1


def append_edit(container: Mapping[str, Any]) -> ArgvEdit | None:
    """The edit that appends the flag to ``container``'s arguments (``inject-via: args``)."""
    return before_dashes(argv(container), first_argument(container))


def _engine(words: Sequence[str], first: int) -> Site:
    return Site(True, edit=before_dashes(words, first))


def _vllm_subcommand(container: Mapping[str, Any], rest: list[str], at: int) -> Site:
    """``rest``: the words after ``vllm`` (or its ``cli.main``), from ``argv[at]`` on."""
    if tuple(rest[:2]) in ENGINE_SUBCOMMANDS:
        return _engine(argv(container), at + 2)
    if tuple(rest[:1]) in ENGINE_SUBCOMMANDS:
        return _engine(argv(container), at + 1)
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


def _huggingfaceserver(container: Mapping[str, Any], words: list[str], first: int) -> Site:
    """KServe's huggingfaceserver: with the vLLM backend it builds vLLM's parser
    (``make_arg_parser``) and ``AsyncEngineArgs.from_cli_args``, so our flag reaches the engine;
    with ``--backend huggingface`` there is no vLLM; ``auto`` (the default) chooses at start."""
    who = who_of(container)
    backend = (_flag_value(words, "--backend") or "auto").strip().lower()
    if backend == "vllm":
        return _engine(argv(container), first)
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


def _shifted(edit: Edit, by: int) -> Edit:
    """An edit of the words ``argv[by:]`` as an edit of the whole argv."""
    if isinstance(edit, ArgvEdit):
        return ArgvEdit(edit.at + by)
    if isinstance(edit, ShellEdit):
        return ShellEdit(edit.word + by, edit.offset, edit.parse)
    return edit


def _arguments_site(container: Mapping[str, Any], index: int, changed: str | None) -> Site:
    """The site of the positional parameters that the script ``argv[index]`` runs (``exec
    "$@"``): the words after ``$0``, read as an argv of their own."""
    words = argv(container)
    who = who_of(container)
    if not any("vllm" in w for w in words[index:]):
        return NOT_VLLM
    if changed is not None:
        return Site(
            False,
            problem=Problem.SHELL_WRAPPER,
            message=f'{who} runs its arguments ("$@") after {changed} in the script, so which '
            "command they start cannot be told",
        )
    rest = words[index + 2 :]
    site = engine_site({"name": container.get("name"), "command": rest}) if rest else NOT_VLLM
    if site.engine or site.problem is not None:
        return Site(site.engine, _shifted(site.edit, index + 2), site.problem, site.message)
    zero = words[index + 1] if index + 1 < len(words) else "(none)"
    return Site(
        False,
        problem=Problem.SHELL_WRAPPER,
        message=f'{who} runs its arguments ("$@"), `{" ".join(rest)[:60]}`, which start no '
        f"vLLM engine: the first word after the script is $0 (`{zero}`), not an argument; "
        "put `--` or `sh` before the command",
    )


def _shell_site(container: Mapping[str, Any], index: int) -> Site:
    script = argv(container)[index]
    lexed = shell.lex(script)
    ctx = lexed.contexts
    docs = {d.op: d for d in lexed.heredocs}
    text = shell.blank_reads(script)
    who = who_of(container)
    runs, data = [], 0
    for m in _ENGINE_RE.finditer(text):
        here = ctx[m.start()]
        if here.state == shell.HEREDOC:
            doc = docs[here.opened_at]
            why = shell.heredoc_runs(script, doc, ctx)
            if why is None:
                continue  # text for a command that only reads it (cat <<EOF)
            return Site(
                False,
                problem=Problem.SHELL_WRAPPER,
                message=f"{who} has `{m.group(0)}` in a here-document (<<{doc.delimiter}) that "
                f"{why}: whether it starts another engine cannot be told",
            )
        parse = shell.consumer(script, m.start(), ctx)
        if parse is None or ctx[m.end()] != ctx[m.start()]:
            data += 1  # quoted text for another command (echo, grep), or quoting not followed
            continue
        runs.append((m, parse))
    engines = len(runs)
    arguments, changed = shell.runs_arguments(script, ctx)
    if arguments:  # `exec "$@"`: the words after $0 are a command of the script
        site = _arguments_site(container, index, changed)
        if site.engine and engines + arguments == 1:
            return site
        if site.engine:
            engines += arguments
        elif site.problem is not None and (changed is not None or not runs):
            return site
    if engines == 1:
        m, parse = runs[0]
        return Site(True, edit=ShellEdit(index, m.end(), parse))
    if engines > 1:
        return Site(
            False,
            problem=Problem.SHELL_WRAPPER,
            message=f"{who} starts {engines} vLLM engines in one shell script; which one to "
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
            return _vllm_subcommand(container, prog[1:], start + 1)
        if exe.startswith("python") and "-m" in prog:
            at = prog.index("-m") + 1
            module = prog[at] if at < len(prog) else ""
            if module == "vllm.entrypoints.cli.main":
                return _vllm_subcommand(container, prog[at + 1 :], start + at + 1)
            if module.startswith("vllm.entrypoints"):
                return _engine(words, start + at + 1)
            if module == "huggingfaceserver":
                return _huggingfaceserver(container, prog[at + 1 :], start + at + 1)
    if not container.get("command"):
        if "huggingfaceserver" in _image_repo(container):
            return _huggingfaceserver(container, words, 0)
        if _image_is_vllm(container):
            return _engine(words, 0)  # the image's entrypoint is vLLM's server
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
    if isinstance(edit, ArgvEdit):  # in command if the engine's arguments start there
        command = list(container.get("command") or [])
        key, at = (
            ("command", edit.at) if edit.at < len(command) else ("args", edit.at - len(command))
        )
        words = list(container.get(key) or [])
        container[key] = [*words[:at], f"{flag}={value}", *words[at:]]
        return
    n_command = len(container.get("command") or [])
    in_command = edit.word < n_command
    key, index = ("command", edit.word) if in_command else ("args", edit.word - n_command)
    words = [str(w) for w in container[key]]
    script = words[index]
    text = shell.flag_text(edit.parse, flag, value)
    words[index] = f"{script[: edit.offset]}{text}{script[edit.offset :]}"
    container[key] = words
