"""A namespace names the weights, not the served name: engines that share a served name but run
other weights (revision, quantization, config, weight files) never share KV; the same engine
started again does. The sidecar accepts and persists the spec that says so."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from kvoffload_connector.common.keys import build_spec
from kvoffload_connector.worker import identity
from kvoffload_connector.worker.identity import model_identity
from kvoffload_sidecar.keys import NamespaceSpec, derive_namespace
from kvoffload_sidecar.persist import decode_spec, encode_spec

HERE = Path(__file__).resolve().parent
TINY = HERE / "models" / "tiny-llama"


class HFConfig:
    """An HF config as vLLM holds it (`to_dict`, a hub commit when it came from the hub)."""

    def __init__(self, **fields):
        self.fields = dict(fields)
        self._commit_hash = fields.pop("_commit_hash", None)

    def to_dict(self):
        return dict(self.fields)


def vllm_config(model="/models/m", engine="engine-a", **changes):
    mc = dict(
        model=model,
        served_model_name="chat",
        revision=None,
        code_revision=None,
        quantization=None,
        dtype="torch.bfloat16",
        hf_config=HFConfig(hidden_size=128, rms_norm_eps=1e-5, _name_or_path=model),
        hf_overrides={},
        tokenizer=model,
        tokenizer_revision=None,
        seed=0,
    )
    load_format = changes.pop("load_format", "auto")
    mc.update(changes)
    return SimpleNamespace(
        model_config=SimpleNamespace(**mc),
        load_config=SimpleNamespace(load_format=load_format),
        kv_transfer_config=SimpleNamespace(engine_id=engine),
    )


def namespace_of(cfg) -> str:
    """The namespace id the sidecar derives for an engine of this config (worker.py's spec)."""
    spec = build_spec(
        model=str(cfg.model_config.served_model_name),
        identity=model_identity(cfg, cfg.kv_transfer_config.engine_id),
        dtype="bfloat16",
        kv_layout="LBHNC/packed-kv",
        block_size=16,
        chunk_blocks=4,
        tp_size=1,
        hash_algo="sha256",
        group_specs=["FullAttention:w0:h2:d32:n2"],
    )
    fields = {k: getattr(spec, k) for k in NamespaceSpec.__dataclass_fields__}
    return derive_namespace(NamespaceSpec(**fields))


def test_same_served_name_other_weights_never_share_a_namespace():
    base = namespace_of(vllm_config())
    assert namespace_of(vllm_config(engine="engine-b")) == base, "a restart shares its pool"
    other_config = vllm_config()
    other_config.model_config.hf_config.fields["rms_norm_eps"] = 1e-6
    others = {
        "path": vllm_config(model="/models/other"),
        "revision": vllm_config(revision="v2"),
        "code_revision": vllm_config(code_revision="abc"),
        "hub commit": vllm_config(
            hf_config=HFConfig(hidden_size=128, rms_norm_eps=1e-5, _commit_hash="c0ffee")
        ),  # fmt: skip
        "quantization": vllm_config(quantization="fp8"),
        "model dtype": vllm_config(dtype="torch.float16"),
        "config": other_config,
        "hf_overrides": vllm_config(hf_overrides={"rope_theta": 5e5}),
        "tokenizer": vllm_config(tokenizer="/tok/other"),
        "tokenizer_revision": vllm_config(tokenizer_revision="t2"),
        "load_format": vllm_config(load_format="dummy"),
    }
    ids = {name: namespace_of(cfg) for name, cfg in others.items()}
    assert base not in ids.values(), ids
    assert len(set(ids.values())) == len(ids), ids


def test_where_the_config_came_from_is_not_what_it_is():
    """The same config read from another path (the path itself is named apart) or by another
    transformers release hashes alike."""
    a = HFConfig(hidden_size=8, _name_or_path="/a", transformers_version="4.50")
    b = HFConfig(hidden_size=8, _name_or_path="/b", transformers_version="4.57")
    assert identity.config_hash(a) == identity.config_hash(b)
    assert identity.config_hash(HFConfig(hidden_size=9)) != identity.config_hash(a)


def test_a_model_folder_is_named_by_its_weight_files(tmp_path):
    """A folder whose weights changed under the same path (a volume refilled) is another
    namespace; a copy of the same files elsewhere names the same weights."""
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    assert identity.weights_fingerprint(folder) == ""  # no weights: dummy or hub
    weights = folder / "model.safetensors"
    weights.write_bytes(bytes(range(256)) * 4096)
    before = identity.weights_fingerprint(folder)
    copy_dir = tmp_path / "copy"
    shutil.copytree(folder, copy_dir)
    assert identity.weights_fingerprint(copy_dir) == before
    raw = bytearray(weights.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # a fine-tune: same size, other values
    weights.write_bytes(bytes(raw))
    assert identity.weights_fingerprint(folder) != before
    a = namespace_of(vllm_config(model=str(folder)))
    raw[len(raw) // 2] ^= 0xFF
    weights.write_bytes(bytes(raw))
    assert namespace_of(vllm_config(model=str(folder))) != a


def test_an_identity_that_cannot_be_read_is_this_engines_own(monkeypatch, caplog):
    """Never a failed registration, never a shared namespace: an unreadable part is named by
    the engine's id (its ranks agree; a restarted engine has a new id)."""

    def broken(folder):
        raise PermissionError("no read access")

    monkeypatch.setattr(identity, "weights_fingerprint", broken)
    cfg = vllm_config(model=str(TINY))
    with caplog.at_level("WARNING"):
        ident = model_identity(cfg, "engine-a")
    assert ident["model.weights"] == "unverified:engine-a"
    assert "cannot read the model's weights" in caplog.text
    assert namespace_of(cfg) == namespace_of(vllm_config(model=str(TINY)))  # same engine
    assert namespace_of(cfg) != namespace_of(vllm_config(model=str(TINY), engine="engine-b"))
    cfg.model_config.hf_config = object()  # neither to_dict nor attributes to hash
    assert model_identity(cfg, "e")["model.config"] == "unverified:e"


def test_the_sidecar_accepts_and_persists_the_identity():
    cfg = vllm_config(model="/m/" + "x" * 5000, hf_overrides={"k": "v" * 5000})
    spec = build_spec(
        model="chat",
        identity=model_identity(cfg, "e"),
        dtype="bfloat16",
        kv_layout="L",
        block_size=16,
        chunk_blocks=4,
        tp_size=1,
        hash_algo="sha256",
        group_specs=["Full"],
    )
    ns = NamespaceSpec(**{k: getattr(spec, k) for k in NamespaceSpec.__dataclass_fields__})
    ns.validate()  # long paths and overrides go in as their hash: within the sidecar's limits
    assert decode_spec(encode_spec(ns)) == ns
    assert json.loads(encode_spec(ns))["model"] == "chat"  # the label stats show
    assert dict(ns.extra)["model.path"].startswith("sha256:")


def test_a_real_model_config_of_vllm_gives_a_stable_identity():
    """vLLM's own ModelConfig (the tiny Llama folder): every field reads, twice alike."""
    pytest.importorskip("vllm")
    from vllm.config import ModelConfig

    mc = ModelConfig(model=str(TINY), skip_tokenizer_init=True, served_model_name="chat")
    cfg = SimpleNamespace(
        model_config=mc,
        load_config=SimpleNamespace(load_format="dummy"),
        kv_transfer_config=SimpleNamespace(engine_id="e"),
    )
    ident = model_identity(cfg, "e")
    assert not [k for k, v in ident.items() if v.startswith("unverified")], ident
    assert ident["model.path"] == str(TINY) and ident["model.load_format"] == "dummy:seed=0"
    assert model_identity(copy.deepcopy(cfg), "other") == ident
