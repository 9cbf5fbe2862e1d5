"""Each tenant's memory is its own sealed memfd, sent only over sockets bound to its pods.

A memfd has no path: a pod can hold a tenant's memory only if the agent sent it the fd, and the
agent sends it only over a socket whose bound pod (from NodePublishVolume) may use that tenant.
The memfd is sealed against growing and shrinking (and against removing seals), so no holder
can resize it under other holders' mappings (SIGBUS) or past its share.

Wire (SOCK_SEQPACKET, one message each way): the request is UTF-8 JSON
`{"v": 1, "op": "open", "tenant": NAME}` and nothing else, carrying no fds; the answer is JSON
`{"v": 1, "code": CODE, ...}`, with the memfd attached (SCM_RIGHTS) when CODE is "OK".
`kvoffload_connector.common.node_memory` is the client and mirrors these constants.
A socket whose binding lacks its tenant's grant (access.py) answers every open with the agent's
refusal, never with an fd.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import fcntl
import json
import logging
import os
import selectors
import socket
import stat
import threading
from collections.abc import Callable
from dataclasses import dataclass

from kvoffload_sidecar.node.access import Refusal, not_granted
from kvoffload_sidecar.node.attest import (
    MAX_OUTSIDERS_PER_SOCKET,
    NOT_IN_POD,
    Attest,
    peer_credentials,
    peer_in_pod,
)
from kvoffload_sidecar.node.bindings import SOCKET_NAME, Binding
from kvoffload_sidecar.node.grants import NodePoolSpec

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
MAX_REQUEST = 4096
MAX_CONNECTIONS_PER_SOCKET = 32
SEALS = fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL
_REQUEST_KEYS = frozenset({"v", "op", "tenant"})


class Code(str, enum.Enum):
    OK = "OK"
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    UNAVAILABLE = "UNAVAILABLE"


@dataclass(frozen=True)
class TenantRegion:
    tenant: str
    fd: int
    size: int


def create_memfd(tenant: str, size: int, *, prefault: bool = False) -> int:
    """A memfd of exactly `size` bytes, sealed against resize and against unsealing.

    With `prefault` the calling task allocates every page now (`posix_fallocate`), so the pages
    are charged to its memory cgroup, not to the pods that map them (docs/NODE.md).
    """
    fd = os.memfd_create(f"kvoffload-tenant-{tenant}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        if prefault:
            os.posix_fallocate(fd, 0, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


class TenantMemory:
    """The memfds of a node pool's tenants, one per tenant, sized to its share.

    `source(tenant, size)` returns a tenant's memfd: by default a new one; the node holder's
    (`holder.py`) keeps them across agent restarts.
    """

    def __init__(
        self,
        spec: NodePoolSpec,
        *,
        prefault: bool = False,
        source: Callable[[str, int], int] | None = None,
    ) -> None:
        self._regions: dict[str, TenantRegion] = {}
        self._make = source or (lambda name, size: create_memfd(name, size, prefault=prefault))
        self._lock = threading.Lock()
        self._listeners: list[Callable[[TenantRegion], None]] = []
        try:
            self.update(spec)
        except BaseException:
            self.close()
            raise

    def update(self, spec: NodePoolSpec) -> None:
        """Give every tenant of `spec` its memfd. A removed tenant's memfd stays (its published
        pods keep it); a tenant's size is sealed, so a changed share keeps the size it has."""
        for grant in spec.tenants:
            with self._lock:
                if grant.name in self._regions:
                    continue
            fd = self._make(grant.name, grant.share_bytes)
            region = TenantRegion(grant.name, fd, grant.share_bytes)
            with self._lock:
                self._regions[grant.name] = region
                listeners = list(self._listeners)
            for listener in listeners:
                self._tell(listener, region)

    def subscribe(self, listener: Callable[[TenantRegion], None]) -> None:
        """Call `listener(region)` for every tenant's memfd, those made and those to come (the
        tenant's pool is built over it). A listener that fails is logged: the memfd stays."""
        with self._lock:
            self._listeners.append(listener)
            regions = list(self._regions.values())
        for region in regions:
            self._tell(listener, region)

    @staticmethod
    def _tell(listener: Callable[[TenantRegion], None], region: TenantRegion) -> None:
        try:
            listener(region)
        except Exception:  # noqa: BLE001 - the memory handover must outlive a failed pool
            log.exception("tenant %s: its memory's listener failed", region.tenant)

    def region(self, tenant: str) -> TenantRegion | None:
        with self._lock:
            return self._regions.get(tenant)

    def regions(self) -> list[TenantRegion]:
        with self._lock:
            return list(self._regions.values())

    def close(self) -> None:
        for r in self._regions.values():
            with contextlib.suppress(OSError):
                os.close(r.fd)
        self._regions.clear()


@dataclass(frozen=True)
class Answer:
    code: Code
    message: str = ""
    region: TenantRegion | None = None

    def encode(self) -> bytes:
        doc: dict[str, object] = {"v": PROTOCOL_VERSION, "code": self.code.value}
        if self.message:
            doc["message"] = self.message
        if self.region is not None:
            doc["tenant"] = self.region.tenant
            doc["size"] = self.region.size
        return json.dumps(doc).encode()


def decide(
    raw: bytes,
    fds: list[int],
    truncated: bool,
    binding: Binding,
    memory: TenantMemory,
    peer_in_pod: bool = True,
    refusal: Callable[[Binding], Refusal] = not_granted,
) -> Answer:
    """The answer to one request on `binding`'s socket (pure: the caller closes `fds`).

    `peer_in_pod` is False when attestation placed the connecting process outside the bound pod.
    The binding is the grant: a binding granted at NodePublishVolume, or later, keeps its tenant
    until it unpublishes, whatever later grants say; an ungranted one gets `refusal(binding)`
    (asked at every request: the agent's reason as it stands) and never an fd.
    """
    if fds or truncated:
        what = "file descriptors" if fds else f"more than {MAX_REQUEST} bytes"
        return Answer(Code.INVALID_ARGUMENT, f"a request carries no {what}")
    if not peer_in_pod:
        return Answer(Code.PERMISSION_DENIED, NOT_IN_POD)
    try:
        doc = json.loads(raw.decode())
    except (UnicodeDecodeError, ValueError):
        return Answer(Code.INVALID_ARGUMENT, "a request is one JSON object")
    if not isinstance(doc, dict):
        return Answer(Code.INVALID_ARGUMENT, "a request is one JSON object")
    extra = sorted(set(doc) - _REQUEST_KEYS)
    if extra:
        return Answer(
            Code.INVALID_ARGUMENT,
            f"unknown request fields {extra}: a pod's identity comes from its socket, "
            "never from what it sends",
        )
    if doc.get("v") != PROTOCOL_VERSION:
        return Answer(Code.INVALID_ARGUMENT, f"protocol version {doc.get('v')!r} is not served")
    if doc.get("op") != "open":
        return Answer(Code.INVALID_ARGUMENT, f"unknown op {doc.get('op')!r}")
    tenant = doc.get("tenant")
    if not isinstance(tenant, str) or not tenant:
        return Answer(Code.INVALID_ARGUMENT, "tenant must be a non-empty string")
    # One message whether the tenant exists or not: a pod learns no other tenant's name.
    if tenant != binding.tenant:
        return Answer(Code.PERMISSION_DENIED, f"tenant {tenant!r} is not granted to this pod")
    if not binding.granted:
        code, message = refusal(binding)
        if code != Code.UNAVAILABLE.value:
            code = Code.PERMISSION_DENIED.value  # a refusal is never an OK
        return Answer(Code(code), message)
    region = memory.region(tenant)
    if region is None:
        return Answer(Code.UNAVAILABLE, f"tenant {tenant!r} has no memory on this node yet")
    return Answer(Code.OK, region=region)


def open_description(fd: int) -> int:
    """A new open file description of the memfd behind `fd` (same memory, same seals).

    Each answer gets its own: OFD locks (the engine locks of the slot protocol) belong to an
    open file description, so pods sharing the agent's would share, and release, each other's.
    """
    return os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)


def bind_in_dir(sock: socket.socket, directory: str, name: str) -> None:
    """Bind `sock` to `directory/name` whatever the path's length (sun_path holds 108 bytes;
    a kubelet target path is longer): through `/proc/self/fd/<dir fd>/name`."""
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=dfd)
        sock.bind(f"/proc/self/fd/{dfd}/{name}")
    finally:
        os.close(dfd)


def set_socket_owner(directory: str, name: str, mode: int, group: int | None) -> None:
    """chmod (and chgrp) the socket `directory/name` without following a symlink: a pod that
    runs as root can write into its own volume, and a socket swapped for a link to a host file
    must not make the agent change that file (this runs while pods live, after a restart)."""
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
    finally:
        os.close(dfd)
    try:
        if not stat.S_ISSOCK(os.fstat(fd).st_mode):
            raise OSError(errno.EEXIST, f"{directory}/{name} is not the agent's socket")
        # through the O_PATH descriptor: the very inode checked above, never a link's target
        if group is not None:
            os.chown(f"/proc/self/fd/{fd}", -1, group)
        os.chmod(f"/proc/self/fd/{fd}", mode)
    finally:
        os.close(fd)


class MemoryServer:
    """Serves every published pod socket from one selector thread (requests are rare and tiny)."""

    def __init__(
        self,
        memory: TenantMemory,
        *,
        socket_mode: int = 0o666,
        attest: Attest | None = None,
        refusal: Callable[[Binding], Refusal] = not_granted,
    ) -> None:
        """`attest(pid)` names the pod uid of a peer process (attest.py); None: not checked.
        `refusal(binding)` is what an ungranted binding's socket answers (access.py)."""
        self._attest = attest
        self._refusal = refusal
        self._memory = memory
        self._mode = socket_mode
        self._sel = selectors.DefaultSelector()
        self._lock = threading.Lock()
        self._listeners: dict[tuple[str, str], socket.socket] = {}
        self._bound: dict[tuple[str, str], Binding] = {}  # the binding each socket serves
        # listener -> open connections: [of peers outside the pod, of the pod's own]
        self._conns: dict[socket.socket, list[int]] = {}
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="node-memory", daemon=True)
        self._thread.start()

    def attach(self, binding: Binding) -> None:
        """Create `binding`'s socket in its (existing) target directory and serve it."""
        key = (binding.volume_id, binding.target_path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            bind_in_dir(sock, binding.target_path, SOCKET_NAME)
            mode = self._mode if binding.mount_group is None else self._mode & 0o660
            set_socket_owner(binding.target_path, SOCKET_NAME, mode, binding.mount_group)
            sock.listen(MAX_CONNECTIONS_PER_SOCKET)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        with self._lock:
            old = self._listeners.pop(key, None)
            if old is not None:
                self._sel.unregister(old)
                old.close()
            self._listeners[key] = sock
            self._bound[key] = binding
            self._conns[sock] = [0, 0]
            self._sel.register(sock, selectors.EVENT_READ, ("listen", key))
        self._wake()

    def rebind(self, binding: Binding) -> bool:
        """Serve `binding` (granted since) on its socket, open connections included; False if
        that socket is not served."""
        key = (binding.volume_id, binding.target_path)
        with self._lock:
            if key not in self._listeners:
                return False
            self._bound[key] = binding
        return True

    def detach(self, volume_id: str, target_path: str) -> bool:
        """Stop serving that socket (open connections end too); False if it was not served."""
        with self._lock:
            sock = self._listeners.pop((volume_id, target_path), None)
            self._bound.pop((volume_id, target_path), None)
            if sock is None:
                return False
            self._sel.unregister(sock)
            self._conns.pop(sock, None)
            for key in list(self._sel.get_map().values()):
                if key.data and key.data[0] == "conn" and key.data[2] is sock:
                    self._sel.unregister(key.fileobj)
                    key.fileobj.close()
            sock.close()
        self._wake()
        return True

    def close(self) -> None:
        self._stop = True
        self._wake()
        self._thread.join(5)
        with self._lock:
            for key in list(self._sel.get_map().values()):
                if key.data is not None:
                    key.fileobj.close()
            self._listeners.clear()
            self._bound.clear()
        self._sel.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake_w, b"x")

    def _run(self) -> None:
        while not self._stop:
            events = self._sel.select(1.0)
            for key, _ in events:
                if key.data is None:
                    with contextlib.suppress(BlockingIOError):
                        os.read(self._wake_r, 64)
                    continue
                with self._lock:
                    try:
                        self._sel.get_key(key.fileobj)
                    except (KeyError, ValueError):
                        continue  # detached meanwhile
                    try:
                        if key.data[0] == "listen":
                            self._accept(key.fileobj, key.data[1])
                        else:
                            self._serve(key.fileobj, *key.data[1:])
                    except OSError as e:
                        log.warning("node memory socket: %s", e)

    def _accept(self, listener: socket.socket, key: tuple[str, str]) -> None:
        binding = self._bound[key]
        while True:  # drain the backlog; past the bound a connection is closed unanswered
            try:
                conn, _ = listener.accept()
            except BlockingIOError:
                return
            try:
                pid, uid, gid = peer_credentials(conn)
            except OSError:
                conn.close()
                continue
            in_pod = peer_in_pod(conn, binding.pod.uid, self._attest)
            bound = MAX_CONNECTIONS_PER_SOCKET if in_pod else MAX_OUTSIDERS_PER_SOCKET
            counts = self._conns[listener]
            if counts[in_pod] >= bound:  # peers outside the pod never take the pod's places
                conn.close()
                continue
            conn.setblocking(False)
            counts[in_pod] += 1
            log.debug(
                "pod %s connected: pid %d uid %d gid %d%s",
                binding.pod.describe(), pid, uid, gid, "" if in_pod else " (not in the pod)",
            )  # fmt: skip
            self._sel.register(conn, selectors.EVENT_READ, ("conn", key, listener, in_pod))

    def _drop(self, conn: socket.socket, listener: socket.socket, in_pod: bool) -> None:
        self._sel.unregister(conn)
        conn.close()
        if listener in self._conns:
            self._conns[listener][in_pod] -= 1

    def _serve(
        self, conn: socket.socket, key: tuple[str, str], listener: socket.socket, in_pod: bool
    ) -> None:
        binding = self._bound[key]  # as granted now (rebind)
        try:
            raw, fds, flags, _ = socket.recv_fds(conn, MAX_REQUEST, 16)
        except BlockingIOError:
            return
        except OSError:
            self._drop(conn, listener, in_pod)
            return
        for fd in fds:  # never used, never kept
            with contextlib.suppress(OSError):
                os.close(fd)
        if not raw and not fds:
            self._drop(conn, listener, in_pod)
            return
        truncated = bool(flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC))
        answer = decide(raw, fds, truncated, binding, self._memory, in_pod, self._refusal)
        if answer.code is not Code.OK:
            log.info(
                "refused %s for pod %s: %s",
                answer.code.value,
                binding.pod.describe(),
                answer.message,
            )
        own = open_description(answer.region.fd) if answer.region is not None else None
        try:
            if own is not None:
                socket.send_fds(conn, [answer.encode()], [own])
            else:
                conn.send(answer.encode())
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.EPIPE, errno.ECONNRESET):
                raise
            self._drop(conn, listener, in_pod)
        finally:
            if own is not None:
                os.close(own)
