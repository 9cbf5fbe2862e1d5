"""Just enough POSIX shell lexing to place a flag in a ``sh -c`` script correctly (pure).

Why: a script's text is parsed by the shell once, and once more where it goes through ``eval``
(KServe's LLMInferenceService runs ``eval "exec vllm serve … $@"``) or a nested ``sh -c "…"``.
A flag quoted for one parse loses its quotes in the second (the JSON arrives as
``{kv_connector:KVOffloadConnector,…}``), so the injector must know, at the point of insertion,
which quotes are open and what consumes the quoted string. Comments and test expressions
(``[[ "$*" != *--kv-transfer-config* ]]``) only read settings, so conflict checks ignore them.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from enum import Enum

NONE, SINGLE, DOUBLE = "none", "single", "double"
SHELLS = frozenset({"sh", "bash", "dash", "ash", "zsh", "busybox"})
_SEPARATORS = re.compile(r"(?:;|&&|\|\||[|&({\n]|\bthen\b|\bdo\b|\belse\b)")


class Parse(str, Enum):
    """How often the text at the insertion point is parsed as shell before vLLM sees it."""

    ONCE = "once"  # plain script text
    EVAL = "eval"  # unquoted words of an ``eval`` command: parsed twice
    EVAL_DOUBLE = "eval-double"  # inside "…" handed to ``eval`` or ``sh -c``
    EVAL_SINGLE = "eval-single"  # inside '…' handed to ``eval`` or ``sh -c``


@dataclass(frozen=True)
class Context:
    """The quoting at one offset of a script: the innermost open quote and where it opened."""

    state: str  # NONE, SINGLE or DOUBLE
    opened_at: int  # offset of the opening quote (-1 when state is NONE)


COMMENT = "comment"


def contexts(script: str) -> list[Context]:
    """The quote context at every offset of ``script`` (and one past its end), in one pass.
    Command substitutions ``$(…)`` inside "…" restart the context; comments are COMMENT."""
    out: list[Context] = []
    stack: list[tuple[str, int]] = [(NONE, -1)]
    i, n = 0, len(script)

    def current() -> Context:
        for state, at in reversed(stack):
            if state in (SINGLE, DOUBLE, COMMENT):
                return Context(state, at)
            if state == "subst":
                break
        return Context(NONE, -1)

    while i < n:
        out.append(current())
        state = stack[-1][0]
        c = script[i]
        if state == COMMENT:
            if c == "\n":
                stack.pop()
        elif state == SINGLE:
            if c == "'":
                stack.pop()
        elif c == "\\":
            if i + 1 < n:
                out.append(current())
                i += 1  # the next character is literal
        elif state == DOUBLE:
            if c == '"':
                stack.pop()
            elif script.startswith("$(", i):
                stack.append(("subst", i))
                out.append(current())
                i += 1
        elif c == "'":
            stack.append((SINGLE, i))
        elif c == '"':
            stack.append((DOUBLE, i))
        elif c == ")" and state == "subst":
            stack.pop()
        elif c == "#" and (i == 0 or script[i - 1] in " \t\n;&|("):
            stack.append((COMMENT, i))
            out[-1] = current()
        i += 1
    out.append(current())
    return out


def context_at(script: str, offset: int) -> Context:
    return contexts(script)[offset]


def blank_reads(script: str) -> str:
    """``script`` with comments and test expressions (``[[ … ]]``, ``[ … ]``) blanked out, the
    same length so offsets still match: what is left is what configures and runs things."""
    ctx = contexts(script)
    out = [" " if ctx[i].state == COMMENT and ch != "\n" else ch for i, ch in enumerate(script)]
    for m in re.finditer(r"(?<![^\s;&|(])(\[\[\s.*?\]\]|\[\s.*?\s\])", script):
        if ctx[m.start()].state == NONE:
            for j in range(m.start(), m.end()):
                if out[j] != "\n":
                    out[j] = " "
    return "".join(out)


def command_words(script: str, offset: int, ctx: list[Context] | None = None) -> list[str]:
    """The words of the simple command that ``offset`` is in, before ``offset`` (roughly: from
    the last separator; good enough to tell ``eval "…`` or ``sh -c "…`` from ``echo "…``)."""
    ctx = ctx if ctx is not None else contexts(script)
    head = script[:offset]
    starts = [m.end() for m in _SEPARATORS.finditer(head) if ctx[m.start()].state == NONE]
    start = max(starts, default=0)
    return head[start:].replace("\\\n", " ").split()


def consumer(script: str, engine_start: int, ctx: list[Context] | None = None) -> Parse | None:
    """How the engine invocation at ``engine_start`` is parsed before vLLM sees it: ONCE or
    twice (EVAL*); None when it is quoted data for some other command (``echo "…"``), or quoted
    in a way this lexer does not follow (a comment, a string inside a string)."""
    ctx = ctx if ctx is not None else contexts(script)
    here = ctx[engine_start]
    if here.state == COMMENT:
        return None
    if here.state != NONE and ctx[here.opened_at].state != NONE:
        return None  # a quote inside a quote: three parses or more, not followed
    at = engine_start if here.state == NONE else here.opened_at
    words = [w.strip("\"'") for w in command_words(script, at, ctx)]
    reparsed = "eval" in words or _shell_dash_c(words)
    if here.state == NONE:
        return Parse.EVAL if reparsed else Parse.ONCE
    if not reparsed:
        return None
    return Parse.EVAL_DOUBLE if here.state == DOUBLE else Parse.EVAL_SINGLE


def _shell_dash_c(words: list[str]) -> bool:
    for i, w in enumerate(words):
        if w.rsplit("/", 1)[-1] in SHELLS or w == "su":
            return any(x.startswith("-") and "c" in x for x in words[i + 1 :])
    return False


def flag_text(parse: Parse, flag: str, value: str) -> str:
    """The text to insert (after the engine's words) so that vLLM receives ``flag`` and
    ``value`` as two arguments, ``value`` byte for byte, whatever parses come in between."""
    once = f" {flag} {shlex.quote(value)}"
    if parse is Parse.ONCE:
        return once
    if parse is Parse.EVAL:
        return f" {flag} {shlex.quote(shlex.quote(value))}"
    if parse is Parse.EVAL_DOUBLE:  # inside "…": \ " $ ` are the characters still special
        return re.sub(r'([\\"$`])', r"\\\1", once)
    # inside '…': close the quote, add the text quoted on its own, reopen (one shell word)
    return f"'{shlex.quote(once)}'"
