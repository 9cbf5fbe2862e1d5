"""The module path users give vLLM (`kv_connector_module_path`) names the connector class, and
every writer of that path in the repository (the injector, the demo, the docs, the benchmarks)
writes the same one."""

from __future__ import annotations

import importlib
import re
import subprocess
from pathlib import Path

from kvoffload_operator.inject.render import CONNECTOR_MODULE

ROOT = Path(__file__).resolve().parents[2]
WRITTEN = re.compile(r"kv_connector_module_path[\"']?\s*[:=]\s*\\?[\"']([A-Za-z0-9_.]+)")
# stand-ins that load another class on purpose
STAND_INS = {"noop_connector", "connector_overhead"}


def test_the_injected_module_path_names_the_vllm_connector_class():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    cls = importlib.import_module(CONNECTOR_MODULE).KVOffloadConnector
    assert issubclass(cls, KVConnectorBase_V1)
    assert cls.__module__ == CONNECTOR_MODULE


def test_every_writer_of_the_module_path_writes_the_injectors():
    files = subprocess.run(
        ["git", "ls-files", "*.py", "*.md", "*.yaml", "*.sh", "*.json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    found: dict[str, set[str]] = {}
    for rel in files:
        path = ROOT / rel
        if not path.is_file():
            continue  # deleted in the working tree
        for module in WRITTEN.findall(path.read_text(errors="replace")):
            found.setdefault(module, set()).add(rel)
    assert CONNECTOR_MODULE in found
    others = {m: sorted(f) for m, f in found.items() if m not in {CONNECTOR_MODULE, *STAND_INS}}
    assert not others, others
