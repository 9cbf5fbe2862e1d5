"""The metrics reference (docs/METRICS.md) as data, and Prometheus text checks the tests share.

The page's tables list one series per row: `| \\`name\\` | type | labels | meaning |`, under
`## ` sections (Sidecar, Per-tenant quotas, vLLM connector, Operator). The exposition test
ties the sidecar's sections to a real sidecar's /metrics; the dashboard test accepts queries of
documented names only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[2]
METRICS_DOC = REPO / "docs" / "METRICS.md"
ROW = re.compile(r"^\|\s*`([A-Za-z_:][A-Za-z0-9_:]*)`\s*\|\s*(\w+)\s*\|([^|]*)\|")
TYPES = {"gauge", "counter", "histogram"}
SIDECAR_SECTIONS = ("Sidecar", "Per-tenant")  # `## ` headings of the sidecar's series
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


@dataclass(frozen=True)
class DocMetric:
    """One documented series: its name as queried (counters with `_total`), type, labels."""

    name: str
    type: str
    labels: frozenset[str]
    section: str


def documented(*sections: str) -> dict[str, DocMetric]:
    """Documented series by name; `sections`: only those under a `## ` heading starting with
    one of them (none: every section)."""
    out: dict[str, DocMetric] = {}
    current = ""
    for line in METRICS_DOC.read_text().splitlines():
        if line.startswith("## "):
            current = line[3:].strip()
            continue
        m = ROW.match(line)
        if not m:
            continue
        name, kind, labels = m.group(1), m.group(2), m.group(3)
        assert kind in TYPES, f"{name}: unknown type {kind!r} in {METRICS_DOC.name}"
        assert name not in out, f"{name} listed twice in {METRICS_DOC.name}"
        assert (kind == "counter") == name.endswith("_total"), f"{name}: counters end in _total"
        label_set = frozenset(x.strip() for x in labels.split(",") if x.strip())
        out[name] = DocMetric(name, kind, label_set, current)
    if sections:
        out = {n: d for n, d in out.items() if d.section.startswith(sections)}
    assert out, f"no metrics documented under {sections!r} in {METRICS_DOC}"
    return out


def sidecar_documented() -> dict[str, DocMetric]:
    """Every series a sidecar's /metrics may expose (its own sections and per-tenant quotas)."""
    return documented(*SIDECAR_SECTIONS)


def series_names(name: str, kind: str) -> set[str]:
    """The sample names a documented series shows in PromQL (histograms: their parts)."""
    if kind == "histogram":
        return {name + s for s in HISTOGRAM_SUFFIXES}
    return {name}


@dataclass(frozen=True)
class Exposed:
    """One metric family of an exposition: the name as queried, type, label names, samples."""

    name: str
    type: str
    labels: frozenset[str]
    samples: int


def check_text_format(text: str) -> None:
    """Prometheus text format 0.0.4, strictly: every family has one HELP and one TYPE line
    before its samples, a family's samples are contiguous, no series repeats, every sample line
    is `name{labels} value`."""
    sample = re.compile(
        r"^([a-zA-Z_:][a-zA-Z0-9_:]*)"  # name
        r'(\{(?:[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\]|\\.)*",?)*\})?'  # labels
        r" (\S+)$"  # value
    )
    helped: set[str] = set()
    typed: dict[str, str] = {}
    seen: set[str] = set()
    done: set[str] = set()  # families whose samples ended
    current = ""
    for line in text.splitlines():
        if not line:
            continue
        if line.startswith("# HELP "):
            name = line.split(" ", 3)[2]
            assert name not in helped, f"second HELP for {name}"
            helped.add(name)
            continue
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            assert name not in typed, f"second TYPE for {name}"
            assert name in helped, f"TYPE before HELP for {name}"
            assert kind in {"gauge", "counter", "histogram", "summary", "untyped"}, line
            typed[name] = kind
            continue
        assert not line.startswith("#"), f"unexpected comment: {line}"
        m = sample.match(line)
        assert m, f"not a sample line: {line!r}"
        float(m.group(3))
        family = _family_of(m.group(1), typed)
        assert family in helped and family in typed, f"{m.group(1)}: no HELP/TYPE before it"
        if family != current:
            assert family not in done, f"samples of {family} are not contiguous"
            if current:
                done.add(current)
            current = family
        key = m.group(1) + (m.group(2) or "")
        assert key not in seen, f"duplicate series {key}"
        seen.add(key)


def _family_of(sample_name: str, typed: dict[str, str]) -> str:
    if sample_name in typed:
        return sample_name
    for suffix in (*HISTOGRAM_SUFFIXES, "_total", "_created"):
        base = sample_name[: -len(suffix)] if sample_name.endswith(suffix) else ""
        if base and typed.get(base) in ("histogram", "counter", "summary"):
            return base
    return sample_name


def exposed(text: str, prefix: str = "kvoffload_") -> dict[str, Exposed]:
    """The exposition's families (parsed by client_python's parser) whose names start with
    `prefix`, named as queried: counters with `_total`; `_created` gauges of a counter or
    histogram left out (client_python adds them)."""
    families = list(text_string_to_metric_families(text))
    bases = {f.name for f in families if f.type in ("counter", "histogram")}
    out: dict[str, Exposed] = {}
    for f in families:
        if not f.name.startswith(prefix):
            continue
        if f.name.endswith("_created") and f.name[: -len("_created")] in bases:
            continue
        name = f.name + "_total" if f.type == "counter" else f.name
        labels = frozenset(k for s in f.samples for k in s.labels if k != "le")
        assert name not in out, f"family {name} twice"
        out[name] = Exposed(name, f.type, labels, len(f.samples))
    return out


def samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """Values of the samples named exactly `name`, by sorted label pairs."""
    out = {}
    for f in text_string_to_metric_families(text):
        for s in f.samples:
            if s.name == name:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out
