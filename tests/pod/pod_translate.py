"""The vLLM container's command as the kubelet assembles it, translated to run on this CPU box.

Kubelet part: `command` (else the image ENTRYPOINT: `vllm serve` for every vLLM image here) plus
`args`, `$(VAR)` expanded from the container's env (literal values and pod fieldRefs).
Translation (applied identically to a pod with and without kvoffload, so the two runs differ
only by what the injection added):
- the model (positional after `serve`, or `--model`) becomes the local tiny model dir;
- only flags on `KEEP` survive (everything else is GPU, download, network or size tuning that
  does not apply here: `--gpu-memory-utilization`, `--max-num-batched-tokens`, `--dtype`, ...);
  `--tensor-parallel-size` above 2 becomes 1;
- `FIXED` is appended: dummy weights, no tokenizer, 1024 tokens, eager, float32, port 8000 (each
  pod has its own network namespace). vLLM's other defaults stay (CPU block size 128, prefix
  caching on);
- `sh -c` scripts: the one engine invocation inside the script is translated in place (its words
  run until the first shell operator), the rest of the script is kept.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
TINY_MODEL = ROOT / "tests" / "connector" / "models" / "tiny-llama"
PORT = 8000
IMAGE_ENTRYPOINT = ("vllm", "serve")
SHELLS = {"sh", "bash", "dash", "ash", "zsh"}
KEEP = {
    "--kv-transfer-config",
    "--enable-prefix-caching",
    "--no-enable-prefix-caching",
    "--block-size",
    "--max-num-seqs",
    "--served-model-name",
    "--seed",
    "--trust-remote-code",
    "--enable-chunked-prefill",
    "--tensor-parallel-size",
    "--kv-offloading-size",
    "--kv-offloading-backend",
}
BOOLEAN = {
    "--enable-prefix-caching",
    "--no-enable-prefix-caching",
    "--trust-remote-code",
    "--enable-chunked-prefill",
    "--disable-log-requests",
    "--disable-log-stats",
    "--enforce-eager",
    "--skip-tokenizer-init",
    "--no-enable-log-requests",
    "--enable-log-requests",
}
FIXED = (
    "--load-format",
    "dummy",
    "--skip-tokenizer-init",
    "--max-model-len",
    "1024",
    "--enforce-eager",
    "--dtype",
    "float32",
    "--host",
    "127.0.0.1",
    "--port",
    str(PORT),
)
_OPS = {";", "&&", "||", "|", "&", "\n"}


POD_IP = "10.88.0.2"  # the harness pod's IP, on its own loopback (see harness.py)
FIELDS = {
    "status.podIP": POD_IP,
    "status.podIPs": POD_IP,
    "status.hostIP": POD_IP,
    "metadata.name": "pod",
    "metadata.namespace": "default",
    "spec.nodeName": "node",
    "spec.serviceAccountName": "default",
}
_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(word: str, env: Mapping[str, str]) -> str:
    """The kubelet's `$(VAR)` expansion: a defined VAR is replaced, `$$` is a literal `$`,
    an undefined `$(VAR)` stays as written."""

    def one(m: re.Match[str]) -> str:
        if m[0] == "$$":
            return "$"
        return env.get(m[1], m[0])

    return _VAR.sub(one, word)


def container_env(container: Mapping[str, Any]) -> dict[str, str]:
    """The container's env as the kubelet sets it: literal values (which may use earlier
    variables as `$(VAR)`) and `valueFrom.fieldRef` of the pod fields the harness knows.
    Other `valueFrom` sources (Secrets, ConfigMaps, resourceFieldRef) are left unset."""
    env: dict[str, str] = {}
    for e in container.get("env") or []:
        if "value" in e:
            env[e["name"]] = expand(str(e["value"]), env)
            continue
        ref = ((e.get("valueFrom") or {}).get("fieldRef") or {}).get("fieldPath")
        if ref in FIELDS:
            env[e["name"]] = FIELDS[ref]
    return env


def kubelet_argv(container: Mapping[str, Any]) -> list[str]:
    """command + args with `$(VAR)` expanded from the container's env (as the kubelet)."""
    env = container_env(container)
    words = list(container.get("command") or IMAGE_ENTRYPOINT) + list(container.get("args") or [])
    return [expand(w, env) for w in words]


def _engine_start(words: Sequence[str]) -> int | None:
    """Index just past the engine's entry words (`vllm serve`, `python -m vllm.entrypoints...`)."""
    for i, w in enumerate(words):
        base = w.rsplit("/", 1)[-1]
        if base == "vllm" and i + 1 < len(words) and words[i + 1] == "serve":
            return i + 2
        if base.startswith("python") and words[i + 1 : i + 2] == ["-m"]:
            mod = words[i + 2] if i + 2 < len(words) else ""
            if mod.startswith("vllm.entrypoints"):
                return i + 3
    return None


def translate_engine_args(args: Sequence[str], positional_model: bool) -> list[str]:
    kept: list[str] = []
    i = 0
    while i < len(args):
        w = args[i]
        if not w.startswith("--"):
            i += 1  # the positional model
            continue
        name, eq, value = w.partition("=")
        name = "--" + name[2:].replace("_", "-")
        if not eq and name not in BOOLEAN and i + 1 < len(args):
            value = args[i + 1]
            i += 1
        i += 1
        if name not in KEEP:
            continue
        if name == "--tensor-parallel-size" and int(value) > 2:
            value = "1"
        kept += [name] if name in BOOLEAN else [name, value]
    model = [str(TINY_MODEL)] if positional_model else ["--model", str(TINY_MODEL)]
    return model + kept + list(FIXED)


def translate_words(words: Sequence[str]) -> list[str] | None:
    start = _engine_start(words)
    if start is None:
        return None
    positional = words[start - 1] == "serve"
    return list(words[:start]) + translate_engine_args(words[start:], positional)


def translate_script(script: str) -> str:
    lexer = shlex.shlex(script.replace("\\\n", " "), posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    tokens = list(lexer)
    start = _engine_start(tokens)
    if start is None:
        raise ValueError(f"no vLLM engine in shell script {script!r}")
    end = next((j for j in range(start, len(tokens)) if tokens[j] in _OPS), len(tokens))
    head = tokens[: start - (2 if tokens[start - 1] == "serve" else 3)]
    engine = translate_words(tokens[len(head) : end]) or []

    def q(ts: Sequence[str]) -> str:
        return " ".join(t if t in _OPS else shlex.quote(t) for t in ts)

    return " ".join(x for x in (q(head), shlex.join(engine), q(tokens[end:])) if x)


def translate(container: Mapping[str, Any]) -> list[str]:
    """The argv the harness runs for a vLLM container (see module doc)."""
    words = kubelet_argv(container)
    if words[0].rsplit("/", 1)[-1] in SHELLS:
        script_at = next(i for i, w in enumerate(words[1:], 1) if not w.startswith("-"))
        return [*words[:script_at], translate_script(words[script_at]), *words[script_at + 1 :]]
    out = translate_words(words)
    if out is None:
        raise ValueError(f"no vLLM server in {words!r}")
    return out


def tensor_parallel(argv: Sequence[str]) -> int:
    """The tensor-parallel size a translated command line asks for (1 when it names none)."""
    found = re.findall(r"--tensor-parallel-size[= ](\d+)", " ".join(argv))
    return int(found[-1]) if found else 1


def without_kvoffload(argv: Sequence[str]) -> list[str]:
    """`argv` minus the injected `--kv-transfer-config` (for comparing engine argvs)."""
    out: list[str] = []
    skip = False
    for w in argv:
        if skip:
            skip = False
            continue
        if w == "--kv-transfer-config":
            skip = True
            continue
        if w.startswith("--kv-transfer-config="):
            continue
        out.append(re.sub(r" --kv-transfer-config '[^']*'", "", w))
    return out
