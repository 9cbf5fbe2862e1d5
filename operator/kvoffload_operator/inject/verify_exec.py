"""Run an injected vLLM container's command line against a stand-in engine (tests and
``kvoffload inject --verify``; never the webhook: see `verify` for why).

The container's ``command`` + ``args`` (with no command, the image's entrypoint: ``python3 -m
huggingfaceserver`` for KServe's huggingfaceserver, else ``vllm serve``), ``$(VAR)``-expanded
as the kubelet does with the container's env, run in the shell that will run them (``/bin/sh``
is dash here, ``bash`` is bash), with ``eval``, ``exec``, ``"$@"`` and scripts from ConfigMaps
of the input set all doing what they do in the pod. On ``PATH`` there are only stubs: ``vllm``
and ``python``/``python3`` record their argv as JSON (an engine invocation — ``vllm
serve|run-batch|bench throughput|latency``, ``python -m vllm.entrypoints...`` or ``python -m
huggingfaceserver`` — then ends the run), wrappers (``env``, ``nohup``, ``numactl``, ...) run
their command from the same stubs, and every other name the script mentions exits 0. The value
of the first engine invocation's ``--kv-transfer-config`` must be the policy's JSON, once.

What the run refuses to do (then the result is ``unverified``, never a failure): run a script
the input set does not contain, write outside its temp dir (a redirection to an absolute or
variable path), source a file from the host, run a shell other than dash or bash. Absolute paths
in scripts that name host programs are rewritten to stubs. As root the run drops to ``nobody``;
it always runs under a timeout, CPU and file-size limits, in an empty temp dir with a minimal
env. This guards against accidents in the user's own manifest, not against a hostile one.
"""

from __future__ import annotations

import json
import os
import posixpath
import re
import resource
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvoffload_operator.inject import engine as _engine
from kvoffload_operator.inject.container import WRAPPERS, unwrap
from kvoffload_operator.inject.verify import (
    Intent,
    check_value,
    container_env,
    kubelet_expand,
)

OK, FAILED, UNVERIFIED = "ok", "failed", "unverified"
ENTRYPOINT = ("vllm", "serve")  # what vLLM images run when a container has no command
# KServe's huggingfaceserver image (python/huggingface_server.Dockerfile) runs its module
HUGGINGFACESERVER = ("python3", "-m", "huggingfaceserver")
UNKNOWN = "kvoffload-verify-unknown"  # stands for env values from Secrets, ConfigMaps, fields
DEFAULT_TIMEOUT = 10.0
_NOBODY = 65534
_FLAG = re.compile(r"^--kv[-_]transfer[-_]config(=|$)")
_WORDS = re.compile(r"(?<![\w$.-])[A-Za-z_][\w.+-]*")
_ABS = re.compile(r"(?<![\w.$}/:-])/[\w.+@%-]+(?:/[\w.+@%-]+)*/?")
_PY = re.compile(r"^python[\d.]*$")
_SHELL_NAMES = {"sh": "dash", "dash": "dash", "ash": "dash", "bash": "bash"}
# exec wrappers: the stub runs their command (what follows "--" for the second group)
_AFTER_DASHES = tuple(n for n, dashes in WRAPPERS.items() if dashes)
_OWN_WRAPPERS = ["env", "nohup", "numactl", "taskset", "tini", "dumb-init", "nice", "stdbuf",
                 "timeout", "setsid", "gosu", "su-exec", "chrt", "ionice"]  # fmt: skip
_WRAPPERS = _OWN_WRAPPERS + [n for n in WRAPPERS if n not in set(_OWN_WRAPPERS)]
# builtins a script could use to reach outside the run: no-ops inside it
PRELUDE = (
    "cd() { return 0; }; pushd() { return 0; }; popd() { return 0; }; kill() { return 0; }\n"
    "command_not_found_handle() { return 0; }\n"
)


@dataclass(frozen=True)
class ExecResult:
    status: str  # OK | FAILED | UNVERIFIED
    message: str
    engine_argv: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return self.status == OK


def configmaps_of(docs: Iterable[Any]) -> dict[str, dict[str, str]]:
    """name → data of every ConfigMap in ``docs`` (the input set a mounted script comes from)."""
    out = {}
    for d in docs:
        if isinstance(d, Mapping) and d.get("kind") == "ConfigMap":
            name = str((d.get("metadata") or {}).get("name"))
            out[name] = {str(k): str(v) for k, v in (d.get("data") or {}).items()}
    return out


_STUB = r'''#!{python} -I
import json, os, signal, sys
STUBS = {stubs!r}
name, args = os.path.basename(sys.argv[0]), sys.argv[1:]
ENGINE = {engine!r}

def engine():
    if name == "vllm":
        return args[:1] in ENGINE or args[:2] in ENGINE
    i = 0
    while i < len(args) and args[i].startswith("-") and args[i] != "-m":
        i += 1
    if args[i : i + 1] != ["-m"] or i + 1 >= len(args):
        return False
    module, rest = args[i + 1], args[i + 2 :]
    if module == "vllm.entrypoints.cli.main":
        return rest[:1] in ENGINE or rest[:2] in ENGINE
    return module.startswith("vllm.entrypoints.") or module == "huggingfaceserver"

def wrapped():
    """Where a wrapper's command starts (options, then its own positionals)."""
    values = {{"timeout": "sk", "nice": "n", "numactl": "NmCpi", "stdbuf": "ioe", "chrt": "",
              "taskset": "", "ionice": "cnp"}}.get(name, "")
    positional = {{"timeout": 1, "taskset": 1, "gosu": 1, "su-exec": 1, "chrt": 1}}.get(name, 0)
    if name in {after_dashes!r}:
        return args.index("--") + 1 if "--" in args else len(args)
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--":
            i += 1
            break
        if name == "env" and "=" in a and not a.startswith("-"):
            k, v = a.split("=", 1)
            os.environ[k] = v
        elif name == "env" and a in ("-u", "--unset"):
            os.environ.pop(args[i + 1] if i + 1 < len(args) else "", None)
            i += 1
        elif a.startswith("--"):
            if "=" not in a and name == "numactl":
                i += 1
        elif a.startswith("-") and len(a) > 1:
            if len(a) == 2 and a[1] in values:
                i += 1
        else:
            break
        i += 1
    return i + positional

if name in {wrappers!r}:
    at = wrapped()
    if at >= len(args):
        sys.exit(0)
    target = os.path.join(STUBS, os.path.basename(args[at]))
    if not os.path.exists(target):
        sys.exit(0)
    os.execv(target, [target, *args[at + 1 :]])
if name in ("sh", "dash", "ash", "bash"):
    shell = {dash!r} if name != "bash" else {bash!r}
    for i, a in enumerate(args):
        if a.startswith("-") and not a.startswith("--") and "c" in a and i + 1 < len(args):
            args[i + 1] = {prelude!r} + args[i + 1]
            break
    os.execv(shell, [shell, *args])
is_engine = name in ("vllm",) or name.startswith("python")
is_engine = is_engine and engine()
with open({calls!r}, "a") as f:
    f.write(json.dumps({{"argv": [name, *args], "engine": is_engine}}) + "\n")
print(json.dumps([name, *args]), flush=True)
if is_engine:
    os.killpg(os.getpgrp(), signal.SIGKILL)
'''


class _Unverifiable(Exception):
    """The run cannot go on without executing something outside it."""


def _python() -> str:
    return (
        "/usr/bin/python3"
        if os.path.exists("/usr/bin/python3")
        else os.path.realpath(shutil.which("python3") or "python3")
    )


class _Run:
    """One sandbox directory: stubs, the ConfigMap files, cwd, home, the calls log."""

    def __init__(self, base: Path, mounts: Mapping[str, Path]) -> None:
        self.base = base
        self.stubs = base / "bin"
        self.calls = base / "calls.jsonl"
        self.cwd = base / "cwd"
        self.home = base / "home"
        self.mounts = dict(mounts)
        for d in (self.stubs, self.cwd, self.home, base / "tmp"):
            d.mkdir(parents=True, exist_ok=True)
            d.chmod(0o777 if d != self.stubs else 0o755)
        self.calls.touch(0o666)
        self.calls.chmod(0o666)
        self.dash = shutil.which("dash") or "/bin/sh"
        self.bash = shutil.which("bash") or ""
        stub = self.stubs / "_stub"
        stub.write_text(
            _STUB.format(
                python=_python(),
                stubs=str(self.stubs),
                calls=str(self.calls),
                wrappers=_WRAPPERS,
                after_dashes=_AFTER_DASHES,
                engine=[list(sub) for sub in _engine.ENGINE_SUBCOMMANDS],
                dash=self.dash,
                bash=self.bash,
                prelude=PRELUDE,
            )
        )
        stub.chmod(0o755)
        noop = self.stubs / "_noop"
        noop.write_text("#!/bin/sh\nexit 0\n")
        noop.chmod(0o755)
        for name in ("vllm", "python", "python3", *_WRAPPERS, *_SHELL_NAMES):
            self.link(name, "_stub")

    def link(self, name: str, target: str = "_noop") -> Path:
        path = self.stubs / name
        if not path.exists() and "/" not in name and name not in (".", ".."):
            path.symlink_to(target)
        return path

    def rewrite(self, text: str) -> str:
        """Absolute paths: ConfigMap mounts → their files here, host programs → stubs."""

        def sub(m: re.Match[str]) -> str:
            path = m.group(0)
            for mount, local in sorted(self.mounts.items(), key=lambda kv: -len(kv[0])):
                if path == mount or path.startswith(mount.rstrip("/") + "/"):
                    return str(local) + path[len(mount) :]
            name = posixpath.basename(path.rstrip("/"))
            if name == "vllm" or _PY.match(name) or name in _SHELL_NAMES:
                return str(self.link(name, "_stub"))
            if os.path.isfile(path) and os.access(path, os.X_OK):
                return str(self.link(name))
            return path

        out = _ABS.sub(sub, text)
        for name in _WORDS.findall(out)[:4000]:
            if _PY.match(name):
                self.link(name, "_stub")
            elif len(name) < 100:
                self.link(name)
        return out

    def guard(self, text: str) -> None:
        """Refuse scripts that would write or source outside the run."""
        for m in re.finditer(r">+\|?\s*([^\s;&|<>()]*)", text):
            target = m.group(1)
            if m.group(0).startswith(">&") or not target or target.startswith("&"):
                continue
            if re.fullmatch(r"/dev/(null|stdout|stderr|fd/\d+)", target):
                continue
            if target.startswith(str(self.base)):
                continue
            if re.fullmatch(r"[\w][\w.+-]*", target):
                continue  # a file in the run's empty cwd
            raise _Unverifiable(f"the script writes to {target!r}")
        at_command = r"(?:^|[;&|({]|\b(?:then|do|else)\b)[ \t]*"  # `.` as a command, not an arg
        for m in re.finditer(at_command + r"(?:source|\.)[ \t]+([^\s;&|]+)", text, re.M):
            target = m.group(1)
            inside = target.startswith(str(self.base)) or re.fullmatch(r"\w[\w./+-]*", target)
            if inside and ".." not in target:
                continue
            raise _Unverifiable(f"the script sources {target!r}")


def _mounts(
    pod: Mapping[str, Any], container: Mapping[str, Any], configmaps: Mapping[str, Any], root: Path
) -> dict[str, Path]:
    """The container's ConfigMap mounts whose ConfigMap is in the input set, written under
    ``root`` (mountPath → local path)."""
    volumes = {v.get("name"): v for v in (pod.get("spec") or {}).get("volumes") or []}
    out: dict[str, Path] = {}
    for m in container.get("volumeMounts") or []:
        source = (volumes.get(m.get("name")) or {}).get("configMap") or {}
        data = configmaps.get(str(source.get("name")))
        if data is None:
            continue
        files = {i["path"]: data.get(i["key"], "") for i in source.get("items") or []} or data
        local = root / str(m["mountPath"]).lstrip("/")
        if m.get("subPath"):
            local.parent.mkdir(parents=True, exist_ok=True)
            local.write_text(files.get(m["subPath"], ""))
            local.chmod(0o755)
        else:
            for rel, text in files.items():
                path = local / rel
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
                path.chmod(0o755)
        out[str(m["mountPath"])] = local
    for d in [root, *root.rglob("*")]:
        if d.is_dir():
            d.chmod(0o755)
    return out


def _limits(timeout: float) -> None:
    """In the child: bounded CPU and file sizes; as root, run as nobody."""
    resource.setrlimit(resource.RLIMIT_CPU, (int(timeout) + 2, int(timeout) + 2))
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    if os.geteuid() == 0:
        os.setgroups([])
        os.setgid(_NOBODY)
        os.setuid(_NOBODY)
        resource.setrlimit(resource.RLIMIT_NPROC, (256, 256))


def _shell_argv(run: _Run, words: list[str]) -> list[str]:
    """The argv that runs ``words`` (a shell command line) here."""
    exe = posixpath.basename(words[0])
    if exe == "busybox" and len(words) > 1:
        words, exe = words[1:], posixpath.basename(words[1])
    shell = {"dash": run.dash, "bash": run.bash}.get(_SHELL_NAMES.get(exe, ""), "")
    if not shell:
        raise _Unverifiable(f"the container runs {exe!r}, neither dash nor bash")
    opts, i = [], 1
    while i < len(words) and words[i][:1] in "-+" and words[i] not in ("-", "--"):
        word = words[i]
        if word in ("-o", "+o", "-O", "+O") and i + 1 < len(words):
            opts += words[i : i + 2]
            i += 2
            continue
        if word in ("--login", "-l", "-i", "--norc", "--noprofile"):
            i += 1
            continue
        if not word.startswith("--"):
            word = word[0] + word[1:].replace("l", "").replace("i", "")
        if len(word) > 1:
            opts.append(word)
        if "c" in word and not word.startswith("--"):
            if i + 1 >= len(words):
                raise _Unverifiable("`-c` without a script")
            script = run.rewrite(words[i + 1])
            run.guard(script)
            return [shell, *opts, PRELUDE + script, *words[i + 2 :]]
        i += 1
    if i < len(words) and words[i] == "--":
        i += 1
    if i >= len(words):
        raise _Unverifiable("the shell reads its script from stdin")
    path = run.rewrite(words[i])
    if not path.startswith(str(run.base)) or not os.path.isfile(path):
        raise _Unverifiable(f"the script {words[i]!r} is not in the input set (a ConfigMap)")
    text = Path(path).read_text()
    local = run.base / "script"
    local.write_text(run.rewrite(text))
    local.chmod(0o755)
    run.guard(local.read_text())
    return [shell, *opts, "-c", PRELUDE + '. "$0"', str(local), *words[i + 1 :]]


def _argv(run: _Run, words: list[str], env: dict[str, str]) -> list[str]:
    """The argv to run for the container's ``words``; exec wrappers (``tini --``, ``env A=b``)
    are dropped, their ``A=b`` moved into ``env``: they only exec what follows."""
    start = unwrap(words)
    env.update(w.split("=", 1) for w in words[:start] if "=" in w and not w.startswith("-"))
    words = words[start:]
    if not words:
        raise _Unverifiable("the exec wrapper runs nothing")
    exe = posixpath.basename(words[0])
    if exe in _SHELL_NAMES or exe == "busybox":
        return _shell_argv(run, words)
    if exe == "vllm" or _PY.match(exe):
        return [str(run.link(exe, "_stub")), *words[1:]]
    local = run.rewrite(words[0]) if words[0].startswith("/") else ""
    if local.startswith(str(run.base)) and os.path.isfile(local):  # a script from a ConfigMap
        line = (Path(local).read_text().splitlines() or [""])[0]
        interpreter = line[2:].split() if line.startswith("#!") else []
        if interpreter and posixpath.basename(interpreter[0]) == "env":
            interpreter = interpreter[1:]
        if interpreter and posixpath.basename(interpreter[0]) in _SHELL_NAMES:
            return _shell_argv(run, [interpreter[0], *interpreter[1:], words[0], *words[1:]])
        raise _Unverifiable(f"{words[0]!r} is not a dash or bash script ({line[:40]!r})")
    raise _Unverifiable(f"the container runs {words[0]!r}, not a shell, vllm or python")


def _env(run: _Run, container: Mapping[str, Any]) -> dict[str, str]:
    env = {
        k: v
        for k, v in container_env(container, UNKNOWN).items()
        if not k.startswith(("LD_", "BASH_FUNC_"))
        and k not in ("BASH_ENV", "ENV", "SHELLOPTS", "BASHOPTS", "PS4", "CDPATH", "GLOBIGNORE")
    }
    env.update(
        PATH=str(run.stubs), HOME=str(run.home), TMPDIR=str(run.base / "tmp"), LC_ALL="C.UTF-8"
    )
    return env


def entrypoint(container: Mapping[str, Any]) -> tuple[str, ...]:
    """What the container's image runs when the container sets no ``command``."""
    image = str(container.get("image", "")).split("@")[0].rsplit("/", 1)[-1].split(":")[0]
    return HUGGINGFACESERVER if "huggingfaceserver" in image else ENTRYPOINT


def run_delivery(
    pod: Mapping[str, Any],
    intent: Intent,
    configmaps: Mapping[str, Mapping[str, str]] | None = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> ExecResult:
    """Run ``intent.container``'s command line in ``pod`` and check what the engine receives."""
    containers = (pod.get("spec") or {}).get("containers") or []
    container = next((c for c in containers if c.get("name") == intent.container), None)
    if container is None:
        return ExecResult(FAILED, f"no container {intent.container!r}")
    env_map = container_env(container, UNKNOWN)
    command = [str(w) for w in container.get("command") or entrypoint(container)]
    words = [
        kubelet_expand(w, env_map) for w in command + [str(a) for a in container.get("args") or []]
    ]
    with tempfile.TemporaryDirectory(prefix="kvoffload-verify-") as tmp:
        base = Path(tmp)
        base.chmod(0o755)
        try:
            run = _Run(base, _mounts(pod, container, configmaps or {}, base / "root"))
            env = _env(run, container)
            argv = _argv(run, words, env)
        except _Unverifiable as exc:
            return ExecResult(UNVERIFIED, str(exc))
        proc = subprocess.Popen(
            argv,
            cwd=run.cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            preexec_fn=lambda: _limits(timeout),  # noqa: PLW1509 (no threads forked here)
        )
        try:
            _, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return _judge(run, intent, f"timed out after {timeout:g} s")
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        tail = err.decode(errors="replace").strip().splitlines()[-3:]
        return _judge(run, intent, f"exit {proc.returncode}: {' | '.join(tail)}")


def _judge(run: _Run, intent: Intent, how: str) -> ExecResult:
    calls = [json.loads(line) for line in run.calls.read_text().splitlines() if line.strip()]
    # the stub stops at what looks like an engine; engine.py's own detection has the last word
    engines = [
        c["argv"]
        for c in calls
        if c["engine"] and _engine.engine_site({"command": c["argv"]}).engine
    ]
    if not engines:
        seen = ", ".join(" ".join(c["argv"])[:60] for c in calls) or "nothing"
        return ExecResult(UNVERIFIED, f"the stand-in engine never ran ({how}; ran: {seen})")
    return check_engine_argv(engines[0], intent)


def check_engine_argv(engine: Sequence[str], intent: Intent) -> ExecResult:
    """The flag appears once in the engine's argv, before any bare ``--`` (after it the engine
    reads it as a positional argument), and its value is the policy's JSON."""
    values, at = [], []
    for i, w in enumerate(engine):
        m = _FLAG.match(w)
        if m:
            values.append(w[m.end() :] if m.group(1) else (engine[i + 1 : i + 2] or [""])[0])
            at.append(i)
    shown = tuple(engine)
    if len(values) != 1:
        return ExecResult(FAILED, f"the engine got --kv-transfer-config {len(values)} times", shown)
    if "--" in engine[1 : at[0]]:
        return ExecResult(
            FAILED, "the engine got --kv-transfer-config after a bare --, as a positional", shown
        )
    failures = check_value(values[0], intent.config, "the engine's argv")
    if failures:
        return ExecResult(FAILED, str(failures[0]), shown)
    return ExecResult(OK, "the engine got the policy's --kv-transfer-config once", shown)
