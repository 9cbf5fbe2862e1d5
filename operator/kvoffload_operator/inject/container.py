"""Reading a container spec as the kubelet runs it: its argv, past exec wrappers, the script of
``sh -c``, its environment, and the texts that configure the engine (pure)."""

from __future__ import annotations

import posixpath
from collections.abc import Mapping, Sequence
from typing import Any

from kvoffload_operator.inject import shell

SHELLS = shell.SHELLS
# exec wrappers that run the rest of their argv: (basename, runs what follows "--" only)
WRAPPERS = {"tini": False, "dumb-init": False, "env": False, "argoexec": True, "launch": True}


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


def who_of(container: Mapping[str, Any]) -> str:
    return f"container {container['name']!r}" if container.get("name") else "the pod"


def env_names(container: Mapping[str, Any]) -> list[str]:
    return [str(e.get("name")) for e in container.get("env") or [] if e.get("name")]


def env_values(container: Mapping[str, Any]) -> dict[str, str]:
    return {
        str(e.get("name")): str(e.get("value", ""))
        for e in container.get("env") or []
        if "value" in e
    }


def config_texts(container: Mapping[str, Any]) -> list[str]:
    """What configures the engine: argv (shell scripts without comments and tests), env values."""
    words = argv(container)
    script = shell_script(container)
    if script is not None:
        words[script] = shell.blank_reads(words[script])
    return [*words, *env_values(container).values()]
