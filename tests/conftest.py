"""Session-wide test settings shared by every folder."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest


@pytest.fixture(scope="session", autouse=True)
def vllm_ipc_sockets_in_a_temp_dir() -> Iterator[None]:
    """vLLM names its ZMQ IPC sockets `<VLLM_RPC_BASE_PATH>/<uuid>` (default: /tmp) and leaves
    them behind; every engine the tests start (in subprocesses, which inherit this) puts them
    here instead, removed at the end. A short path: a Unix socket path has ~107 bytes."""
    if "VLLM_RPC_BASE_PATH" in os.environ:
        yield
        return
    path = tempfile.mkdtemp(prefix="kvo-ipc-")
    os.environ["VLLM_RPC_BASE_PATH"] = path
    try:
        yield
    finally:
        os.environ.pop("VLLM_RPC_BASE_PATH", None)
        shutil.rmtree(path, ignore_errors=True)
