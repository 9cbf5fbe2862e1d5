"""What every injected pod must satisfy, checked on the pod itself (pure: no process, no I/O).

Two families of checks, each comparing the pod the injector wrote with the pod it was given (a
rule the user's pod already broke is not the injector's doing, so only new violations count):

- **structure** (`check_structure`): what the API server would reject, or what kvoffload must
  never write: duplicate container, volume, mount-path or env names, a mount of a volume that
  does not exist, two containers claiming one port (host ports too on ``hostNetwork`` pods),
  limits below requests.
- **delivery** (`check_delivery`): the vLLM container's command line, re-parsed as the kubelet
  and the shell will read it, carries ``--kv-transfer-config`` exactly once, as its own argument,
  with a value that parses as JSON equal to what the injector meant, and never after a bare
  ``--`` of the engine's argv (a positional there). Shell scripts are re-split with `shlex`
  (here-document texts left out: they are data) and followed into ``eval`` and nested ``sh -c``
  strings, the places where the shell parses a word a second time (and strips quotes the JSON
  needs); a script that runs its arguments (``exec "$@"``) gets the flag in those.

Why the webhook runs only these and never executes the command line: executing a pod's script
in the operator would run text that anyone who may create a pod wrote, inside the process that
holds the webhook's key; a sandbox strong enough for that is a dependency and an attack surface
of its own, and a subprocess per admission a latency cost. These checks are microseconds and
read nothing but the two pods. The execution check (`verify_exec`) runs in tests and in
``kvoffload inject --verify``, where the manifest is the user's own.

A delivery the re-parse cannot follow (a script `shlex` cannot split, a container whose script
is a file) is ``unverified``, not a failure: the webhook keeps the injection the engine
detection chose, and the execution check is the one that can say more.
"""

from __future__ import annotations

import json
import posixpath
import re
import shlex
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvoffload_operator.inject import shell
from kvoffload_operator.inject.container import SHELLS, argv, shell_script, unwrap
from kvoffload_operator.inject.render import kv_transfer_config
from kvoffload_operator.inject.site import EnvEdit
from kvoffload_operator.policy import PolicyError, quantity_value

# The skip reason written to ``kvoffload.io/skip-reason`` when a rendering fails these checks.
VERIFICATION_FAILED = "verification-failed"
FLAG = "--kv-transfer-config"
_FLAG_RE = re.compile(r"--kv[-_]transfer[-_]config(?![\w-])")
_PUNCT = ";&|()\n"


@dataclass(frozen=True)
class Intent:
    """What the injector meant to deliver: the flag's JSON value, to this container."""

    container: str
    config: Mapping[str, Any]
    env: str | None = None  # `inject-via: env`: the variable the user's script passes on


@dataclass(frozen=True)
class Failure:
    check: str  # e.g. "unique-mount-paths", "flag-json"
    message: str

    def __str__(self) -> str:
        return f"{self.check}: {self.message}"


@dataclass(frozen=True)
class Verdict:
    failures: tuple[Failure, ...] = ()
    unverified: tuple[str, ...] = field(default=())  # what could not be decided, and why

    @property
    def ok(self) -> bool:
        return not self.failures

    def summary(self) -> str:
        return "; ".join(str(f) for f in self.failures)


def intent_of(decision: Any) -> Intent:
    """The `Intent` of a positive `Decision` (what `render` passes to the vLLM container)."""
    env = decision.edit.name if isinstance(decision.edit, EnvEdit) else None
    return Intent(str(decision.container), kv_transfer_config(decision.policy), env)


def verify(original: Mapping[str, Any], mutated: Mapping[str, Any], intent: Intent) -> Verdict:
    """Every pure check of ``mutated`` (the injector's output for ``original``)."""
    failures = list(check_structure(original, mutated))
    delivery, unverified = check_delivery(original, mutated, intent)
    return Verdict(tuple(failures + delivery), tuple(unverified))


# -- structure ------------------------------------------------------------------------------------
def _spec(pod: Mapping[str, Any]) -> Mapping[str, Any]:
    spec = pod.get("spec") or {}
    return spec if isinstance(spec, Mapping) else {}


def _list(value: Any) -> list[Any]:
    return [v for v in value if isinstance(v, Mapping)] if isinstance(value, list) else []


def all_containers(spec: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    return [
        (kind, c)
        for kind in ("initContainers", "containers", "ephemeralContainers")
        for c in _list(spec.get(kind))
    ]


def _duplicates(values: Iterable[Any]) -> list[Any]:
    return sorted((v for v, n in Counter(values).items() if n > 1), key=str)


def _running_together(spec: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """Containers whose ports coexist: the app containers and the native sidecars."""
    sidecars = [c for c in _list(spec.get("initContainers")) if c.get("restartPolicy") == "Always"]
    return sidecars + _list(spec.get("containers"))


def _violations(pod: Mapping[str, Any]) -> set[tuple[str, str]]:
    """(check, message) for every structural rule ``pod`` breaks."""
    spec = _spec(pod)
    out: set[tuple[str, str]] = set()
    containers = all_containers(spec)
    for name in _duplicates(c.get("name") for _, c in containers):
        out.add(("unique-container-names", f"container name {name!r} is used twice"))
    volumes = [v.get("name") for v in _list(spec.get("volumes"))]
    for name in _duplicates(volumes):
        out.add(("unique-volume-names", f"volume {name!r} is defined twice"))
    for kind, c in containers:
        who = f"{kind[:-1]} {c.get('name')!r}"
        mounts = _list(c.get("volumeMounts"))
        devices = _list(c.get("volumeDevices"))
        paths = [posixpath.normpath(str(m.get("mountPath", ""))) for m in mounts] + [
            posixpath.normpath(str(d.get("devicePath", ""))) for d in devices
        ]
        for path in _duplicates(paths):
            out.add(("unique-mount-paths", f"{who} mounts two volumes at {path}"))
        for m in mounts + devices:
            if m.get("name") not in volumes:
                out.add(("mounts-name-volumes", f"{who} mounts volume {m.get('name')!r}, absent"))
        for env in _duplicates(e.get("name") for e in _list(c.get("env"))):
            out.add(("unique-env-names", f"{who} sets env {env} twice"))
        out |= _resource_violations(who, c.get("resources"))
    out |= _resource_violations("the pod", spec.get("resources"))
    ports: list[tuple[Any, str]] = []
    host_ports: list[tuple[Any, str]] = []
    for c in _running_together(spec):
        for p in _list(c.get("ports")):
            proto = str(p.get("protocol") or "TCP")
            ports.append((p.get("containerPort"), proto))
            host = p.get("hostPort") or (
                p.get("containerPort") if spec.get("hostNetwork") else None
            )
            if host:
                host_ports.append((host, proto))
    for port, proto in _duplicates(ports):
        out.add(("unique-ports", f"two containers claim containerPort {port}/{proto}"))
    for port, proto in _duplicates(host_ports):
        out.add(("unique-host-ports", f"two containers claim host port {port}/{proto}"))
    return out


def _resource_violations(who: str, resources: Any) -> set[tuple[str, str]]:
    if not isinstance(resources, Mapping):
        return set()
    requests = resources.get("requests") or {}
    limits = resources.get("limits") or {}
    out = set()
    for key in set(requests) & set(limits):
        try:
            low, high = quantity_value(requests[key]), quantity_value(limits[key])
        except PolicyError:
            out.add(("resource-quantities", f"{who}: {key} is not a quantity"))
            continue
        if high < low:
            out.add(
                ("limits-cover-requests", f"{who}: {key} limit {limits[key]} < {requests[key]}")
            )
    return out


def check_structure(original: Mapping[str, Any], mutated: Mapping[str, Any]) -> list[Failure]:
    """The structural rules ``mutated`` breaks and ``original`` did not."""
    new = _violations(mutated) - _violations(original)
    return [Failure(check, message) for check, message in sorted(new)]


# -- delivery -------------------------------------------------------------------------------------
_VAR = re.compile(r"\$(\$|\(([A-Za-z_][A-Za-z0-9_.-]*)\))")


def kubelet_expand(text: str, env: Mapping[str, str]) -> str:
    """``$(VAR)`` expansion as the kubelet does it in command, args and env values: a defined
    name is replaced, an undefined one kept as written, ``$$`` is one literal ``$``."""

    def sub(m: re.Match[str]) -> str:
        if m.group(1) == "$":
            return "$"
        name = m.group(2)
        return env[name] if name in env else m.group(0)

    return _VAR.sub(sub, text)


def container_env(container: Mapping[str, Any], unknown: str | None = None) -> dict[str, str]:
    """The container's env as the kubelet builds it: each value expanded with the ones before.
    ``valueFrom`` entries (Secrets, ConfigMaps, fields) are ``unknown`` when given, else absent."""
    env: dict[str, str] = {}
    for e in _list(container.get("env")):
        name = str(e.get("name"))
        if "value" in e:
            env[name] = kubelet_expand(str(e.get("value") or ""), env)
        elif unknown is not None:
            env[name] = unknown
    return env


def _container(pod: Mapping[str, Any], name: str) -> Mapping[str, Any] | None:
    return next((c for c in _list(_spec(pod).get("containers")) if c.get("name") == name), None)


def _flag_value(words: Sequence[str]) -> tuple[list[int], list[str]]:
    """Indices of the flag words in ``words`` and the values they pass."""
    at, values = [], []
    for i, w in enumerate(words):
        m = _FLAG_RE.match(w)
        if not m:
            continue
        rest = w[m.end() :]
        if rest.startswith("="):
            at.append(i)
            values.append(rest[1:])
        elif rest == "":
            at.append(i)
            values.append(words[i + 1] if i + 1 < len(words) else "")
    return at, values


def check_value(value: str, config: Mapping[str, Any], where: str) -> list[Failure]:
    """The flag's value parses as JSON equal to ``config``."""
    try:
        got = json.loads(value)
    except ValueError as exc:
        return [Failure("flag-json", f"{where}: the value {value[:80]!r} is not JSON ({exc})")]
    if got != config:
        return [Failure("flag-json", f"{where}: the value {value[:80]!r} is not the policy's")]
    return []


def check_delivery(
    original: Mapping[str, Any], mutated: Mapping[str, Any], intent: Intent
) -> tuple[list[Failure], list[str]]:
    """(failures, unverified notes) for the flag's delivery to ``intent.container``."""
    failures: list[Failure] = []
    written = {(kind, c.get("name")): c for kind, c in all_containers(_spec(mutated))}
    for kind, before in all_containers(_spec(original)):
        after = written.get((kind, before.get("name")))
        if before.get("name") == intent.container and kind == "containers":
            continue
        if after is None or argv(before) != argv(after):
            what = "is gone" if after is None else "has a changed command line"
            failures.append(Failure("only-vllm-argv", f"{kind[:-1]} {before.get('name')!r} {what}"))
    old, new = _container(original, intent.container), _container(mutated, intent.container)
    if old is None or new is None:
        return failures + [Failure("vllm-container", f"no container {intent.container!r}")], []
    if intent.env is not None:
        return failures + _env_delivery(old, new, intent), [
            f"the script passes ${intent.env} on: only running it can tell"
        ]
    # the user's script may mention the flag already, in tests that read it (a guard)
    added = sum(len(_FLAG_RE.findall(w)) for w in argv(new)) - sum(
        len(_FLAG_RE.findall(w)) for w in argv(old)
    )
    if added != 1:
        failures.append(Failure("flag-once", f"{FLAG} is written {added} times"))
        return failures, []
    env = container_env(new)
    expanded = [kubelet_expand(w, env) for w in argv(new)]
    if expanded != argv(new) and [kubelet_expand(w, env) for w in argv(old)] == argv(old):
        failures.append(Failure("kubelet-expansion", "$(VAR) expansion changes the new words"))
        return failures, []
    index = shell_script(new)
    if index is None:
        return failures + _argv_delivery(argv(old), argv(new), new, intent), []
    old_words, new_words = argv(old), argv(new)
    if len(new_words) == len(old_words) + 1 and new_words[: index + 2] == old_words[: index + 2]:
        found, unverified = _arguments_delivery(old_words, new_words, index, intent)
        return failures + found, unverified
    if len(old_words) != len(new_words) or any(
        a != b for i, (a, b) in enumerate(zip(old_words, new_words, strict=True)) if i != index
    ):
        failures.append(Failure("flag-placement", "words outside the shell script changed"))
        return failures, []
    found, unverified = _script_delivery(old_words[index], new_words[index], intent, 0)
    return failures + found, unverified


def _env_delivery(old: Mapping[str, Any], new: Mapping[str, Any], intent: Intent) -> list[Failure]:
    """``inject-via: env``: argv untouched, the variable set once to the policy's JSON, and
    nothing the kubelet would expand in it."""
    if argv(old) != argv(new):
        return [Failure("flag-placement", "inject-via env changed the command line")]
    entries = [e for e in _list(new.get("env")) if e.get("name") == intent.env]
    if len(entries) != 1 or "value" not in entries[0]:
        return [Failure("flag-once", f"env {intent.env} is set {len(entries)} times")]
    value = str(entries[0]["value"])
    if kubelet_expand(value, container_env(new)) != value:
        return [Failure("kubelet-expansion", f"$(VAR) expansion changes {intent.env}")]
    return check_value(value, intent.config, f"env {intent.env}")


def _argv_delivery(
    old: list[str], new: list[str], container: Mapping[str, Any], intent: Intent
) -> list[Failure]:
    """One word added to the argv, ``--kv-transfer-config=<json>``, never after a bare ``--``:
    from there on the engine reads words as positionals."""
    exe = posixpath.basename(new[0]) if container.get("command") else ""
    if exe in SHELLS:  # `bash /script.sh`: the script decides (the execution check can tell)
        return []
    at = next((i for i, (a, b) in enumerate(zip(old, new, strict=False)) if a != b), len(old))
    if len(new) != len(old) + 1 or new[:at] + new[at + 1 :] != old:
        return [Failure("flag-placement", "the flag is not one word added to the argv")]
    flags, values = _flag_value(new[at : at + 1])
    if flags != [0] or "=" not in new[at]:
        return [Failure("flag-once", f"the added word {new[at][:60]!r} is not {FLAG}=<json>")]
    first = unwrap(new) + 1 if container.get("command") else 0
    if "--" in new[first:at]:
        return [
            Failure(
                "flag-placement",
                f"{FLAG} comes after a bare --, where the engine reads it as a positional argument",
            )
        ]
    return check_value(values[0], intent.config, "args")


def _arguments_delivery(
    old: list[str], new: list[str], index: int, intent: Intent
) -> tuple[list[Failure], list[str]]:
    """The flag added to the script's arguments (the words after ``$0``). A script that runs
    them (``exec "$@"``) has the engine's argv there; one that passes them on otherwise
    (``./start.sh "$@"``, ``inject-via: args``) only running it can tell; one that never reads
    them would drop the flag."""
    script = shell.blank_reads(new[index])
    runs, changed = shell.runs_arguments(new[index])
    if runs and changed is None:
        rest = index + 2
        return _argv_delivery(old[rest:], new[rest:], {"command": new[rest:]}, intent), []
    if re.search(r"\$(?:[@*]|\{[@*#]|[1-9])", script):
        return [], ["the script passes its arguments on: only running it can tell"]
    return [
        Failure("flag-placement", "the flag went to the script's arguments, which it never reads")
    ], []


def _without_comments(script: str) -> str:
    """``script`` without its comments (a ``#`` that starts a word, outside quotes)."""
    out, quote, i = [], "", 0
    while i < len(script):
        ch = script[i]
        if quote:
            if ch == "\\" and quote == '"':
                out.append(script[i : i + 2])
                i += 2
                continue
            quote = "" if ch == quote else quote
        elif ch == "\\":
            out.append(script[i : i + 2])
            i += 2
            continue
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or script[i - 1] in " \t\n;&|("):
            end = script.find("\n", i)
            i = len(script) if end < 0 else end
            continue
        out.append(ch)
        i += 1
    return "".join(out)


def _without_heredocs(script: str) -> str:
    """``script`` without the texts and end lines of its here-documents (data, not words)."""
    ctx = shell.contexts(script)
    return "".join(ch for i, ch in enumerate(script) if ch == "\n" or ctx[i].state != shell.HEREDOC)


def _tokens(script: str) -> list[str]:
    """Shell words and operators (newlines kept: they end commands; continuations joined)."""
    text = _without_comments(_without_heredocs(script).replace("\\\n", ""))
    lexer = shlex.shlex(text, posix=True, punctuation_chars=_PUNCT)
    lexer.whitespace_split = True
    lexer.whitespace = " \t\r"
    lexer.commenters = ""
    return list(lexer)


def _segments(tokens: list[str]) -> list[tuple[int, int]]:
    """(start, end) of each simple command in ``tokens`` (split at shell operators)."""
    out, start = [], 0
    for i, t in enumerate(tokens + [";"]):
        if t and set(t) <= set(_PUNCT):
            if i > start:
                out.append((start, i))
            start = i + 1
    return out


def _reparsed_by(words: list[str]) -> int | None:
    """Index of the first word the shell parses again: ``eval``'s arguments, ``-c``'s script."""
    i = 0
    while i < len(words) and re.match(r"^[A-Za-z_]\w*=", words[i]):
        i += 1  # VAR=value prefixes
    if i < len(words) and words[i] in ("exec", "command", "builtin"):
        i += 1
    if i < len(words) and words[i] == "eval":
        return i + 1
    for j in range(i + 1, len(words) - 1):
        if words[j].startswith("-") and not words[j].startswith("--") and "c" in words[j]:
            return j + 1
    return None


def _script_delivery(
    old: str, new: str, intent: Intent, depth: int
) -> tuple[list[Failure], list[str]]:
    """Follow the flag into ``new`` (a shell script), comparing with ``old``."""
    if depth > 4:
        return [], ["the script nests eval / sh -c more than 4 deep"]
    try:
        before = _tokens(old)
    except ValueError as exc:
        return [], [f"the original script does not split as shell words ({exc})"]
    try:
        after = _tokens(new)
    except ValueError as exc:
        return [Failure("script-parses", f"the injected script no longer splits: {exc}")], []
    if len(after) in (len(before) + 1, len(before) + 2):
        n = len(after) - len(before)
        pairs = enumerate(zip(before, after, strict=False))
        at = next((i for i, (a, b) in pairs if a != b), len(before))
        if after[:at] + after[at + n :] == before:
            inserted = after[at : at + n]
            idx, values = _flag_value(inserted)
            if idx != [0]:
                return [Failure("flag-once", f"inserted words {inserted!r} are not the flag")], []
            for s, e in _segments(after):
                if s <= at < e:
                    again = _reparsed_by(after[s:e])
                    if again is not None and s + again <= at:
                        # eval joins its arguments and parses them again: follow that
                        return _script_delivery(
                            " ".join(before[s + again : e - n]),
                            " ".join(after[s + again : e]),
                            intent,
                            depth + 1,
                        )
            return check_value(values[0], intent.config, "script"), []
    if len(after) == len(before):
        changed = [i for i, (a, b) in enumerate(zip(before, after, strict=False)) if a != b]
        if len(changed) == 1:
            at = changed[0]
            for s, e in _segments(after):
                if s <= at < e:
                    again = _reparsed_by(after[s:e])
                    if again is not None and s + again <= at:
                        return _script_delivery(before[at], after[at], intent, depth + 1)
            return [
                Failure(
                    "flag-word",
                    f"the flag landed inside the word {after[at][:80]!r}, which no shell "
                    "parses again: vLLM would not see it as its own argument",
                )
            ], []
    return [Failure("flag-placement", "the script changed in more places than the flag")], []
