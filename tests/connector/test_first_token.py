"""connector/first_token.py: which requests' first output token may not be out yet."""

from __future__ import annotations

from kvoffload_connector.scheduler.first_token import FirstTokenWatch


def test_a_request_awaits_its_first_token_until_it_has_two() -> None:
    counts: dict[str, int | None] = {"a": 0}
    watch = FirstTokenWatch(counts.get)
    watch.add("a")
    assert watch.awaits("a") and watch.any_pending()
    assert not watch.any_in_this_output()  # prefill not done: no token in this output
    counts["a"] = 1
    assert watch.awaits("a") and watch.any_in_this_output()
    counts["a"] = 2  # the first token's output went out a step ago
    assert not watch.awaits("a")
    assert not watch.any_pending() and len(watch) == 0  # forgotten as it was read


def test_finished_requests_and_requests_without_a_count_are_forgotten() -> None:
    counts: dict[str, int | None] = {"done": 0, "odd": None, "new": 0}
    watch = FirstTokenWatch(counts.get)
    for req_id in counts:
        watch.add(req_id)
    del counts["done"]  # finished or aborted: the scheduler no longer knows it
    assert not watch.awaits("done") and not watch.awaits("odd")
    assert watch.any_pending()  # "new" still waits
    counts["new"] = 5
    assert not watch.any_pending() and len(watch) == 0
    watch.add("x")
    watch.discard("x")
    assert len(watch) == 0


def test_newly_out_reports_each_first_token_once() -> None:
    counts: dict[str, int | None] = {"a": 0, "b": 0}
    watch = FirstTokenWatch(counts.get)
    watch.add("a")
    watch.add("b")
    assert not watch.newly_out()  # no token yet
    counts["a"] = 1
    assert watch.newly_out() and not watch.newly_out()  # a's, once
    counts["b"] = 1
    counts["a"] = 2
    assert watch.newly_out() and not watch.newly_out()  # b's; a is forgotten
    assert len(watch) == 1
    watch.add("a2")
    counts["a2"] = 1
    watch.discard("a2")
    assert not watch.newly_out()  # discarded before its token was reported
