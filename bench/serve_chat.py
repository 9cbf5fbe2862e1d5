"""Multi-turn chat load against a running vLLM OpenAI server (the `chat` points of `serve sweep`).

Offloading pays off when a conversation comes back after its KV blocks left the GPU, so the
workload is chat: `conversations` conversations of `turns` user turns; every request sends the
whole history (one shared system prompt of `system_tokens`, a distinct first user turn of
`first_user_tokens`, then (reply, user turn of `user_tokens`) pairs). `clients` clients each run
one conversation turn by turn, waiting a think time (exponential, mean `think_s`) after each
reply, then take the next: at most `clients` requests are in flight. Replies are greedy and
exactly `reply_tokens` long (ignore_eos), so every configuration sees the same histories. Texts
are words `w{id}` (id < `vocab`): with bench/serve.py's word-level tokenizer N words are N tokens.
Texts and think times depend on (seed, conversation, turn) only.

Accounting: conversations * turns = completed + failed + cut (in flight at the deadline) +
abandoned (after a failed turn of their conversation) + skipped (would start after the deadline).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from harness import spread

DEADLINE = "deadline"  # the error of a request cut by the run's deadline


@dataclass(frozen=True)
class ChatWorkload:
    conversations: int = 64
    turns: int = 6
    system_tokens: int = 1000
    first_user_tokens: int = 2000
    user_tokens: int = 100
    reply_tokens: int = 100
    think_s: float = 1.0
    clients: int = 16
    seed: int = 0
    vocab: int = 128000  # ids from here on are Llama-3's special tokens

    @property
    def total_turns(self) -> int:
        return self.conversations * self.turns

    def sent_words(self, turn: int) -> int:
        """Words of message content in turn `turn`'s request (the prompt less the template)."""
        return (
            self.system_tokens
            + self.first_user_tokens
            + turn * (self.reply_tokens + self.user_tokens)
        )


def _words(rng: random.Random, n: int, vocab: int) -> str:
    return " ".join(f"w{rng.randint(0, vocab - 1)}" for _ in range(n))


def system_prompt(w: ChatWorkload) -> str:
    return _words(random.Random(f"kvo-chat/{w.seed}/system"), w.system_tokens, w.vocab)


def user_turns(w: ChatWorkload, conversation: int) -> list[str]:
    rng = random.Random(f"kvo-chat/{w.seed}/conversation/{conversation}/users")
    first = _words(rng, w.first_user_tokens, w.vocab)
    return [first] + [_words(rng, w.user_tokens, w.vocab) for _ in range(w.turns - 1)]


def think_times(w: ChatWorkload, conversation: int) -> list[float]:
    """The wait before each turn of `conversation` (0 before the first)."""
    rng = random.Random(f"kvo-chat/{w.seed}/conversation/{conversation}/think")
    later = [rng.expovariate(1.0 / w.think_s) if w.think_s > 0 else 0.0 for _ in range(w.turns - 1)]
    return [0.0, *later]


@dataclass
class TurnRecord:
    """One request (seconds; cached_tokens only where the server reports prompt details)."""

    conversation: int
    turn: int
    start_s: float  # since the run started
    think_before_s: float
    sent_words: int
    prompt_tokens: int | None = None
    output_tokens: int = 0
    reply_words: int = 0
    cached_tokens: int | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None
    latency_s: float | None = None
    http_status: int | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class ChatResult:
    workload: ChatWorkload
    summary: dict[str, Any]
    requests: list[TurnRecord] = field(default_factory=list)


def _ms(values: list[float]) -> tuple[float | None, float | None]:
    s = spread(v * 1000.0 for v in values)
    return (None, None) if not s["n"] else (s["p50"], s["p99"])


def summarize(
    w: ChatWorkload, records: list[TurnRecord], duration_s: float, abandoned: int
) -> dict[str, Any]:
    """Counts, throughputs and TTFT/TPOT/latency p50/p99 (ms) of the ok requests, named as
    `vllm bench serve` names them (median_ttft_ms, p99_ttft_ms, ...)."""
    ok = [r for r in records if r.ok]
    cut = sum(1 for r in records if r.error == DEADLINE)
    out_tokens = sum(r.output_tokens for r in ok)
    summary: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(records) - len(ok) - cut,
        "cut": cut,
        "abandoned": abandoned,
        "skipped": w.total_turns - len(records) - abandoned,
        "duration_s": duration_s,
        "request_throughput": len(ok) / duration_s if duration_s > 0 else 0.0,
        "output_throughput": out_tokens / duration_s if duration_s > 0 else 0.0,
    }
    for name, values in (
        ("ttft", [r.ttft_s for r in ok]),
        ("tpot", [r.tpot_s for r in ok]),
        ("e2el", [r.latency_s for r in ok]),
    ):
        summary[f"median_{name}_ms"], summary[f"p99_{name}_ms"] = _ms(
            [v for v in values if v is not None]
        )
    return summary


class _Run:
    """The shared state of one run: the next conversation, the records, the clock."""

    def __init__(self, url: str, model: str, w: ChatWorkload, timeout_s: float) -> None:
        self.url, self.model, self.w = url, model, w
        self.t0 = time.perf_counter()
        self.deadline = self.t0 + timeout_s
        self.system = system_prompt(w)
        self.next_conversation = 0
        self.records: list[TurnRecord] = []
        self.abandoned = 0

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    async def client(self, session: aiohttp.ClientSession) -> None:
        w = self.w
        while self.next_conversation < w.conversations and self.left() > 0:
            c = self.next_conversation
            self.next_conversation += 1
            users, thinks = user_turns(w, c), think_times(w, c)
            messages = [{"role": "system", "content": self.system}] if w.system_tokens else []
            words = w.system_tokens  # of the messages' contents so far
            for t in range(w.turns):
                if thinks[t] >= self.left():
                    return  # this client is busy with the conversation past the deadline
                if thinks[t] > 0:
                    await asyncio.sleep(thinks[t])
                messages.append({"role": "user", "content": users[t]})
                words += w.first_user_tokens if t == 0 else w.user_tokens
                record = TurnRecord(c, t, 0.0, thinks[t], words)
                reply = await self.turn(session, record, messages)
                self.records.append(record)
                if not record.ok:
                    if record.error != DEADLINE:
                        self.abandoned += w.turns - t - 1
                    break
                messages.append({"role": "assistant", "content": reply})
                words += record.reply_words

    async def turn(
        self, session: aiohttp.ClientSession, rec: TurnRecord, messages: list[dict[str, str]]
    ) -> str:
        """Send `messages`, stream the reply into `rec`; the reply text ("" when failed)."""
        payload = {
            "model": self.model, "messages": messages, "max_tokens": self.w.reply_tokens,
            "min_tokens": self.w.reply_tokens, "ignore_eos": True, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True},
        }  # fmt: skip
        start = time.perf_counter()
        rec.start_s = start - self.t0
        parts: list[str] = []
        completion: int | None = None
        done = False
        try:
            timeout = aiohttp.ClientTimeout(total=max(self.left(), 0.001))
            async with session.post(self.url, json=payload, timeout=timeout) as resp:
                rec.http_status = resp.status
                if resp.status != 200:
                    rec.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                    return ""
                async for raw in resp.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue  # blank separators, comments, event/id fields
                    if (data := line[5:].strip()) == b"[DONE]":
                        done = True
                        break
                    obj = json.loads(data)
                    if obj.get("error"):
                        rec.error = f"stream error: {json.dumps(obj['error'])[:300]}"
                        return ""
                    if usage := obj.get("usage"):
                        rec.prompt_tokens = usage.get("prompt_tokens")
                        completion = usage.get("completion_tokens")
                        details = usage.get("prompt_tokens_details") or {}
                        if details.get("cached_tokens") is not None:
                            rec.cached_tokens = int(details["cached_tokens"])
                    for choice in obj.get("choices") or ():
                        if text := (choice.get("delta") or {}).get("content"):
                            if rec.ttft_s is None:
                                rec.ttft_s = time.perf_counter() - start
                            parts.append(text)
            rec.latency_s = time.perf_counter() - start
            if not done:
                rec.error = "stream ended before data: [DONE]"
            elif rec.ttft_s is None:
                rec.error = "no content in the reply"
        except asyncio.TimeoutError:  # the request's timeout is what was left of the run's
            rec.error = DEADLINE
        except Exception as e:  # a failed request is data, never the end of the run
            rec.error = f"{type(e).__name__}: {e}"[:300]
        if not rec.ok:
            return ""
        rec.output_tokens = completion if completion is not None else len(parts)
        if rec.output_tokens > 1 and rec.latency_s is not None and rec.ttft_s is not None:
            rec.tpot_s = (rec.latency_s - rec.ttft_s) / (rec.output_tokens - 1)
        reply = "".join(parts)
        rec.reply_words = len(reply.split())
        return reply


async def run_chat(
    base_url: str, model: str, workload: ChatWorkload, timeout_s: float
) -> ChatResult:
    """Run `workload` against the OpenAI server at `base_url` until done or `timeout_s` passed."""
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
    run = _Run(base_url.rstrip("/") + "/v1/chat/completions", model, workload, timeout_s)
    connector = aiohttp.TCPConnector(limit=workload.clients)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=None)
    ) as session:
        await asyncio.gather(*(run.client(session) for _ in range(workload.clients)))
    records = sorted(run.records, key=lambda r: (r.start_s, r.conversation, r.turn))
    duration = time.perf_counter() - run.t0
    summary = summarize(workload, records, duration, run.abandoned)
    return ChatResult(workload, summary, records)
