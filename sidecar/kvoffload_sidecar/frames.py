"""The Session protocol over a plain Unix stream socket: the connector's hot path without gRPC.

A lookup or reservation is a few hundred microseconds of Python gRPC round trip before the pool
does any work (HTTP/2 framing, the completion queue, per-message callbacks on both sides:
docs/BENCHMARKS.md, "Sidecar RPC"). This socket carries the same `kvoffload.v1` messages with
the same rules as the `Session` stream, each framed as a 4-byte little-endian length and the
serialized message: attach first, answers in order, and the connection owns the client's pins
(released, after the detach grace, when it closes). Registration, stats and health stay on gRPC.

Bad input gets what the gRPC stream gives it: a frame that does not parse is answered with an
INVALID_ARGUMENT `SessionError` (seq 0); a length above the gRPC message limit, or a connection
that ends inside a frame, closes that connection only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from kvoffload_sidecar.config import FRAMED_SUFFIX, remove_stale_socket

if TYPE_CHECKING:
    from kvoffload_sidecar.server import PoolServicer

log = logging.getLogger(__name__)

HEADER = struct.Struct("<I")


def socket_path_for(grpc_socket: Path) -> Path:
    """Where the framed socket of a sidecar serving gRPC on `grpc_socket` listens."""
    return grpc_socket.with_name(grpc_socket.name + FRAMED_SUFFIX)


class FrameTooLarge(Exception):
    """A frame announced more bytes than a message may have: the connection is closed."""


async def read_frame(reader: asyncio.StreamReader, max_bytes: int) -> bytes | None:
    """One frame's payload; None at a clean end of the connection (between frames)."""
    try:
        header = await reader.readexactly(HEADER.size)
    except asyncio.IncompleteReadError as e:
        if e.partial:
            raise
        return None
    (size,) = HEADER.unpack(header)
    if size > max_bytes:
        raise FrameTooLarge(f"frame of {size} bytes is above the {max_bytes}-byte limit")
    return await reader.readexactly(size)


def frame(message: bytes) -> bytes:
    return HEADER.pack(len(message)) + message


@dataclass
class FramedSessions:
    """The framed socket's server, bound to one `PoolServicer` (its handlers and counters)."""

    servicer: PoolServicer
    path: Path
    max_frame_bytes: int
    server: asyncio.AbstractServer | None = None
    _writers: set[asyncio.StreamWriter] = field(default_factory=set)

    async def start(self) -> None:
        remove_stale_socket(self.path)
        self.server = await asyncio.start_unix_server(
            self._serve, path=str(self.path), limit=1 << 20
        )
        log.info("framed sessions on %s", self.path)

    async def stop(self, grace_s: float) -> None:
        """Stop accepting, close every connection (their sessions detach), unlink the socket."""
        if self.server is None:
            return
        self.server.close()
        for writer in list(self._writers):
            writer.close()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.server.wait_closed(), grace_s)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        self.server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        servicer = self.servicer
        parse = servicer.parse_session_request
        client_id = 0
        self._writers.add(writer)
        servicer.open_sessions += 1
        try:
            first = await read_frame(reader, self.max_frame_bytes)
            if first is None:
                return
            client_id, reply = servicer.attach_session(parse(first))
            writer.write(frame(reply.SerializeToString()))
            await writer.drain()
            if not client_id:
                return  # the error went back as a SessionError; the connection ends
            call, flush = servicer.session_call, servicer.flush_deferred
            while True:
                payload = await read_frame(reader, self.max_frame_bytes)
                if payload is None:
                    return
                writer.write(frame(call(parse(payload), client_id).SerializeToString()))
                await writer.drain()
                flush()  # bookkeeping the answer did not need, after sending
        except FrameTooLarge as e:
            log.warning("framed session of client %d closed: %s", client_id, e)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client went away mid-frame: same as a dropped stream
        finally:
            self._writers.discard(writer)
            servicer.open_sessions -= 1
            servicer.end_session(client_id)
            writer.close()
