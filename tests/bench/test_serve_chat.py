"""bench/serve_chat.py, the multi-turn chat client of `serve sweep`, against a real HTTP server.

The server (aiohttp.web, a real socket) speaks the OpenAI streaming chat protocol as vLLM does:
a role chunk, one SSE chunk per token, a finish chunk, a usage chunk (prompt_tokens counted as
the words of the messages' contents, cached_tokens as the longest word prefix shared with an
earlier prompt), `data: [DONE]`. It checks each request's sampling fields and message order
(HTTP 400 otherwise) and records what it saw and how many requests it served at once. The
end-to-end run against a real `vllm serve` is the sweep's test.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

ROOT = Path(__file__).resolve().parents[2]
MODEL = "fake-llama"


sys.path.insert(0, str(ROOT / "bench"))

import serve_chat as sc  # noqa: E402

# fail(n, body) -> None (serve it), "http" (HTTP 500), "stream-error" (vLLM's in-stream error
# object), "drop" (the stream ends without [DONE])
Failure = Callable[[int, dict[str, Any]], "str | None"]


class FakeChatServer:
    """An OpenAI /v1/chat/completions endpoint on 127.0.0.1 that streams like vLLM."""

    def __init__(self, token_delay_s: float = 0.0, fail: Failure | None = None) -> None:
        self.token_delay_s = token_delay_s
        self.fail = fail or (lambda n, body: None)
        self.bodies: list[dict[str, Any]] = []  # accepted requests, in arrival order
        self.replies: dict[int, str] = {}  # request number -> the reply text streamed
        self.prompts: list[list[str]] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> FakeChatServer:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.handle)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    @staticmethod
    def _bad(message: str) -> web.Response:
        err = {"object": "error", "message": message, "type": "BadRequestError", "code": 400}
        return web.json_response(err, status=400)

    def _check(self, body: dict[str, Any]) -> str | None:
        if body.get("model") != MODEL:
            return f"model {body.get('model')!r} does not exist"
        if body.get("stream") is not True or body.get("stream_options") != {"include_usage": True}:
            return "expected stream with stream_options.include_usage"
        if body.get("ignore_eos") is not True or body.get("min_tokens") != body.get("max_tokens"):
            return "expected ignore_eos and min_tokens == max_tokens"
        roles = [m["role"] for m in body["messages"]]
        if roles and roles[0] == "system":
            roles = roles[1:]
        if not roles or roles != ["user", "assistant"] * (len(roles) // 2) + ["user"]:
            return f"bad message order {roles}"
        return None

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        problem = self._check(body)
        if problem:
            return self._bad(problem)
        n = len(self.bodies)
        self.bodies.append(body)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            return await self._serve(request, n, body)
        finally:
            self.in_flight -= 1

    async def _serve(
        self, request: web.Request, n: int, body: dict[str, Any]
    ) -> web.StreamResponse:
        failure = self.fail(n, body)
        if failure == "http":
            err = {"object": "error", "message": "boom", "type": "InternalServerError", "code": 500}
            return web.json_response(err, status=500)
        words = [w for m in body["messages"] for w in m["content"].split()]
        cached = max((_common_prefix(words, p) for p in self.prompts), default=0)
        self.prompts.append(words)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        async def send(obj: Any) -> None:
            data = obj if isinstance(obj, str) else json.dumps(obj)
            await resp.write(f"data: {data}\n\n".encode())

        def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return {
                "id": f"chatcmpl-{n}",
                "object": "chat.completion.chunk",
                "created": 0,
                "model": MODEL,
                "choices": [choice],
            }

        await send(chunk({"role": "assistant", "content": ""}))
        out = [f"w{(n * 7919 + i * 104729) % 128000}" for i in range(body["max_tokens"])]
        for i, word in enumerate(out):
            if self.token_delay_s:
                await asyncio.sleep(self.token_delay_s)
            await send(chunk({"content": word if i == 0 else " " + word}))
            if failure == "stream-error" and i == 1:
                await send(
                    {
                        "error": {
                            "message": "engine died",
                            "type": "InternalServerError",
                            "code": 500,
                        }
                    }
                )
                await send("[DONE]")
                return resp
            if failure == "drop" and i == 1:
                return resp  # the body ends: no finish chunk, no usage, no [DONE]
        await send(chunk({"content": ""}, finish="length"))
        usage = {
            "prompt_tokens": len(words),
            "completion_tokens": len(out),
            "total_tokens": len(words) + len(out),
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        await send(
            {
                "id": f"chatcmpl-{n}",
                "object": "chat.completion.chunk",
                "created": 0,
                "model": MODEL,
                "choices": [],
                "usage": usage,
            }
        )
        await send("[DONE]")
        self.replies[n] = " ".join(out)
        return resp


def _common_prefix(a: list[str], b: list[str]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@pytest.fixture
async def server() -> AsyncIterator[Callable[..., Any]]:
    started: list[FakeChatServer] = []

    async def start(**kwargs: Any) -> FakeChatServer:
        started.append(await FakeChatServer(**kwargs).start())
        return started[-1]

    yield start
    for s in started:
        await s.stop()


def _accounted(w: Any, s: dict[str, Any]) -> int:
    return s["completed"] + s["failed"] + s["cut"] + s["abandoned"] + s["skipped"]


# -- the workload (pure) -------------------------------------------------------------------------


def test_texts_are_seeded_shared_distinct_and_in_vocab():
    w = sc.ChatWorkload(
        conversations=50,
        turns=3,
        system_tokens=20,
        first_user_tokens=30,
        user_tokens=5,
        vocab=1000,
        think_s=2.0,
    )
    assert sc.system_prompt(w) == sc.system_prompt(w)
    assert len(sc.system_prompt(w).split()) == 20
    users = [sc.user_turns(w, c) for c in range(w.conversations)]
    assert users[7] == sc.user_turns(w, 7)  # a function of (seed, conversation) only
    assert [len(u.split()) for u in users[0]] == [30, 5, 5]
    assert len({u[0] for u in users}) == w.conversations  # distinct documents
    ids = {int(word[1:]) for u in users for text in u for word in text.split()}
    assert min(ids) >= 0 and max(ids) <= 999 and len(ids) > 500
    other = sc.ChatWorkload(**{**asdict(w), "seed": 1})
    assert sc.system_prompt(other) != sc.system_prompt(w)
    thinks = [t for c in range(w.conversations) for t in sc.think_times(w, c)[1:]]
    assert all(sc.think_times(w, c)[0] == 0.0 for c in range(3))
    assert 1.4 < statistics.mean(thinks) < 2.6  # exponential, mean think_s (100 samples)
    assert sc.think_times(sc.ChatWorkload(think_s=0.0, turns=3), 0) == [0.0, 0.0, 0.0]
    assert w.sent_words(2) == 20 + 30 + 2 * (w.reply_tokens + 5)


# -- against the server ----------------------------------------------------------------------------


async def test_history_grows_and_every_conversation_shares_the_system_prompt(server):
    srv = await server()
    w = sc.ChatWorkload(
        conversations=5,
        turns=4,
        system_tokens=7,
        first_user_tokens=11,
        user_tokens=5,
        reply_tokens=4,
        think_s=0.0,
        clients=2,
    )
    result = await sc.run_chat(srv.url, MODEL, w, timeout_s=10)
    s = result.summary
    assert (s["completed"], s["failed"], s["skipped"]) == (20, 0, 0)
    for r in result.requests:
        expected = 7 + 11 + r.turn * (4 + 5)
        assert r.prompt_tokens == expected == r.sent_words, r
        assert r.output_tokens == 4 == r.reply_words and r.ttft_s is not None
        assert r.tpot_s is not None
        assert 0 <= r.ttft_s <= r.latency_s
    # conversation c's turn k comes back with exactly what the server streamed at turn k-1
    by_doc: dict[str, list[int]] = {}
    for n, body in enumerate(srv.bodies):
        by_doc.setdefault(body["messages"][1]["content"], []).append(n)
        assert body["messages"][0] == {"role": "system", "content": sc.system_prompt(w)}
    assert len(by_doc) == 5 and all(len(ns) == 4 for ns in by_doc.values())
    for ns in by_doc.values():
        for k, n in enumerate(ns):
            msgs = srv.bodies[n]["messages"]
            assert len(msgs) == 2 + 2 * k
            replies = [m["content"] for m in msgs if m["role"] == "assistant"]
            assert replies == [srv.replies[m] for m in ns[:k]]
    # the server's cache counts: a first turn shares the system prompt, turn k all of turn k-1
    assert sorted(r.cached_tokens for r in result.requests if r.turn == 0) == [0, 7, 7, 7, 7]
    for r in result.requests:
        if r.turn > 0:
            assert r.cached_tokens == 7 + 11 + (r.turn - 1) * (4 + 5)
    assert 0 < s["median_ttft_ms"] <= s["p99_ttft_ms"] and s["median_tpot_ms"] is not None


async def test_think_time_is_waited_between_a_reply_and_the_next_turn(server):
    srv = await server()
    w = sc.ChatWorkload(
        conversations=3,
        turns=3,
        system_tokens=3,
        first_user_tokens=3,
        user_tokens=2,
        reply_tokens=2,
        think_s=0.15,
        clients=3,
        seed=5,
    )
    result = await sc.run_chat(srv.url, MODEL, w, timeout_s=10)
    assert result.summary["completed"] == 9
    by_conv = {
        c: sorted((r for r in result.requests if r.conversation == c), key=lambda r: r.turn)
        for c in range(3)
    }
    thinks = []
    for c, recs in by_conv.items():
        planned = sc.think_times(w, c)
        for prev, cur in zip(recs, recs[1:], strict=False):
            assert cur.think_before_s == planned[cur.turn]
            gap = cur.start_s - (prev.start_s + prev.latency_s)
            assert planned[cur.turn] - 0.005 <= gap <= planned[cur.turn] + 0.3, (c, cur.turn)
            thinks.append(planned[cur.turn])
    assert max(thinks) > 0.05  # the check above waited for something


async def test_clients_bound_the_requests_in_flight(server):
    srv = await server(token_delay_s=0.005)
    w = sc.ChatWorkload(
        conversations=9,
        turns=2,
        system_tokens=2,
        first_user_tokens=2,
        user_tokens=2,
        reply_tokens=4,
        think_s=0.0,
        clients=3,
    )
    result = await sc.run_chat(srv.url, MODEL, w, timeout_s=10)
    assert result.summary["completed"] == 18
    assert srv.max_in_flight == 3
    assert {r.conversation for r in result.requests} == set(range(9))


async def test_the_deadline_cuts_in_flight_requests_and_skips_the_rest(server):
    srv = await server(token_delay_s=0.1)  # a request takes 1 s
    w = sc.ChatWorkload(
        conversations=10,
        turns=3,
        system_tokens=2,
        first_user_tokens=2,
        user_tokens=2,
        reply_tokens=10,
        think_s=0.0,
        clients=2,
    )
    t0 = time.perf_counter()
    result = await sc.run_chat(srv.url, MODEL, w, timeout_s=0.5)
    took = time.perf_counter() - t0
    s = result.summary
    assert took < 1.0 and 0.45 < s["duration_s"] < 1.0
    assert (s["completed"], s["failed"], s["cut"], s["skipped"]) == (0, 0, 2, 28)
    assert all(r.error == sc.DEADLINE for r in result.requests)
    assert _accounted(w, s) == w.total_turns
    assert s["request_throughput"] == 0 and s["median_ttft_ms"] is None


async def test_a_think_time_past_the_deadline_ends_that_client(server):
    srv = await server()
    w = sc.ChatWorkload(
        conversations=10,
        turns=3,
        system_tokens=2,
        first_user_tokens=2,
        user_tokens=2,
        reply_tokens=2,
        think_s=30.0,
        clients=2,
    )
    t0 = time.perf_counter()
    result = await sc.run_chat(srv.url, MODEL, w, timeout_s=0.5)
    assert time.perf_counter() - t0 < 0.5  # it did not wait for the thinks
    s = result.summary
    assert (s["completed"], s["cut"], s["skipped"]) == (2, 0, 28)
    assert _accounted(w, s) == w.total_turns


async def test_failed_responses_are_recorded_and_drop_their_conversation(server):
    # one client: requests arrive c0t0 c0t1 c0t2 | c1t0 (500) | c2t0 c2t1 (error) | c3t0 c3t1
    # c3t2 (dropped stream)
    fails = {3: "http", 5: "stream-error", 8: "drop"}
    srv = await server(fail=lambda n, body: fails.get(n))
    w = sc.ChatWorkload(
        conversations=4,
        turns=3,
        system_tokens=2,
        first_user_tokens=2,
        user_tokens=2,
        reply_tokens=3,
        think_s=0.0,
        clients=1,
    )
    result = await sc.run_chat(srv.url, MODEL, w, timeout_s=10)
    s = result.summary
    assert (s["completed"], s["failed"], s["abandoned"], s["skipped"]) == (6, 3, 3, 0)
    failed = {(r.conversation, r.turn): r for r in result.requests if not r.ok}
    assert set(failed) == {(1, 0), (2, 1), (3, 2)}
    assert failed[(1, 0)].error.startswith("HTTP 500") and failed[(1, 0)].http_status == 500
    assert "engine died" in failed[(2, 1)].error
    assert "[DONE]" in failed[(3, 2)].error
    assert s["request_throughput"] > 0 and s["median_ttft_ms"] is not None


async def test_a_rejected_request_is_a_failure_with_the_servers_message(server):
    srv = await server()
    w = sc.ChatWorkload(
        conversations=2,
        turns=2,
        system_tokens=2,
        first_user_tokens=2,
        user_tokens=2,
        reply_tokens=2,
        think_s=0.0,
        clients=2,
    )
    result = await sc.run_chat(srv.url, "no-such-model", w, timeout_s=10)
    s = result.summary
    assert (s["completed"], s["failed"], s["abandoned"]) == (0, 2, 2)
    assert all("HTTP 400" in r.error and "no-such-model" in r.error for r in result.requests)
