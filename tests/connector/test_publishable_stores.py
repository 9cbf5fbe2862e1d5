"""Stores cover only the blocks vLLM publishes. With EAGLE/MTP prefix-cache hashing a block's
draft KV may not be written yet when its hash exists; vLLM lines that track it say so in
`Request.num_publishable_block_hashes`, and the connector stores no chunk past it (compat).
vLLM's LoRA block hashes, and whether they name the adapter, are checked against its sources."""

from __future__ import annotations

import ast
import types
from dataclasses import dataclass
from pathlib import Path

import pytest
from kvoffload_connector.common import compat

from tests.connector import test_vllm_sources as sources
from tests.connector.test_scheduler import BS, Request, SchedOut, ask, make, settle


@dataclass
class EagleRequest(Request):
    num_publishable_block_hashes: int = 0


@pytest.mark.parametrize("mode", ["eager", "lazy"])
def test_no_chunk_past_the_publishable_hashes_is_stored(mode):
    """7 hashes (3 full 2-block chunks) of which 3 are publishable: one chunk stored, and the
    next once vLLM publishes its blocks (eager); a finished request (lazy) the same."""
    s, fake, bp, mgr = make(mode=mode, nblocks=40)
    s._stores.lazy_watermark = 8
    req = EagleRequest("r", list(range(7 * BS + 8)), num_publishable_block_hashes=3)
    assert len(req.block_hashes) == 7
    assert ask(s, req) == (0, False)
    blocks = bp.allocate(8)
    mgr.req_blocks["r"] = [blocks]
    for b, h in zip(blocks, req.block_hashes, strict=False):
        b.block_hash = h
    s.build_connector_meta(SchedOut({"r": len(req.prompt)}))
    settle(s)
    if mode == "lazy":
        s.request_finished(req, ([b.block_id for b in blocks],))
        bp.free_blocks(blocks)  # to the tail of the free queue, still cached
        bp.allocate(len(bp.free_block_queue.items) - 8)  # traffic: now they are next in line
        s.build_connector_meta(SchedOut({}))
        settle(s)
        assert fake.calls.count("reserve_store") == 1
        (job,) = s.build_connector_meta(SchedOut({})).stores
        assert sorted(job.transfers[0].gpu_blocks) == [b.block_id for b in blocks[:2]]
        return
    assert fake.calls.count("reserve_store") == 1 and s.stats.store_chunks_planned == 1
    s.build_connector_meta(SchedOut({"r": 1}))  # a decode step: nothing newly publishable
    settle(s)
    assert s.stats.store_chunks_planned == 1
    req.num_publishable_block_hashes = 6
    req.num_computed_tokens = len(req.prompt)
    s.build_connector_meta(SchedOut({"r": 1}))
    settle(s)
    assert s.stats.store_chunks_planned == 3


def test_without_the_attribute_every_hash_is_publishable():
    req = Request("r", list(range(5 * BS)))
    assert compat.publishable_block_hashes(req) == 5
    for value, expected in ((2, 2), (9, 5), (-1, 0), (True, 5), (None, 5)):
        req.num_publishable_block_hashes = value
        assert compat.publishable_block_hashes(req) == expected


# -- against vLLM's sources --------------------------------------------------------------------

REQUEST = "vllm/v1/request.py"
ATTR = "num_publishable_block_hashes"


def _request_and_utils(minor):
    if minor is None:
        vllm = pytest.importorskip("vllm")
        site = Path(vllm.__file__).resolve().parent.parent
        version = vllm.__version__
        read = {f: (site / f).read_text() for f in (REQUEST, sources.KV_CACHE_UTILS)}
        return version, read
    version, got = sources._wheel_sources(minor)
    return version, got


def _assigned_attrs(source: str, cls: str) -> set[str]:
    tree = ast.parse(source)
    node = sources._class(tree, cls)
    return sources._self_attrs(node, ast.Store) | {
        n.name for n in node.body if isinstance(n, ast.FunctionDef)
    }


@pytest.mark.parametrize(
    "minor", [None, *sources.WHEEL_MINORS], ids=lambda m: "installed" if m is None else str(m)
)
def test_vllm_sources_publish_hashes_as_compat_reads_them(minor, monkeypatch):
    """Where a release's Request has `num_publishable_block_hashes`, compat reads that name;
    where it has none (0.26-0.33.0), its block hasher emits only hashes of blocks whose KV is
    final: 0.33's EAGLE hashing waits for the lookahead tokens a block's draft KV needs."""
    monkeypatch.setattr(sources, "_wanted_files", lambda: [REQUEST, sources.KV_CACHE_UTILS])
    version, src = _request_and_utils(minor)
    attrs = _assigned_attrs(src[REQUEST], "Request")
    if ATTR in attrs:
        assert ATTR in Path(compat.__file__).read_text(), version
        return
    hasher = next(
        n
        for n in ast.walk(ast.parse(src[sources.KV_CACHE_UTILS]))
        if isinstance(n, ast.FunctionDef) and n.name == "get_request_block_hasher"
    )
    params = [a.arg for a in hasher.args.args]
    if minor == (0, 33):
        assert "num_hash_lookahead_tokens" in params, f"vLLM {version}: {params}"
    assert "block_hashes" in attrs or "update_block_hashes" in attrs, version


@pytest.mark.parametrize(
    "minor", [None, *sources.WHEEL_MINORS], ids=lambda m: "installed" if m is None else str(m)
)
def test_lora_hash_keys_of_vllm_sources(minor, monkeypatch):
    """0.32+ hash a LoRA adapter's path with its name (one name re-pointed at another adapter
    gets other keys); 0.26 hashes the name only, where the connector leaves LoRA to vLLM."""
    monkeypatch.setattr(sources, "_wanted_files", lambda: [REQUEST, sources.KV_CACHE_UTILS])
    version, src = _request_and_utils(minor)
    tree = ast.parse(src[sources.KV_CACHE_UTILS])
    fn = next(
        n
        for n in tree.body
        if isinstance(n, ast.FunctionDef) and n.name == "_gen_lora_extra_hash_keys"
    )
    fn.returns = None
    for a in fn.args.args:
        a.annotation = None
    module = types.ModuleType("lora_keys")
    exec(compile(ast.Module([fn], []), "lora_keys", "exec"), module.__dict__)  # noqa: S102
    names_path = compat.lora_hashes_name_the_adapter(module)
    assert names_path == (minor != (0, 26)), f"vLLM {version}"
