"""Just enough POSIX shell lexing to place a flag in a ``sh -c`` script correctly (pure).

Why: a script's text is parsed by the shell once, and once more where it goes through ``eval``
(KServe's LLMInferenceService runs ``eval "exec vllm serve … $@"``) or a nested ``sh -c "…"``.
A flag quoted for one parse loses its quotes in the second (the JSON arrives as
``{kv_connector:KVOffloadConnector,…}``), so the injector must know, at the point of insertion,
which quotes are open and what consumes the quoted string. Comments and test expressions
(``[[ "$*" != *--kv-transfer-config* ]]``) only read settings, so conflict checks ignore them.
A here-document's text is data for the command it feeds, never a command of the script: the
lexer marks it (`HEREDOC`), and `heredoc_runs` says when that data may still run (fed to a
shell, written to a file the script uses again) or where it cannot tell. `runs_arguments`
finds a script that runs its positional parameters (``exec "$@"``).
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
HEREDOC = "heredoc"  # the text of a here-document and its end line (opened_at: its ``<<``)
# commands that only read a here-document as data (none of them runs what it reads)
DATA_READERS = frozenset(
    {"cat", "tee", "envsubst", "head", "tail", "wc", "base64", "tr", "sort", "true", ":"}
)
_ASSIGNMENT = re.compile(r"^[A-Za-z_]\w*=")


@dataclass(frozen=True)
class Heredoc:
    """One here-document: ``<<WORD`` at ``op`` (the word ends at ``word_end``), its text
    ``script[body[0]:body[1]]``, after the newline at ``line_end``."""

    op: int
    word_end: int
    delimiter: str
    quoted: bool  # a quoted delimiter: the text is not expanded
    line_end: int
    body: tuple[int, int]
    terminated: bool  # its end line was found (else it runs to the end of the script)


@dataclass(frozen=True)
class Lexed:
    contexts: list[Context]
    heredocs: list[Heredoc]


def _heredoc_word(script: str, i: int) -> tuple[int, int, str, bool, bool] | None:
    """``(op, word_end, delimiter, quoted, strip_tabs)`` of the ``<<`` at ``i``, or None."""
    j, n = i + 2, len(script)
    strip = script.startswith("-", j)
    j += strip
    while j < n and script[j] in " \t":
        j += 1
    word, quoted, quote = [], False, ""
    while j < n:
        c = script[j]
        if quote:
            if c == quote:
                quote = ""
            else:
                word.append(c)
        elif c in "'\"":
            quote, quoted = c, True
        elif c == "\\" and j + 1 < n:
            quoted = True
            j += 1
            word.append(script[j])
        elif c.isspace() or c in ";&|<>()":
            break
        else:
            word.append(c)
        j += 1
    return (i, j, "".join(word), quoted, strip) if word else None


def _in_arithmetic(script: str, i: int) -> bool:
    """Whether offset ``i`` is inside ``$((…))`` or ``((…))``, where ``<<`` is a shift."""
    at = script.rfind("((", 0, i)
    return at >= 0 and "))" not in script[at:i]


def lex(script: str) -> Lexed:
    """The quote context at every offset of ``script`` (and one past its end), and its
    here-documents, in one pass. Command substitutions ``$(…)`` inside "…" restart the
    context; comments are COMMENT; a here-document's text and end line are HEREDOC."""
    out: list[Context] = []
    docs: list[Heredoc] = []
    pending: list[tuple[int, int, str, bool, bool]] = []
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
        elif (
            script.startswith("<<", i)
            and not script.startswith("<<<", i)
            and not _in_arithmetic(script, i)
        ):
            word = _heredoc_word(script, i)
            if word is not None:
                pending.append(word)
            out.append(current())
            i += 1
        if c == "\n" and pending and stack[-1][0] in (NONE, "subst"):
            i = _bodies(script, i, pending, out, docs)
            pending = []
            continue
        i += 1
    out.append(current())
    return Lexed(out, docs)


def _bodies(
    script: str,
    newline: int,
    pending: list[tuple[int, int, str, bool, bool]],
    out: list[Context],
    docs: list[Heredoc],
) -> int:
    """Read the texts of ``pending`` here-documents after the ``newline`` that ends their
    command line; returns the offset of the newline after the last end line (or the end)."""
    n, pos = len(script), newline + 1
    for k, (op, word_end, delimiter, quoted, strip) in enumerate(pending):
        start, end, after, terminated = pos, n, n, False
        while pos < n:
            stop = script.find("\n", pos)
            stop = n if stop < 0 else stop
            line = script[pos:stop]
            if (line.lstrip("\t") if strip else line) == delimiter:
                end, after, terminated = pos, stop, True
                break
            pos = stop + 1
        last = k == len(pending) - 1
        pos = after if last else min(after + 1, n)
        out.extend(Context(HEREDOC, op) for _ in range(start, pos))
        docs.append(Heredoc(op, word_end, delimiter, quoted, newline, (start, end), terminated))
    return pos


def contexts(script: str) -> list[Context]:
    """The quote context at every offset of ``script`` (and one past its end): `lex`."""
    return lex(script).contexts


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
    if here.state in (COMMENT, HEREDOC):
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


def _command_end(script: str, start: int, stop: int, ctx: list[Context]) -> tuple[int, str]:
    """(offset, operator) of the first command separator in ``script[start:stop]`` outside
    quotes (``>&2`` is a redirection, not ``&``); ``(stop, "")`` when there is none."""
    for i in range(start, stop):
        if ctx[i].state != NONE:
            continue
        c = script[i]
        if c in ";\n":
            return i, c
        if c == "|":
            return i, "||" if script.startswith("||", i) else "|"
        if c == "&" and script[i - 1 : i] not in ("<", ">"):
            return i, "&&" if script.startswith("&&", i) else "&"
    return stop, ""


_WRITE = re.compile(r"(?<![<&])\d?(?:>>?|>\|)\s*([^\s;&|<>()]+)")


def heredoc_runs(script: str, doc: Heredoc, ctx: list[Context] | None = None) -> str | None:
    """None when the here-document ``doc`` is data that nothing in the script runs: its end
    line is found, nothing in it is expanded into a command, it feeds a command that only reads
    (`DATA_READERS`), outside ``$(…)``, and is piped nowhere, and any file it is written to is
    not named again by the script. Otherwise what may run it, or why that cannot be told."""
    ctx = ctx if ctx is not None else contexts(script)
    if not doc.terminated:
        return f"has no end line {doc.delimiter!r}, so where it ends cannot be told"
    text = script[doc.body[0] : doc.body[1]]
    if not doc.quoted and ("$(" in text or "`" in text):
        return "is expanded, and runs the command substitutions in its text"
    separators = [
        m.end() for m in _SEPARATORS.finditer(script, 0, doc.op) if ctx[m.start()].state == NONE
    ]
    start = max(separators, default=0)
    if script[:start].rstrip().endswith("$(") or script[:start].count("`") % 2:
        return "is captured by a command substitution, whose value the script may run"
    end, op = _command_end(script, doc.word_end, doc.line_end, ctx)
    command = f"{script[start : doc.op]} {script[doc.word_end : end]}"
    words = [w.strip("\"'") for w in command.split()]
    while words and (_ASSIGNMENT.match(words[0]) or words[0] in ("exec", "command")):
        words.pop(0)
    program = words[0].rsplit("/", 1)[-1] if words else ""
    if words and not words[0].startswith(("<", ">")) and program not in DATA_READERS:
        return f"is fed to `{program}`, which may run it"
    if op == "|":
        after = script[end + 1 : doc.line_end].split()
        return f"is piped on (`| {' '.join(after[:2])}`), and what reads it may run it"
    targets = [m.group(1).strip("\"'") for m in _WRITE.finditer(command)]
    if program == "tee":
        targets += [w for w in words[1:] if not w.startswith(("-", ">", "<"))]
    rest = "".join(
        " " if ctx[i].state in (HEREDOC, COMMENT) or start <= i < end else ch
        for i, ch in enumerate(script)
    )
    for target in targets:
        if re.fullmatch(r"/dev/(null|stdout|stderr|fd/\d+)|&\d", target):
            continue
        if "$" in target or "`" in target:
            return f"is written to a file named by the shell ({target}), which may be run"
        name = re.escape(target.rstrip("/").rsplit("/", 1)[-1])
        if re.search(rf"(?<![\w.-]){name}(?![\w.-])", rest):
            return f"is written to {target}, which the script uses again"
    return None


_ARGS = re.compile(r'"\$(?:@|\{@\})"')
_CHANGES = re.compile(r"(?<![\w$.-])(shift|set)(?![\w.-])([^\n;&|]*)")
_FUNCTION = re.compile(r"(?<![\w.-])(?:function\s+[A-Za-z_][\w-]*|[A-Za-z_][\w-]*\s*\(\s*\))")


def runs_arguments(script: str, ctx: list[Context] | None = None) -> tuple[int, str | None]:
    """How many commands of ``script`` are its positional parameters (``"$@"`` or ``exec
    "$@"``, outside quotes), and what in it changes them first (``shift``, ``set --``, a
    function, whose ``$@`` is its own), or None."""
    ctx = ctx if ctx is not None else contexts(script)
    text = blank_reads(script)
    runs = 0
    for m in _ARGS.finditer(text):
        if ctx[m.start()].state != NONE:
            continue  # quoted data for another command, a comment, a here-document
        words = [w for w in command_words(script, m.start(), ctx) if not _ASSIGNMENT.match(w)]
        runs += all(w in ("exec", "command") for w in words)
    if not runs:
        return 0, None
    for m in _FUNCTION.finditer(text):
        if ctx[m.start()].state == NONE:
            return runs, f"a function (`{m.group(0)}`), where $@ is the function's own"
    for m in _CHANGES.finditer(text):
        if ctx[m.start()].state != NONE or command_words(script, m.start(), ctx):
            continue  # a word of another command (`echo set`)
        rest = m.group(2).split()
        if m.group(1) == "shift":
            return runs, "`shift`"
        options = [w for i, w in enumerate(rest) if i == 0 or rest[i - 1] not in ("-o", "+o")]
        if any(w == "--" or not w.startswith(("-", "+")) for w in options):
            return runs, f"`set {rest[0]}`"
    return runs, None
