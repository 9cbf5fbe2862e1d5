"""A pod's `pool.sock`: the agent accepts each connection itself, bounds and attests it, then
splices it to the pod's gRPC server, which listens where no pod reaches.

gRPC's Python server cannot do either itself: it hands a servicer no peer credentials (its
Unix-socket local credentials never read `SO_PEERCRED`; `context.peer()` is `unix:` and the
auth context holds only the transport's type), and it takes no connection the caller accepted
(`grpc_server_add_channel_from_fd` and the passive listener are C and C++ only). So the pod's
gRPC server listens on an abstract Unix socket of a random name (`private_address`): no path
leads to it, and it lives in the agent pod's network namespace (the DaemonSet is not
hostNetwork), which no other pod shares. `pool.sock` itself is this front's listener, bound and
owned as `memory.sock` is. For each accepted connection, before a byte of it is read:

- with attestation, a peer outside the bound pod is spliced to the agent's outsider server,
  whose every call answers PERMISSION_DENIED (attest.NOT_IN_POD) and which ends each
  connection within about two seconds (`grpc.max_connection_age_ms`): it learns why and reaches
  no Pool; such peers hold at most `max_outsiders` connections, apart from the pod's, and past
  that are closed unanswered;
- past `max_connections` open ones of the pod's own (its `max_sessions`: each client holds one
  connection here and one session), it is closed unanswered;
- else it is spliced to the pod's server.

A splice is two threads, one per direction, each a blocking `recv_into` and `sendall`; when one
direction ends, both sockets are shut and the place is freed. This costs the control RPCs on
`pool.sock` (Register, Stats, Events) two copies per message; the hot path is `session.sock`,
which the agent serves itself (docs/NODE.md, "Why `pool.sock` has a front", has the numbers).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import threading
from dataclasses import dataclass, field

from kvoffload_sidecar.node.attest import MAX_OUTSIDERS_PER_SOCKET, Attest, peer_in_pod
from kvoffload_sidecar.node.tenant_memory import bind_in_dir, set_socket_owner

log = logging.getLogger(__name__)

_BACKLOG = 64
_CHUNK = 1 << 16
# the outsider server's connections end after this age (and as long again for a call in flight)
OUTSIDER_CONNECTION_AGE_MS = 1000


@dataclass(frozen=True)
class PrivateAddress:
    """An abstract Unix address: `grpc` is gRPC's target, `name` what `connect` takes."""

    grpc: str
    name: str


def private_address() -> PrivateAddress:
    """A new abstract Unix address no one can guess."""
    name = f"kvoffload-node-{os.getpid()}-{secrets.token_hex(16)}"
    return PrivateAddress(f"unix-abstract:{name}", "\0" + name)


@dataclass
class _Splice:
    client: socket.socket
    upstream: socket.socket
    outsider: bool  # a peer outside the pod, sent to the outsider server
    running: int = 2  # pumps not finished yet

    def shut(self) -> None:
        for s in (self.client, self.upstream):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)  # wakes the other pump's recv


@dataclass
class PoolFront:
    """`directory/name`, spliced to `backend` (module docstring)."""

    directory: str
    name: str
    backend: PrivateAddress
    pod_uid: str
    mode: int = 0o666
    group: int | None = None
    attest: Attest | None = None
    outsider: PrivateAddress | None = None  # where peers outside the pod go (None: closed)
    max_connections: int = 64
    max_outsiders: int = MAX_OUTSIDERS_PER_SOCKET
    refused: int = 0  # connections closed unanswered past either bound
    outsiders: int = 0  # connections sent to the outsider server
    _listener: socket.socket | None = None
    _inode: int = 0
    _open: dict[int, _Splice] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> None:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            bind_in_dir(listener, self.directory, self.name)
            set_socket_owner(self.directory, self.name, self.mode, self.group)
            self._inode = self._stat().st_ino
            listener.listen(_BACKLOG)
        except BaseException:
            listener.close()
            raise
        self._listener = listener
        threading.Thread(
            target=self._accept_forever, args=(listener,), name="node-pool-front", daemon=True
        ).start()

    def stop(self) -> None:
        """Stop accepting and remove the socket (if it is still this front's); the connections
        open stay spliced until `close_all` or their ends close them."""
        listener, self._listener = self._listener, None
        if listener is None:
            return
        with contextlib.suppress(OSError):
            listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        listener.close()
        with contextlib.suppress(OSError):
            if self._stat().st_ino == self._inode:
                dfd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
                try:
                    os.unlink(self.name, dir_fd=dfd)
                finally:
                    os.close(dfd)

    def close_all(self) -> int:
        """Shut every open connection; returns how many."""
        with self._lock:
            splices = list(self._open.values())
        for s in splices:
            s.shut()
        return len(splices)

    @property
    def connections(self) -> int:
        with self._lock:
            return len(self._open)

    def _stat(self) -> os.stat_result:
        dfd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            return os.stat(self.name, dir_fd=dfd, follow_symlinks=False)
        finally:
            os.close(dfd)

    def _accept_forever(self, listener: socket.socket) -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return  # stop() shut the listener
            outside = not peer_in_pod(conn, self.pod_uid, self.attest)
            bound = self.max_outsiders if outside else self.max_connections
            target = self.outsider if outside else self.backend
            with self._lock:
                full = sum(s.outsider == outside for s in self._open.values()) >= bound
            if full or target is None:
                self.refused += 1
                conn.close()
                continue
            if outside:
                self.outsiders += 1
                log.info("pool.sock of pod %s: a peer outside the pod, refused", self.pod_uid)
            self._splice(conn, target, outside)

    def _splice(self, client: socket.socket, target: PrivateAddress, outside: bool) -> None:
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            upstream.connect(target.name)
        except OSError as e:  # the server is stopping
            log.debug("pool.sock of pod %s: %s", self.pod_uid, e)
            upstream.close()
            client.close()
            return
        splice = _Splice(client, upstream, outside)
        with self._lock:
            self._open[client.fileno()] = splice
        for src, dst in ((client, upstream), (upstream, client)):
            threading.Thread(
                target=self._pump, args=(splice, src, dst), name="node-pool-splice", daemon=True
            ).start()

    def _pump(self, splice: _Splice, src: socket.socket, dst: socket.socket) -> None:
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        try:
            while True:
                n = src.recv_into(buf)
                if not n:
                    break
                dst.sendall(view[:n])
        except OSError:
            pass
        finally:
            splice.shut()
            with self._lock:
                splice.running -= 1
                last = splice.running == 0
                if last:
                    self._open.pop(splice.client.fileno(), None)
            if last:
                splice.client.close()
                splice.upstream.close()
