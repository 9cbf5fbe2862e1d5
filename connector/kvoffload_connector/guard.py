"""Serving without the pool, safely: the payload's dependency path, the one-time reason, and the
status file `kvoffload stats` reads.

Standard library only: the facade vLLM imports (`connector.py`) imports this module at module
import time, and nothing here may fail to import in any vLLM image.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("kvoffload_connector.connector")

# Tests only: names of packages whose import must fail (comma separated), to prove that a
# payload which cannot import leaves vLLM serving without the pool.
FAIL_IMPORT_ENV = "KVOFFLOAD_TEST_FAIL_IMPORT"

# Tests only: "<hook>" makes the facade's first call of that vLLM hook raise; "<hook>:owed" its
# first call while a load promised to vLLM is not yet handed to the workers. Proves that a hook
# that raises leaves vLLM serving the same tokens.
FAULT_ENV = "KVOFFLOAD_TEST_FAULT"
_FAULT = os.environ.get(FAULT_ENV, "")

_said: set[str] = set()
_lock = threading.Lock()


def reason(exc: BaseException) -> str:
    """An exception as the one-line reason the log, the status file and the gauge give."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if type(exc).__name__ == "Unsupported":
        return text
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class InjectedFault(RuntimeError):
    """The exception `FAULT_ENV` injects."""


def check_test_fault(hook: str, owed: bool = False) -> None:
    """Raise `InjectedFault` where `FAULT_ENV` asks for it (once per process)."""
    global _FAULT
    if not _FAULT:
        return
    name, _, when = _FAULT.partition(":")
    if name == hook and (when != "owed" or owed):
        _FAULT = ""
        raise InjectedFault(f"{FAULT_ENV}={name}{':' + when if when else ''}")


def deps_dir() -> Path:
    """Where a stock-image payload keeps our third-party deps (grpcio, protobuf), one folder
    per Python: `<site>/_kvoffload_deps/cpXY` beside the `kvoffload_connector` package."""
    pkg = Path(__file__).resolve().parent
    return pkg.parent / "_kvoffload_deps" / f"cp{sys.version_info.major}{sys.version_info.minor}"


def add_payload_deps(path: Path | None = None) -> str | None:
    """Append the payload's deps folder to the END of sys.path when it exists: the image's own
    packages win, ours only fill gaps. Returns the folder added (None: nothing to add)."""
    d = str(path or deps_dir())
    if not os.path.isdir(d):
        return None
    if d not in sys.path:
        sys.path.append(d)
    return d


def check_test_import_failures() -> None:
    """Raise the ImportError a missing package would (tests only, see FAIL_IMPORT_ENV)."""
    names = [n.strip() for n in os.environ.get(FAIL_IMPORT_ENV, "").split(",") if n.strip()]
    if names:
        raise ImportError(f"No module named {names[0]!r} ({FAIL_IMPORT_ENV})")


def say_disabled(reason: str, exc: BaseException | None = None) -> bool:
    """Log why the pool is not used, once per process (with `exc`'s traceback: a hook that
    raised is a bug to report). True when this call logged it."""
    with _lock:
        if "disabled" in _said:
            return False
        _said.add("disabled")
    log.warning("kvoffload: serving without the pool: %s", reason, exc_info=exc)
    return True


STATUS_SUBDIR = "status"  # the node agent's directory in a pod's volume that the pod may write


def status_path(socket: str, role: str, rank: int) -> Path:
    """Beside the pool socket, or in its directory's `status/` where that exists: in node
    placement the socket's directory is the agent's (a non-root container cannot write it) and
    the agent makes `status/` for the pod's files. A sidecar's run dir has none."""
    directory = Path(os.path.dirname(socket) or ".")
    if (directory / STATUS_SUBDIR).is_dir():
        directory = directory / STATUS_SUBDIR
    return directory / f"connector-status-{role}-{rank}.json"


def write_status(
    socket: str,
    state: str,
    reason: str,
    role: str,
    rank: int,
    vllm_version: str,
    extra: dict[str, Any] | None = None,
) -> Path | None:
    """Atomically write this connector's state beside the pool socket for `kvoffload stats`
    (`extra`: more fields, e.g. the scheduler's GPU KV capacity, `capacity.gpu_capacity`).
    Failures are ignored (a read-only or missing folder must not matter)."""
    try:
        path = status_path(socket, role, rank)
        body = {
            **(extra or {}),
            "state": state,
            "reason": reason,
            "role": role,
            "rank": rank,
            "vllm_version": vllm_version,
            "pid": os.getpid(),
            "time": time.time(),
        }
        fd, tmp = tempfile.mkstemp(prefix=".connector-status-", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(body, f)
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return path
    except Exception:  # noqa: BLE001 - best effort by design
        return None
