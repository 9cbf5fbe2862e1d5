"""The namespace spec the connector's process tests register with the sidecar: one full-attention
group of a tiny model (32-token blocks, 2-block chunks)."""

from __future__ import annotations

from kvoffload_connector.common.keys import build_spec

TINY_SPEC = build_spec(
    model="tiny",
    dtype="float32",
    kv_layout="LB/test",
    block_size=32,
    chunk_blocks=2,
    tp_size=1,
    hash_algo="sha256",
    group_specs=["Full:w0"],
)
