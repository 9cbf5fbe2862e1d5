"""Golden cases through the offline injector, `kvoffload inject` (the webhook runs the same
cases in test_webhook_https.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from kvoffload_operator.cli import main_inject
from kvoffload_operator.inject import inject_pod
from kvoffload_operator.manifests import inject_documents
from kvoffload_operator.workloads import group_size, pod_templates

from tests.operator.golden import DEFAULTS, IMAGE_ARGS, UPDATE, Case, cases, orphans

CASES = cases()


def test_every_golden_file_belongs_to_a_case() -> None:
    assert orphans() == []
    assert len(CASES) >= 10


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_cli_output_matches_golden(case: Case, tmp_path: Path, capsys) -> None:
    out = tmp_path / "out.yaml"
    rc = main_inject(
        ["-f", str(case.input), "--policy", str(case.policy_file), "-o", str(out), *IMAGE_ARGS]
    )
    assert rc == 0
    if UPDATE:
        case.golden.write_text(out.read_text())
    assert case.golden.exists(), f"missing {case.golden.name}: run with KVOFFLOAD_UPDATE_GOLDEN=1"
    assert out.read_text() == case.golden.read_text()


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_injecting_twice_equals_injecting_once(case: Case) -> None:
    once, _ = inject_documents(case.docs(), case.policies(), DEFAULTS)
    twice, notes = inject_documents(once, case.policies(), DEFAULTS)
    assert twice == once
    for doc in once:
        for _, template in pod_templates(doc):
            assert inject_pod(template, case.policies(), DEFAULTS, group_size(doc)).patch == []


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_golden_outputs_are_valid_kubernetes_objects(case: Case) -> None:
    """Built-in kinds only: kubernetes-validate has no schema for LeaderWorkerSet."""
    for doc in case.expected_docs():
        if doc.get("kind") != "LeaderWorkerSet":
            kubernetes_validate.validate(doc, "1.33.0", strict=True)


def test_already_injected_input_is_left_exactly_as_is() -> None:
    case = next(c for c in CASES if c.name == "pod-already-injected")
    assert case.expected_docs() == case.docs()


def test_kinds_without_pod_templates_pass_through() -> None:
    case = next(c for c in CASES if c.name == "lws-with-others")
    out, _ = inject_documents(case.docs(), case.policies(), DEFAULTS)
    assert out[0] == case.docs()[0] and out[1] == case.docs()[1]  # Service, ConfigMap


def test_bad_policy_file_is_a_clear_error(tmp_path: Path, capsys) -> None:
    bad = Path(__file__).parents[1] / "crds" / "bad" / "chunk-not-multiple-of-16.yaml"
    manifest = CASES[0].input
    out = tmp_path / "out.yaml"
    rc = main_inject(["-f", str(manifest), "--policy", str(bad), "-o", str(out)])
    assert rc == 2 and not out.exists()
    assert (
        "invalid policy: spec.offload.chunkSize must be a multiple of 16" in capsys.readouterr().err
    )


def test_skips_are_reported_on_stderr(capsys) -> None:
    case = next(c for c in CASES if c.name == "job-shell-ambiguous")
    assert main_inject(["-f", str(case.input), "--policy", str(case.policy_file)]) == 0
    captured = capsys.readouterr()
    assert "Job/bench (spec.template): not injected (shell-wrapper)" in captured.err
    assert "starts 2 vLLM engines in one shell script" in captured.err
    assert "kvoffload.io/skip-reason: shell-wrapper" in captured.out


@pytest.mark.process
def test_console_script_reads_stdin_and_prints_the_golden_output() -> None:
    """The installed `kvoffload inject` in a real process, manifest on stdin."""
    case = next(c for c in CASES if c.name == "deployment-command")
    exe = Path(sys.executable).with_name("kvoffload")
    res = subprocess.run(
        [str(exe), "inject", "-f", "-", "--policy", str(case.policy_file), *IMAGE_ARGS],
        input=case.input.read_text(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert res.returncode == 0, res.stderr
    assert list(yaml.safe_load_all(res.stdout)) == case.expected_docs()
