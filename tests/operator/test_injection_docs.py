"""docs/INJECTION.md lists every skip reason the operator can write, read from the code (the
`SkipReason` enum, the container `Problem`s it maps, and every literal reason the webhook and
`kvoffload inject` write through ``skipped(...)``), each with when it happens and what to do,
and its override paragraph names exactly the reasons ``inject-via`` settles."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest
from kvoffload_operator.inject import SkipReason
from kvoffload_operator.inject.site import Problem
from kvoffload_operator.inject.verify import VERIFICATION_FAILED

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "INJECTION.md"
OPERATOR = ROOT / "operator" / "kvoffload_operator"
CONSTANTS = {"VERIFICATION_FAILED": VERIFICATION_FAILED}


def _section(title: str) -> str:
    text = DOC.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else len(text)]


def documented_rows() -> dict[str, tuple[str, str]]:
    """reason → (when, what to do), from the table under "## Skip reasons"."""
    rows: dict[str, tuple[str, str]] = {}
    for line in _section("Skip reasons").splitlines():
        m = re.match(r"^\| `([a-z-]+)` \|(.*)\|(.*)\|\s*$", line)
        if m:
            assert m.group(1) not in rows, f"{m.group(1)} has two rows"
            rows[m.group(1)] = (m.group(2).strip(), m.group(3).strip())
    return rows


def _reason_value(node: ast.expr) -> str | None:
    """The reason an argument of ``skipped(pod, reason)`` stands for: a literal, a known
    constant, or ``SkipReason.X.value``."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Name) and node.id in CONSTANTS:
        return CONSTANTS[node.id]
    if (
        isinstance(node, ast.Attribute)
        and node.attr == "value"
        and isinstance(node.value, ast.Attribute)
        and isinstance(node.value.value, ast.Name)
        and node.value.value.id == "SkipReason"
    ):
        return SkipReason[node.value.attr].value
    return None


def written_by_admission() -> dict[str, str]:
    """reason → where, for every ``skipped(pod, reason)`` call in the operator package."""
    out: dict[str, str] = {}
    for path in sorted(OPERATOR.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Call):
                continue
            name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
            if name != "skipped" or len(node.args) < 2:
                continue
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            value = _reason_value(node.args[1])
            assert value is not None, f"{where}: a skip reason this test cannot read"
            out[value] = where
    return out


def reasons_from_code() -> set[str]:
    return (
        {r.value for r in SkipReason if r.annotated}
        | {p.value for p in Problem}
        | set(written_by_admission())
    )


def test_the_code_has_the_reasons_this_test_reads() -> None:
    """The enumeration reaches every source: the enum, the problems, the webhook's own."""
    admission = written_by_admission()
    assert VERIFICATION_FAILED in admission and SkipReason.ERROR.value in admission, admission
    assert {p.value for p in Problem} <= {r.value for r in SkipReason}, "a Problem with no reason"
    assert len(reasons_from_code()) >= 17


def test_every_reason_the_code_can_write_has_a_row() -> None:
    rows = documented_rows()
    missing = sorted(reasons_from_code() - set(rows))
    assert not missing, f"docs/INJECTION.md's skip reason table lacks {missing}"


def test_every_row_says_when_and_what_to_do() -> None:
    for reason, (when, what) in documented_rows().items():
        assert len(when) > 20, f"{reason}: no 'when'"
        assert what, f"{reason}: no 'what to do'"


def test_no_row_names_a_reason_the_code_cannot_write() -> None:
    stale = sorted(set(documented_rows()) - reasons_from_code())
    assert not stale, f"docs/INJECTION.md documents reasons the code never writes: {stale}"


def test_reasons_never_written_on_pods_are_said_to_be() -> None:
    text = _section("Skip reasons")
    for r in SkipReason:
        if not r.annotated:
            assert f"`{r.value}`" in text and r.value not in documented_rows(), r.value
    assert "never written on pods" in text


def test_what_the_user_sees_names_each_place() -> None:
    text = _section("What the user sees")
    for place in (
        "kvoffload.io/skip-reason",
        "kvoffload: not injected (<reason>): <message>",  # admission.py's warning
        "skipped: {<reason>: <count>}",
        "kvoffload_injections_total{",  # metrics.py's counter
        "stderr",
    ):
        assert place in text, place
    assert '"kvoffload_injections"' in (OPERATOR / "metrics.py").read_text()


def test_the_overrides_named_are_the_ones_inject_via_settles() -> None:
    text = _section("Overrides")
    settles = re.search(r"It settles (.+?), the skips", text, re.S)
    never = re.search(r"never overrides a setting that would clash \((.+?)\)", text, re.S)
    assert settles and never, "the override paragraph changed its words"
    named = set(re.findall(r"`([a-z-]+)`", settles.group(1)))
    assert named == {p.value for p in Problem if p.overridable}
    clash = set(re.findall(r"`([a-z*-]+)`", never.group(1)))
    values = {p.value for p in Problem if not p.overridable}
    prefixes = tuple(c[:-1] for c in clash if c.endswith("*"))
    covered = {v for v in values if v in clash or v.startswith(prefixes)}
    assert covered == values, f"not named as never overridden: {sorted(values - covered)}"


def test_a_dropped_row_or_a_stale_one_is_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The checks above can fail: a copy of the doc without one row, with one invented."""
    text = DOC.read_text()
    row = next(x for x in text.splitlines() if x.startswith("| `backend-auto` |"))
    copy = tmp_path / "INJECTION.md"
    copy.write_text(text.replace(row + "\n", "| `made-up` | a reason no code writes | none |\n"))
    monkeypatch.setattr(sys.modules[__name__], "DOC", copy)
    rows = documented_rows()
    assert "backend-auto" in reasons_from_code() - set(rows)
    assert "made-up" in set(rows) - reasons_from_code()
