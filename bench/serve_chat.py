"""Multi-turn chat load against a running vLLM OpenAI server, one JSON per run.

Offloading pays off when a conversation comes back after its KV blocks left the GPU, so the
workload is chat: `conversations` conversations of `turns` user turns each; every request sends
the whole history (system + (user, assistant)* + the new user turn), so turn k's prompt is
turn k-1's prompt plus its reply plus the new user text. `clients` clients each run one
conversation turn by turn (waiting a think time after each reply) and then take the next: at
most `clients` requests are in flight, and that is the load knob of a closed-loop sweep.

Workload parameters (`ChatWorkload`, written into the JSON under "workload"):

    conversations      conversations in the run, taken in order 0..n-1 by free clients
    turns              user turns per conversation (a request each)
    system_tokens      ONE system prompt shared by all conversations: the prefix every request
                       shares (0: no system message)
    first_user_tokens  the first user turn, distinct per conversation (a document)
    user_tokens        each later user turn
    reply_tokens       max_tokens = min_tokens with ignore_eos: every reply has that length
    think_s            mean wait between a reply and the next turn of that conversation
                       (exponential, seeded per conversation; 0: none)
    clients            conversations active at once
    seed               texts and think times are a function of (seed, conversation, turn) only,
                       so every configuration of a sweep sees the same prompts
    vocab              words are `w{id}`, id uniform in [0, vocab): with bench/serve.py's
                       WordLevel tokenizer a text of N words is N tokens (ids >= 128000 are
                       Llama-3 special tokens, hence the cap)

Replies are greedy (temperature 0), so the same model gives the same replies, hence the same
histories, under every configuration. Turn k's prompt holds system_tokens + first_user_tokens +
k * (reply_tokens + user_tokens) words of content (recorded as `sent_words`; the server's
`prompt_tokens` adds the chat template's tokens).

How it maps to vLLM's benchmarks/multi_turn (benchmark_serving_multi_turn.py with a
generate_multi_turn.json of "generate_conversations"):

    num_conversations                      -> conversations
    prompt_input.num_turns (user+assistant) -> 2 * turns
    prompt_input.common_prefix_num_tokens   -> system_tokens (there: the start of every first
                                               user turn; here: a shared system message)
    prompt_input.prefix_num_tokens          -> first_user_tokens
    prompt_input.num_tokens                 -> user_tokens
    prompt_output.num_tokens, --limit-min-tokens/--limit-max-tokens -> reply_tokens
    --num-clients x --max-active-conversations -> clients (one active conversation per client)
    --request-rate (a client's Poisson pause between its requests) -> think_s (a conversation's
                                               pause between a reply and its next turn)

Differences, on purpose: constant lengths instead of distributions and synthetic words instead of
a book's text (every prompt's length is known exactly); one asyncio process; no retries (a
failed turn is recorded and its conversation dropped, as vLLM's client drops it); token counts
come from the server's `usage` (stream_options.include_usage) instead of re-tokenizing.

Per request: conversation, turn, start_s, think_before_s, sent_words, prompt_tokens,
output_tokens, reply_words, cached_tokens (only when the server reports
usage.prompt_tokens_details; vLLM does with `--enable-prompt-tokens-details`), ttft_s (sent ->
first content delta), tpot_s ((latency - ttft) / (output_tokens - 1)), latency_s, http_status,
error.

Accounting: conversations * turns = completed + failed + cut + abandoned + skipped, where `cut`
requests were in flight at the deadline, `abandoned` turns followed a failed turn of their
conversation and `skipped` turns would have started after the deadline.

    python bench/serve_chat.py --base-url http://127.0.0.1:8000 --model NAME \
        [--conversations 64 --turns 6 --system-tokens 1000 --first-user-tokens 2000 \
         --user-tokens 100 --reply-tokens 100 --think-s 1.0 --clients 16 --seed 0 \
         --vocab 128000] [--timeout-s 300] [--out result.json]

Exit status: 0 when it ran (failed requests are data), 2 on bad arguments, 1 when no request got
an HTTP answer from the server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

try:
    import aiohttp
except ImportError as _e:  # the GPU image has it; say so instead of a bare traceback
    raise SystemExit(
        f"bench/serve_chat.py needs aiohttp ({_e}); pip install aiohttp (vLLM depends on it)"
    ) from None

_BENCH = str(Path(__file__).resolve().parent)
if _BENCH not in sys.path:
    sys.path.insert(0, _BENCH)

from harness import machine, spread  # noqa: E402 - after the path set-up above

LLAMA3_SPECIAL_FROM = 128000  # ids from here on are Llama-3 special tokens
DEADLINE = "deadline"  # the error of a request cut by the run's deadline


@dataclass(frozen=True)
class ChatWorkload:
    """What a chat run sends; see the module docstring for each field."""

    conversations: int = 64
    turns: int = 6
    system_tokens: int = 1000
    first_user_tokens: int = 2000
    user_tokens: int = 100
    reply_tokens: int = 100
    think_s: float = 1.0
    clients: int = 16
    seed: int = 0
    vocab: int = LLAMA3_SPECIAL_FROM

    def __post_init__(self) -> None:
        at_least = {
            "conversations": 1,
            "turns": 1,
            "system_tokens": 0,
            "first_user_tokens": 1,
            "user_tokens": 1,
            "reply_tokens": 1,
            "clients": 1,
            "vocab": 1,
        }
        for name, low in at_least.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if self.vocab > LLAMA3_SPECIAL_FROM:
            raise ValueError(
                f"vocab must be <= {LLAMA3_SPECIAL_FROM} (ids from there on are Llama-3 special"
                f" tokens), got {self.vocab}"
            )
        if not (isinstance(self.think_s, (int, float)) and math.isfinite(self.think_s)) or (
            self.think_s < 0
        ):
            raise ValueError(f"think_s must be a finite number >= 0, got {self.think_s!r}")

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
    """The one system prompt every conversation starts with."""
    return _words(random.Random(f"kvo-chat/{w.seed}/system"), w.system_tokens, w.vocab)


def user_turns(w: ChatWorkload, conversation: int) -> list[str]:
    """Conversation `conversation`'s user texts: the long first turn, then the later ones."""
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
    """One request: what was sent, what the server said, how long it took (seconds)."""

    conversation: int
    turn: int
    start_s: float  # since the run started
    think_before_s: float  # the think time waited before this turn
    sent_words: int  # words of the messages' contents (the prompt less the chat template)
    prompt_tokens: int | None = None
    output_tokens: int = 0
    reply_words: int = 0  # words of the streamed reply (== output_tokens with serve.py's model)
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
    """A run: its workload, the summary (see `summarize`) and every request."""

    workload: ChatWorkload
    summary: dict[str, Any]
    requests: list[TurnRecord] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "workload": asdict(self.workload),
            "summary": self.summary,
            "requests": [asdict(r) for r in self.requests],
        }


def _ms(values: list[float]) -> dict[str, float | None]:
    s = spread(v * 1000.0 for v in values)
    return {k: (None if math.isnan(s[k]) else s[k]) for k in ("p50", "p99")}


def summarize(
    w: ChatWorkload, records: list[TurnRecord], duration_s: float, abandoned: int, in_flight: int
) -> dict[str, Any]:
    """Counts, throughputs and TTFT/TPOT/latency p50/p99 (ms) of the ok requests, with the
    names `vllm bench serve` uses written as well (median_ttft_ms, p99_ttft_ms, ...)."""
    ok = [r for r in records if r.ok]
    cut = sum(1 for r in records if r.error == DEADLINE)
    failed = len(records) - len(ok) - cut
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens or 0 for r in ok)
    ttft = _ms([r.ttft_s for r in ok if r.ttft_s is not None])
    later = _ms([r.ttft_s for r in ok if r.ttft_s is not None and r.turn > 0])
    tpot = _ms([r.tpot_s for r in ok if r.tpot_s is not None])
    lat = _ms([r.latency_s for r in ok if r.latency_s is not None])
    with_cached = [r for r in ok if r.cached_tokens is not None and r.prompt_tokens]
    cached_fraction = (
        sum(r.cached_tokens or 0 for r in with_cached)
        / sum(r.prompt_tokens or 0 for r in with_cached)
        if with_cached
        else None
    )

    def rate(n: float) -> float:
        return n / duration_s if duration_s > 0 else 0.0

    summary: dict[str, Any] = {
        "completed": len(ok),
        "failed": failed,
        "cut": cut,
        "abandoned": abandoned,
        "skipped": w.total_turns - len(records) - abandoned,
        "short_replies": sum(1 for r in ok if r.output_tokens != w.reply_tokens),
        "duration_s": duration_s,
        "request_throughput": rate(len(ok)),
        "output_throughput": rate(out_tokens),
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "mean_prompt_tokens": in_tokens / len(ok) if ok else None,
        "cached_fraction": cached_fraction,
        "max_in_flight": in_flight,
        "ttft_ms_p50": ttft["p50"],
        "ttft_ms_p99": ttft["p99"],
        "later_turns_ttft_ms_p50": later["p50"],
        "later_turns_ttft_ms_p99": later["p99"],
        "tpot_ms_p50": tpot["p50"],
        "tpot_ms_p99": tpot["p99"],
        "latency_ms_p50": lat["p50"],
        "latency_ms_p99": lat["p99"],
    }
    summary.update(
        {
            "median_ttft_ms": ttft["p50"],
            "p99_ttft_ms": ttft["p99"],
            "median_tpot_ms": tpot["p50"],
            "p99_tpot_ms": tpot["p99"],
            "median_e2el_ms": lat["p50"],
            "p99_e2el_ms": lat["p99"],
        }
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
        self.in_flight = 0
        self.max_in_flight = 0

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    async def client(self, session: aiohttp.ClientSession) -> None:
        w = self.w
        while self.next_conversation < w.conversations and self.left() > 0:
            c = self.next_conversation
            self.next_conversation += 1
            users, thinks = user_turns(w, c), think_times(w, c)
            messages: list[dict[str, str]] = (
                [{"role": "system", "content": self.system}] if w.system_tokens else []
            )
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
        self,
        session: aiohttp.ClientSession,
        rec: TurnRecord,
        messages: list[dict[str, str]],
    ) -> str:
        """Send `messages`, stream the reply into `rec`; the reply text ("" when failed)."""
        w = self.w
        payload = {
            "model": self.model,
            "messages": messages,
            "max_tokens": w.reply_tokens,
            "min_tokens": w.reply_tokens,
            "ignore_eos": True,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        start = time.perf_counter()
        rec.start_s = start - self.t0
        parts: list[str] = []
        chunks = 0
        completion: int | None = None
        done = False
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            timeout = aiohttp.ClientTimeout(total=max(self.left(), 0.001))
            async with session.post(self.url, json=payload, timeout=timeout) as resp:
                rec.http_status = resp.status
                if resp.status != 200:
                    body = (await resp.text())[:300]
                    rec.error = f"HTTP {resp.status}: {body}"
                    return ""
                async for raw in resp.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue  # blank separators, comments, event/id fields
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        done = True
                        break
                    obj = json.loads(data)
                    if obj.get("error"):
                        rec.error = f"stream error: {json.dumps(obj['error'])[:300]}"
                        return ""
                    usage = obj.get("usage")
                    if usage:
                        rec.prompt_tokens = usage.get("prompt_tokens")
                        completion = usage.get("completion_tokens")
                        details = usage.get("prompt_tokens_details") or {}
                        if details.get("cached_tokens") is not None:
                            rec.cached_tokens = int(details["cached_tokens"])
                    for choice in obj.get("choices") or ():
                        text = (choice.get("delta") or {}).get("content")
                        if text:
                            if rec.ttft_s is None:
                                rec.ttft_s = time.perf_counter() - start
                            parts.append(text)
                            chunks += 1
            rec.latency_s = time.perf_counter() - start
            if not done:
                rec.error = "stream ended before data: [DONE]"
            elif rec.ttft_s is None:
                rec.error = "no content in the reply"
        except asyncio.TimeoutError:  # the request's timeout is what was left of the run's
            rec.error = DEADLINE
        except Exception as e:  # a failed request is data, never the end of the run
            rec.error = f"{type(e).__name__}: {e}"[:300]
        finally:
            self.in_flight -= 1
        if not rec.ok:
            return ""
        rec.output_tokens = completion if completion is not None else chunks
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
    duration = time.perf_counter() - run.t0
    records = sorted(run.records, key=lambda r: (r.start_s, r.conversation, r.turn))
    summary = summarize(workload, records, duration, run.abandoned, run.max_in_flight)
    return ChatResult(workload, summary, records)


def summary_line(s: dict[str, Any]) -> str:
    def f(v: Any, spec: str = ".1f") -> str:
        return "-" if v is None else format(v, spec)

    return (
        f"chat: {s['completed']} ok, {s['failed']} failed, {s['cut']} cut, "
        f"{s['abandoned']} abandoned, {s['skipped']} skipped in {s['duration_s']:.1f} s; "
        f"{s['request_throughput']:.2f} req/s, {s['output_throughput']:.0f} tok/s; "
        f"TTFT p50/p99 {f(s['ttft_ms_p50'])}/{f(s['ttft_ms_p99'])} ms, "
        f"TPOT p50/p99 {f(s['tpot_ms_p50'], '.2f')}/{f(s['tpot_ms_p99'], '.2f')} ms"
        + (f", cached {s['cached_fraction']:.1%}" if s["cached_fraction"] is not None else "")
    )


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    p.add_argument("--model", required=True, help="the served model name")
    p.add_argument("--timeout-s", type=float, default=300.0, help="the run's deadline")
    p.add_argument("--out", type=Path, help="the JSON file to write")
    defaults = ChatWorkload()
    for fld in fields(ChatWorkload):
        flag = "--" + fld.name.replace("_", "-")
        kind = float if fld.name == "think_s" else int
        p.add_argument(flag, type=kind, default=getattr(defaults, fld.name))
    return p


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        workload = ChatWorkload(**{f.name: getattr(args, f.name) for f in fields(ChatWorkload)})
    except ValueError as e:
        parser.error(str(e))  # exits 2
    if not args.timeout_s > 0:
        parser.error(f"--timeout-s must be > 0, got {args.timeout_s}")
    result = asyncio.run(run_chat(args.base_url, args.model, workload, args.timeout_s))
    print(summary_line(result.summary), flush=True)
    payload = {
        **result.to_json(),
        "run": {"base_url": args.base_url, "model": args.model, "timeout_s": args.timeout_s},
        "machine": machine(),
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(payload, indent=1) + "\n")
        print(f"wrote {args.out}")
    if not any(r.http_status is not None for r in result.requests):
        first = result.requests[0].error if result.requests else "no request was sent"
        print(
            f"serve_chat: the server at {args.base_url} never answered ({first})", file=sys.stderr
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
