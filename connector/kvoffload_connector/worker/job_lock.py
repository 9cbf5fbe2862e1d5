"""The job lock of a worker rank.

Two threads touch a rank's job tables, reports and stats: vLLM's step thread (the hooks) and
the store completion thread (store_completion.py), which commits stores that finish between
steps. Every entry point that touches them runs under the worker's `_jobs_lock`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

_F = TypeVar("_F", bound=Callable[..., Any])


def jobs_locked(fn: _F) -> _F:
    """Run a step-thread entry point under the job lock: the completion thread handles
    finished jobs under it too (job tables, reports, stats)."""

    @functools.wraps(fn)
    def locked(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self._jobs_lock:
            return fn(self, *args, **kwargs)

    return locked  # type: ignore[return-value]
