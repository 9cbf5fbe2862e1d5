"""What a session transport needs from the server: the `SessionHost` protocol.

The Session protocol runs over two transports, the gRPC stream (server.py) and the framed Unix
socket (frames.py). Both drive the same host: parse a request, attach, answer calls, detach. The
framed transport depends only on this protocol, not on the servicer that implements it, so
server.py can build a `FramedSessions` without the two modules importing each other.
"""

from __future__ import annotations

from typing import Any, Protocol


class SessionHost(Protocol):
    """The session half of `server.PoolServicer`, as the framed transport calls it."""

    def parse_session_request(self, data: bytes) -> Any:
        """A SessionRequest, or a malformed marker that `session_call` answers INVALID_ARGUMENT."""
        ...

    def attach_session(self, first: Any) -> tuple[int, Any]:
        """(attached client id, reply), or (0, error reply) when the first message is no attach."""
        ...

    def session_call(self, request: Any, client_id: int) -> Any:
        """One in-session call answered; errors come back in the reply, never raised."""
        ...

    def flush_deferred(self) -> None:
        """Bookkeeping the last answer did not need, run after it was sent."""
        ...

    def session_opened(self) -> None: ...

    def session_closed(self) -> None: ...

    def end_session(self, client_id: int) -> None:
        """The transport ended: the client detaches (its pins kept for the detach grace)."""
        ...
