"""`kvoffload node-holder`: keeps the tenants' memfds alive while the agent restarts.

A memfd lives as long as something holds it. The agent (CSI, sockets, soon the slot protocol) is
the part that changes and restarts; the holder is small and rarely changed, so it holds every
tenant's memfd and lends it to the agent again after a restart: pods' blocks survive the agent.
It pre-faults what it creates (`--prefault`), so the pages are charged to its container, whose
memory is the node pool.

Wire (SOCK_SEQPACKET, a socket in a directory only the agent pod's containers share, 0600): the
request is `{"v": 1, "op": "lend", "tenant": NAME, "size": BYTES}`; the answer `{"v": 1,
"code": CODE, ...}` with a new open file description of the tenant's memfd when CODE is "OK",
created on first request. A different size for a known tenant is FAILED_PRECONDITION (its size
is sealed); a peer of another uid than the holder's is PERMISSION_DENIED.

`{"v": 1, "op": "prefault", "tenant": NAME, "offset": O, "length": N}` allocates that range of
a held tenant's memfd (`posix_fallocate`) before answering "OK": the agent's pool pre-faults in
its own order (the slots it hands out first) while the pages are charged to the holder's
container, whose memory is the node pool. A range outside the memfd is INVALID_ARGUMENT, a
tenant not held FAILED_PRECONDITION, an allocation the kernel refuses UNAVAILABLE.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import socket
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from kvoffload_sidecar.node.tenant_memory import (
    MAX_REQUEST,
    PROTOCOL_VERSION,
    create_memfd,
    open_description,
)

log = logging.getLogger(__name__)


class HolderError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


@dataclass(frozen=True)
class Held:
    fd: int
    size: int


class Holder:
    def __init__(self, *, prefault: bool = False) -> None:
        self._held: dict[str, Held] = {}
        self._prefault = prefault
        self._lock = threading.Lock()

    def lend(self, tenant: str, size: int) -> tuple[str, str, int | None]:
        """(code, message, fd to send) for one request; the fd is the caller's to close."""
        with self._lock:
            held = self._held.get(tenant)
            if held is None:
                held = Held(create_memfd(tenant, size), size)
                self._held[tenant] = held
                if self._prefault:  # in the background: the agent serves behind it
                    threading.Thread(
                        target=os.posix_fallocate, args=(held.fd, 0, size), daemon=True
                    ).start()
            elif held.size != size:
                return (
                    "FAILED_PRECONDITION",
                    f"tenant {tenant!r} holds {held.size} bytes (sealed); asked {size}",
                    None,
                )
            return "OK", "", open_description(held.fd)

    def prefault(self, tenant: str, offset: int, length: int) -> tuple[str, str]:
        """(code, message): allocate [offset, offset + length) of a held tenant's memfd."""
        with self._lock:
            held = self._held.get(tenant)
        if held is None:
            return "FAILED_PRECONDITION", f"tenant {tenant!r} is not held"
        if offset + length > held.size:
            return "INVALID_ARGUMENT", f"range past the {held.size} bytes of {tenant!r}"
        try:
            os.posix_fallocate(held.fd, offset, length)
        except OSError as e:
            return "UNAVAILABLE", f"cannot allocate: {e.strerror or e}"
        return "OK", ""

    def handle(self, raw: bytes, fds: list[int], peer_uid: int) -> tuple[dict, int | None]:
        for fd in fds:
            os.close(fd)
        if peer_uid != os.getuid():
            return {"code": "PERMISSION_DENIED", "message": "only the agent's uid is served"}, None
        try:
            doc = json.loads(raw.decode())
        except (UnicodeDecodeError, ValueError):
            doc = None
        if fds or not isinstance(doc, dict):
            return {"code": "INVALID_ARGUMENT", "message": "expected a lend request"}, None
        if doc.get("op") == "prefault" and _fields(doc, "offset", "length"):
            if doc["offset"] < 0 or doc["length"] <= 0:
                return {"code": "INVALID_ARGUMENT", "message": "expected a range"}, None
            code, message = self.prefault(doc["tenant"], doc["offset"], doc["length"])
            return {"code": code, "message": message}, None
        if doc.get("op") != "lend" or not _fields(doc, "size") or doc["size"] <= 0:
            return {"code": "INVALID_ARGUMENT", "message": "expected a lend request"}, None
        code, message, fd = self.lend(doc["tenant"], doc["size"])
        return {"code": code, "message": message, "size": doc["size"]}, fd

    def serve(self, path: str, stop: threading.Event) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        old = os.umask(0o177)  # 0600 from its first moment
        try:
            listener.bind(path)
        finally:
            os.umask(old)
        listener.listen(8)
        listener.settimeout(0.5)
        print(f"node holder serving {path}", flush=True)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(5)
                raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
                _, uid, _ = struct.unpack("3i", raw)
                try:
                    while True:
                        data, fds, _, _ = socket.recv_fds(conn, MAX_REQUEST, 4)
                        if not data and not fds:
                            break
                        answer, fd = self.handle(data, fds, uid)
                        body = json.dumps({"v": PROTOCOL_VERSION, **answer}).encode()
                        try:
                            if fd is not None:
                                socket.send_fds(conn, [body], [fd])
                            else:
                                conn.send(body)
                        finally:
                            if fd is not None:
                                os.close(fd)
                except OSError as e:
                    log.info("holder connection ended: %s", e)
        listener.close()


def _fields(doc: dict, *numbers: str) -> bool:
    """`doc` is exactly {v, op, tenant, *numbers}, with a tenant name and integer numbers."""
    return (
        set(doc) == {"v", "op", "tenant", *numbers}
        and doc["v"] == PROTOCOL_VERSION
        and isinstance(doc["tenant"], str)
        and bool(doc["tenant"])
        and all(isinstance(doc[n], int) and not isinstance(doc[n], bool) for n in numbers)
    )


def prefault(path: str, tenant: str, offset: int, length: int, *, timeout: float = 60.0) -> None:
    """Have the holder at `path` allocate that range of `tenant`'s memfd; raise HolderError."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC) as s:
        s.settimeout(timeout)
        s.connect(path)
        doc = {"v": PROTOCOL_VERSION, "op": "prefault", "tenant": tenant}
        s.send(json.dumps({**doc, "offset": offset, "length": length}).encode())
        data, fds, _, _ = socket.recv_fds(s, MAX_REQUEST, 4)
    for fd in fds:
        os.close(fd)
    answer = json.loads(data.decode()) if data else {"code": "UNAVAILABLE"}
    if answer.get("code") != "OK":
        raise HolderError(str(answer.get("code")), str(answer.get("message", "")))


def lend(path: str, tenant: str, size: int, *, timeout: float = 5.0) -> int:
    """The holder's memfd for `tenant` (created at `size` on first request); raise HolderError."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC) as s:
        s.settimeout(timeout)
        s.connect(path)
        s.send(
            json.dumps(
                {"v": PROTOCOL_VERSION, "op": "lend", "tenant": tenant, "size": size}
            ).encode()
        )
        data, fds, _, _ = socket.recv_fds(s, MAX_REQUEST, 4)
    answer = json.loads(data.decode()) if data else {"code": "UNAVAILABLE"}
    if answer.get("code") != "OK" or len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise HolderError(str(answer.get("code")), str(answer.get("message", "")))
    return fds[0]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvoffload node-holder", description=__doc__)
    p.add_argument("--socket", required=True, help="in a directory only the agent pod shares")
    p.add_argument("--prefault", action="store_true", help="allocate each memfd's pages")
    ns = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    Holder(prefault=ns.prefault).serve(ns.socket, stop)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
