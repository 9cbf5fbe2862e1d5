"""Receive and map a tenant's memory from the node agent (node mode; stdlib only).

The pod's socket (`memory.sock` in its CSI volume) answers one request per message
(SOCK_SEQPACKET): `{"v": 1, "op": "open", "tenant": NAME}`; an "OK" answer carries the tenant's
memfd (SCM_RIGHTS). The constants mirror `kvoffload_sidecar.node.tenant_memory` (a test checks
both sides agree). The fd is mapped only if the agent sealed it against resize, so no holder can
shrink it under this mapping.
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import json
import mmap
import os
import socket
from dataclasses import dataclass

PROTOCOL_VERSION = 1
MAX_ANSWER = 4096
REQUIRED_SEALS = fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK


class NodeMemoryError(Exception):
    """The agent refused (its `code`: INVALID_ARGUMENT, PERMISSION_DENIED, UNAVAILABLE) or sent
    something this client does not map (`code` PROTOCOL)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


@dataclass
class TenantMapping:
    tenant: str
    fd: int
    size: int
    buffer: mmap.mmap  # MAP_SHARED, read-write: the tenant's whole memory

    def close(self) -> None:
        self.buffer.close()
        os.close(self.fd)


def connect(path: str, timeout: float) -> socket.socket:
    """A connection to the agent's socket at `path`, whatever its length (via the directory)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    sock.settimeout(timeout)
    try:
        if len(os.fsencode(path)) < 100:
            sock.connect(path)
        else:
            dfd = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                sock.connect(f"/proc/self/fd/{dfd}/{os.path.basename(path)}")
            finally:
                os.close(dfd)
    except BaseException:
        sock.close()
        raise
    return sock


def request(
    sock: socket.socket, doc: object, fds: list[int] | None = None
) -> tuple[dict, list[int]]:
    """Send one request, return the answer and the fds it carried (the caller owns them)."""
    raw = json.dumps(doc).encode()
    if fds:
        socket.send_fds(sock, [raw], fds)
    else:
        sock.send(raw)
    data, got = _recv_fds(sock, 4)
    if not data:
        for fd in got:
            os.close(fd)
        raise NodeMemoryError("PROTOCOL", "the agent closed the connection")
    try:
        answer = json.loads(data.decode())
    except ValueError:
        for fd in got:
            os.close(fd)
        raise NodeMemoryError("PROTOCOL", "the agent's answer is not JSON") from None
    return answer, got


def _recv_fds(sock: socket.socket, maxfds: int) -> tuple[bytes, list[int]]:
    """One message and the fds it carried, received close-on-exec (`socket.recv_fds` drops
    its flags): a process the engine starts must hold neither the tenant's memory nor the
    description an engine lock sits on."""
    fds = array.array("i")
    data, ancdata, _flags, _ = sock.recvmsg(
        MAX_ANSWER, socket.CMSG_LEN(maxfds * fds.itemsize), socket.MSG_CMSG_CLOEXEC
    )
    for level, kind, cdata in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(cdata[: len(cdata) - len(cdata) % fds.itemsize])
    return data, list(fds)


def open_tenant_memory(path: str, tenant: str, *, timeout: float = 5.0) -> TenantMapping:
    """Ask the agent at `path` for `tenant`'s memory and map it whole; raise `NodeMemoryError`
    (OSError when nothing answers at `path`)."""
    fd, size = receive_tenant_memory(path, tenant, timeout=timeout)
    try:
        buffer = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    return TenantMapping(tenant=tenant, fd=fd, size=size, buffer=buffer)


def receive_tenant_memory(path: str, tenant: str, *, timeout: float = 5.0) -> tuple[int, int]:
    """`tenant`'s memfd from the agent at `path` (this process's own open file description,
    close-on-exec) and its size, checked sealed against resize and of the size the answer
    names; the caller owns the fd. Raises `NodeMemoryError`, or OSError when nothing answers
    at `path`."""
    with connect(path, timeout) as sock:
        answer, fds = request(sock, {"v": PROTOCOL_VERSION, "op": "open", "tenant": tenant})
    code = answer.get("code") if isinstance(answer, dict) else None
    if code != "OK":
        for fd in fds:
            os.close(fd)
        message = answer.get("message", "") if isinstance(answer, dict) else ""
        raise NodeMemoryError(str(code), str(message))
    if len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise NodeMemoryError("PROTOCOL", f"an OK answer carries one fd, got {len(fds)}")
    fd = fds[0]
    try:
        size = os.fstat(fd).st_size
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        if seals & REQUIRED_SEALS != REQUIRED_SEALS:
            raise NodeMemoryError(
                "PROTOCOL", f"the memory is not sealed against resize ({seals:#x})"
            )
        if size != answer.get("size"):
            raise NodeMemoryError("PROTOCOL", f"size {size} differs from the answer's")
    except BaseException:
        with contextlib.suppress(OSError):
            os.close(fd)
        raise
    return fd, size
