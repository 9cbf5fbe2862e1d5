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


def vllm_import_problem() -> str | None:
    """Why vLLM cannot be used in this interpreter (the import's traceback), or None. The
    offline engine's names are imported too: `import vllm` alone defers most of vLLM."""
    import traceback

    try:
        import vllm
        from vllm import LLM, SamplingParams  # noqa: F401
    except BaseException as exc:  # noqa: BLE001 - any failure to import is the answer
        if isinstance(exc, KeyboardInterrupt):
            raise
        return "".join(traceback.format_exception(exc)).rstrip()
    del vllm
    return None


def pytest_collection_finish(session: pytest.Session) -> None:
    """Tests marked `vllm` fail loudly, never skip, where vLLM does not import: the venv
    (`make venv`) always installs it, so a broken import is a broken test setup, and skipping
    the engine tests would pass the session without them. GPU tests skip on their own."""
    needs = [item for item in session.items if item.get_closest_marker("vllm") is not None]
    worker = getattr(session.config, "workerinput", {}).get("workerid", "gw0")
    if not needs or worker != "gw0":
        return  # one xdist worker imports vLLM for all: they share the interpreter and venv
    problem = vllm_import_problem()
    if problem is None:
        return
    import sys

    pytest.exit(
        f"{len(needs)} selected tests are marked `vllm` (they run a real vLLM engine), but "
        f"vLLM does not import in {sys.executable}; repair the venv (`make venv`), or "
        f'deselect them (-m "not vllm"). The import failed with:\n{problem}',
        returncode=pytest.ExitCode.INTERRUPTED,
    )


# `make test` runs on three xdist workers, a file at a time per worker (`--dist loadfile`): files
# handed out first finish last, so the longest go first (minutes each on a 2-core box; the
# rest are seconds). Order inside a file is kept: module fixtures (a pod, a sidecar) span it.
LONGEST_FIRST = (
    "tests/connector/test_vllm_engine.py",
    "tests/pod/test_pods.py",
    "tests/drill/test_chaos.py",
    "tests/drill/test_fault_drill.py",
    "tests/connector/test_vllm026_compat.py",
    "tests/connector/test_dynamo_indexer.py",
    "tests/connector/test_warm_start_bench.py",
    "tests/bench/test_serve_sweep.py",
    "tests/bench/test_serve_paired.py",
    "tests/connector/test_vllm_quotas.py",
    "tests/connector/test_vllm_idle.py",
    "tests/node/test_node_engine.py",
    "tests/operator/test_security_operator.py",
    "tests/connector/test_layout.py",
    "tests/model/test_slot_protocol_model.py",
)


def pytest_collection_modifyitems(session: pytest.Session, items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    root = session.config.rootpath
    order = {id(item): i for i, item in enumerate(items)}

    def key(item: pytest.Item) -> tuple[int, int]:
        rel = item.path.relative_to(root).as_posix() if item.path.is_relative_to(root) else ""
        return rank.get(rel, len(rank)), order[id(item)]

    items.sort(key=key)
