"""Domain errors of the pool core.

The gRPC servicer maps each class to the status code of the same name in one table; `str(e)` is
the message the client sees, so every raise site says what was wrong and with which value.
A connector treats every one of them as a cache miss.
"""

from __future__ import annotations

__all__ = [
    "FailedPrecondition",
    "InvalidArgument",
    "NotFound",
    "PoolError",
    "ResourceExhausted",
    "Unavailable",
]


class PoolError(Exception):
    """Base of all domain errors; never raised itself."""


class InvalidArgument(PoolError):
    """The request is malformed (bad key length, rank out of range, bad spec)."""


class NotFound(PoolError):
    """Unknown namespace, client, pin or store id (or one owned by someone else)."""


class FailedPrecondition(PoolError):
    """The request is well formed but contradicts the pool's state (e.g. a rank-count mismatch)."""


class ResourceExhausted(PoolError):
    """No partition left for a new namespace, or a partition too small for one slot."""


class Unavailable(PoolError):
    """The pool is draining: no new registrations or reservations."""
