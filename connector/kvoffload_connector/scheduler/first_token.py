"""Which requests' first output token may not have left vLLM's engine process yet.

vLLM's engine hands the output that carries a step's tokens to its output thread, which
serializes and sends it while the main thread schedules the next step. Anything the scheduler
side does in that step (store planning, a stats object the API server handles before it
streams the token, an RPC's callback taking the GIL) lands in a request's time to first
token. The scheduler asks this watch before doing work that can wait: while a request has
no output token, and while it has exactly one, its first token may not be out; with two,
the first went out a step ago.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator


class FirstTokenWatch:
    """The requests not yet past their first output token. `output_count(req_id)` is the
    request's output-token count, or None once it is finished or aborted (or has no count):
    the watch forgets such requests, and those with two tokens and more, as it reads them."""

    def __init__(self, output_count: Callable[[str], int | None]) -> None:
        self._output_count = output_count
        self._watched: set[str] = set()
        self._handed: set[str] = set()  # first tokens `newly_out` reported already

    def add(self, req_id: str) -> None:
        self._watched.add(req_id)

    def discard(self, req_id: str) -> None:
        self._watched.discard(req_id)
        self._handed.discard(req_id)

    def awaits(self, req_id: str) -> bool:
        """This request's first token may not have left the engine yet."""
        n = self._output_count(req_id)
        return isinstance(n, int) and n < 2

    def any_pending(self) -> bool:
        """Some request's first token may not have left the engine yet."""
        return any(True for _ in self._counts())

    def any_in_this_output(self) -> bool:
        """Some request has exactly one token: the output being built carries its first."""
        return any(n == 1 for n in self._counts())

    def newly_out(self) -> bool:
        """Some request's first token was appended since the last call: the output vLLM just
        handed to its output thread carries it (each request is reported once)."""
        new = False
        for req_id, n in self._live():
            if n == 1 and req_id not in self._handed:
                self._handed.add(req_id)
                new = True
        return new

    def __len__(self) -> int:
        return len(self._watched)

    def _counts(self) -> Iterator[int]:
        return (n for _, n in self._live())

    def _live(self) -> Iterator[tuple[str, int]]:
        """(request, output-token count) of the watched requests still before their second
        token; the others are forgotten as they are read."""
        for req_id in list(self._watched):
            n = self._output_count(req_id)
            if isinstance(n, int) and n < 2:
                yield req_id, n
            else:
                self._watched.discard(req_id)
                self._handed.discard(req_id)
