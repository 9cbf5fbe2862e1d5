"""What the weights are: the part of a namespace spec that names the model (no torch, no vLLM).

A served name is a label: an engine restarted in place under the same name can run other
weights (an entrypoint that pulls a repository's newest revision, a volume whose contents
changed, a quantized build). KV computed by one set of weights must never be served to
another, so the namespace spec carries what vLLM loaded: the model path or id, its revisions,
the quantization, the model dtype, a hash of the HF config as vLLM built it (overrides
applied), the tokenizer, and, for a local model folder, a cheap fingerprint of its weight files.

Every value here is computed without raising: where one cannot be read, it becomes a value
unique to this engine (`unverified:<engine id>`), so the engine gets a namespace of its own,
never a shared one (its TP ranks share the engine id, so they still register one namespace).

LoRA adapters need nothing here: vLLM's block hashes carry the adapter's name and path
(`kv_cache_utils._gen_lora_extra_hash_keys`, 0.32+), and pool keys are those hashes; where a
vLLM hashes the name only (0.26) the connector leaves LoRA requests to vLLM
(`compat.lora_hashes_name_the_adapter`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# spec.extra keys (sidecar keys.NamespaceSpec.extra: sorted string pairs, in the namespace id)
PREFIX = "model."
_MAX_VALUE = 512  # longer values go in as their sha256 (the sidecar caps one value at 4 KiB)
# weight file suffixes a fingerprint covers (config files are in the HF config hash)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5")
_MAX_FILES = 4096
_SAMPLES = 8  # 4 KiB reads spread over each file: a fine-tune differs in every tensor
_SAMPLE_BYTES = 4096
# HF config entries that say where or by what it was read, not what it is
_CONFIG_NOISE = ("_name_or_path", "_commit_hash", "transformers_version", "_attn_implementation")


def _digest(text: str | bytes) -> str:
    raw = text.encode() if isinstance(text, str) else text
    return hashlib.sha256(raw).hexdigest()[:32]


def _short(value: str) -> str:
    return value if len(value.encode()) <= _MAX_VALUE else "sha256:" + _digest(value)


def _text(value: Any) -> str:
    return "" if value is None else str(value)


def config_hash(hf_config: Any) -> str:
    """sha256 of the HF config as vLLM loaded it, minus where it came from."""
    to_dict = getattr(hf_config, "to_dict", None)
    doc = dict(to_dict()) if callable(to_dict) else dict(vars(hf_config))
    for key in _CONFIG_NOISE:
        doc.pop(key, None)
    return _digest(json.dumps(doc, sort_keys=True, default=repr))


def overrides_text(hf_overrides: Any) -> str:
    """`hf_overrides` as text: a dict as sorted JSON, a function by its qualified name (what it
    does shows in the config hash)."""
    if not hf_overrides:
        return ""
    if callable(hf_overrides):
        mod = getattr(hf_overrides, "__module__", "?")
        return f"callable:{mod}.{getattr(hf_overrides, '__qualname__', '?')}"
    return _short(json.dumps(hf_overrides, sort_keys=True, default=repr))


def weights_fingerprint(folder: Path) -> str:
    """Names, sizes and sampled bytes of a model folder's weight files: cheap (a few KiB read
    per file, mostly from the page cache vLLM just filled) and the same for a copy of the
    same files, so replicas with their own download still share a namespace. "" when the
    folder holds no weight file (vLLM's dummy weights; a hub id)."""
    files = []
    for root, dirs, names in os.walk(folder):
        dirs.sort()
        for name in sorted(names):
            if name.endswith(_WEIGHT_SUFFIXES):
                files.append(Path(root, name))
                if len(files) > _MAX_FILES:
                    raise ValueError(f"more than {_MAX_FILES} weight files")
    if not files:
        return ""
    h = hashlib.sha256()
    for path in files:
        size = path.stat().st_size
        h.update(f"{path.relative_to(folder)}\0{size}\0".encode())
        with open(path, "rb") as f:
            for i in range(_SAMPLES + 1):
                f.seek(size * i // _SAMPLES if i < _SAMPLES else max(0, size - _SAMPLE_BYTES))
                h.update(f.read(_SAMPLE_BYTES))
    return h.hexdigest()[:32]


def _load_format(vllm_config: Any) -> str:
    """How vLLM got the weights; dummy weights are random per seed, so the seed goes too."""
    fmt = getattr(getattr(vllm_config, "load_config", None), "load_format", None)
    text = _text(getattr(fmt, "value", fmt))
    if text == "dummy":
        text += f":seed={_text(getattr(vllm_config.model_config, 'seed', None))}"
    return text


def model_identity(vllm_config: Any, engine_id: str) -> dict[str, str]:
    """The `spec.extra` pairs that name the weights (keys `model.*`), each computed on its own:
    one that cannot be read is `unverified:<engine_id>` (a namespace of this engine's own)."""
    mc = vllm_config.model_config
    hf_config = getattr(mc, "hf_config", None)
    readers: dict[str, Callable[[], str]] = {
        "path": lambda: _short(_text(mc.model)),
        "revision": lambda: _text(getattr(mc, "revision", None)),
        "code_revision": lambda: _text(getattr(mc, "code_revision", None)),
        # the commit a hub id resolved to (None for a local folder): "newest revision" pulls
        "commit": lambda: _text(getattr(hf_config, "_commit_hash", None)),
        "quantization": lambda: _text(getattr(mc, "quantization", None)),
        "dtype": lambda: _text(getattr(mc, "dtype", None)).replace("torch.", ""),
        "config": lambda: config_hash(hf_config) if hf_config is not None else "",
        "hf_overrides": lambda: overrides_text(getattr(mc, "hf_overrides", None)),
        "tokenizer": lambda: _short(_text(getattr(mc, "tokenizer", None))),
        "tokenizer_revision": lambda: _text(getattr(mc, "tokenizer_revision", None)),
        "load_format": lambda: _load_format(vllm_config),
        "weights": lambda: (
            weights_fingerprint(Path(mc.model)) if os.path.isdir(str(mc.model)) else ""
        ),
    }
    out: dict[str, str] = {}
    for name, read in readers.items():
        try:
            value = _short(read())
        except Exception as exc:  # noqa: BLE001 - never fail registration over an identity
            log.warning(
                "kvoffload: cannot read the model's %s (%s): this engine gets a namespace of "
                "its own",
                name,
                exc,
            )
            value = f"unverified:{engine_id}"
        out[PREFIX + name] = value
    return out
