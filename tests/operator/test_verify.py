"""The injector's checker itself: each check fails on the pod it exists for, the execution check
runs nothing real, and `kvoffload inject --verify` withdraws and reports what fails."""

from __future__ import annotations

import copy
import json
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml
from kvoffload_operator import inject as inject_pkg
from kvoffload_operator.cli import main_inject
from kvoffload_operator.inject import inject_pod
from kvoffload_operator.inject.render import kv_transfer_config
from kvoffload_operator.inject.verify import (
    Intent,
    check_structure,
    intent_of,
    kubelet_expand,
    verify,
)
from kvoffload_operator.inject.verify_exec import FAILED, OK, UNVERIFIED, run_delivery
from kvoffload_operator.policy import policy_from_resource

POLICY = policy_from_resource(
    {
        "kind": "KVOffloadPolicy",
        "metadata": {"name": "p", "namespace": "ns"},
        "spec": {"selector": {}, "pool": {"size": "1Gi"}},
    }
)
CONFIG = kv_transfer_config(POLICY)
JSON = json.dumps(CONFIG, sort_keys=True, separators=(",", ":"))
INTENT = Intent("vllm", CONFIG)
VIA_ARGS = {"kvoffload.io/inject-via": "args"}  # a script file: the user says it passes "$@"


def pod(annotations: dict[str, str] | None = None, **container: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "x", **({"annotations": annotations} if annotations else {})},
        "spec": {"containers": [{"name": "vllm", "image": "example.com/app:1", **container}]},
    }


def injected(original: dict[str, Any]) -> tuple[dict[str, Any], Intent]:
    result = inject_pod(original, [POLICY])
    assert result.decision.inject, result.decision.message
    return result.pod, intent_of(result.decision)


# -- structure ------------------------------------------------------------------------------------
def test_duplicate_mount_paths_fail_and_only_new_ones_count() -> None:
    original = pod(command=["vllm", "serve", "m"])
    mutated, intent = injected(original)
    assert verify(original, mutated, intent).ok
    broken = copy.deepcopy(mutated)
    broken["spec"]["containers"][0]["volumeMounts"].append(
        {"name": "kvoffload-run", "mountPath": "/kvoffload/pool/"}
    )
    failures = check_structure(original, broken)
    assert [f.check for f in failures] == ["unique-mount-paths"]
    assert "/kvoffload/pool" in failures[0].message
    # the user's own duplicate is not the injector's: the same pod as input passes
    assert check_structure(broken, broken) == []


@pytest.mark.parametrize(
    ("edit", "check"),
    [
        (lambda s: s["volumes"].append(dict(s["volumes"][0])), "unique-volume-names"),
        (lambda s: s["initContainers"].append({"name": "vllm"}), "unique-container-names"),
        (lambda s: s["volumes"].pop(0), "mounts-name-volumes"),
        (
            lambda s: s["containers"][0]["env"].append({"name": "PYTHONHASHSEED"}),
            "unique-env-names",
        ),
        (
            lambda s: s["containers"][0].update(ports=[{"containerPort": 9400}]),
            "unique-ports",
        ),
        (
            lambda s: s["initContainers"][-1]["resources"]["limits"].update(memory="1Mi"),
            "limits-cover-requests",
        ),
    ],
    ids=["volumes", "containers", "missing-volume", "env", "ports", "limits"],
)
def test_each_structural_check_fails_on_its_violation(edit: Any, check: str) -> None:
    original = pod(command=["vllm", "serve", "m"])
    mutated, _ = injected(original)
    edit(mutated["spec"])
    assert check in [f.check for f in check_structure(original, mutated)]


def test_host_network_pods_check_host_ports() -> None:
    original = pod(command=["vllm", "serve", "m"], ports=[{"containerPort": 9400}])
    original["spec"]["hostNetwork"] = True
    mutated = copy.deepcopy(original)
    mutated["spec"]["initContainers"] = [
        {"name": "s", "restartPolicy": "Always", "ports": [{"containerPort": 9400}]}
    ]
    checks = [f.check for f in check_structure(original, mutated)]
    assert "unique-host-ports" in checks and "unique-ports" in checks


# -- delivery, pure and executed ------------------------------------------------------------------
def by_hand(script: str, *args: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(original, "injected") pods whose script the test wrote itself."""
    original = pod(command=["/bin/bash", "-c", script.replace("FLAG", ""), "--", *args])
    mutated = pod(command=["/bin/bash", "-c", script.replace("FLAG", "{flag}"), "--", *args])
    return original, mutated


def with_flag(p: dict[str, Any], flag: str) -> dict[str, Any]:
    c = p["spec"]["containers"][0]
    c["command"] = [w.replace("{flag}", flag) for w in c["command"]]
    return p


def test_json_that_eval_strips_of_its_quotes_fails_both_checks() -> None:
    """Quoted for one parse, inside a string eval parses again: the JSON loses its quotes."""
    original, mutated = by_hand('eval "exec vllm serve /mnt/models FLAG $@"', "--port", "8000")
    mutated = with_flag(mutated, f"--kv-transfer-config {shlex.quote(JSON)}")
    verdict = verify(original, mutated, INTENT)
    assert [f.check for f in verdict.failures] == ["flag-json"]
    assert "{kv_connector:KVOffloadConnector" in verdict.failures[0].message
    run = run_delivery(mutated, INTENT)
    assert run.status == FAILED and "not JSON" in run.message
    assert "{kv_connector:KVOffloadConnector" in " ".join(run.engine_argv)


def test_json_quoted_for_both_parses_passes_both_checks() -> None:
    original, mutated = by_hand('eval "exec vllm serve /mnt/models FLAG $@"', "--port", "8000")
    twice = "'" + JSON.replace('"', '\\"') + "'"  # '…' survives "…", then eval removes it
    mutated = with_flag(mutated, f"--kv-transfer-config {twice}")
    assert verify(original, mutated, INTENT).ok
    run = run_delivery(mutated, INTENT)
    assert run.status == OK, run.message
    assert run.engine_argv[-2:] == ("--port", "8000")


def test_a_flag_delivered_twice_fails_both_checks() -> None:
    flag = f"--kv-transfer-config {shlex.quote(JSON)}"
    original, mutated = by_hand('exec vllm serve m FLAG "$@"', "--port", "8000")
    mutated = with_flag(mutated, flag)
    mutated["spec"]["containers"][0]["command"].append(f"--kv-transfer-config={JSON}")
    verdict = verify(original, mutated, INTENT)
    assert [f.check for f in verdict.failures] == ["flag-once"]
    run = run_delivery(mutated, INTENT)
    assert run.status == FAILED and "2 times" in run.message


def test_a_flag_inside_another_commands_word_fails() -> None:
    original, mutated = by_hand('echo "starting vllm serve FLAG"; sleep 1')
    mutated = with_flag(mutated, f"--kv-transfer-config {shlex.quote(JSON)}")
    assert [f.check for f in verify(original, mutated, INTENT).failures] == ["flag-word"]
    assert run_delivery(mutated, INTENT).status == UNVERIFIED  # no engine ever ran


def test_kubelet_expansion_is_the_kubelets() -> None:
    env = {"A": "x y", "B": "$(A)"}
    assert kubelet_expand("$(A)-$(B)-$(C)-$$(A)-$", env) == "x y-$(A)-$(C)-$(A)-$"
    original = pod(command=["vllm", "serve", "m"], env=[{"name": "A", "value": "1"}])
    config = {**CONFIG, "kv_connector_extra_config": {"note": "$(A)"}}
    mutated = copy.deepcopy(original)
    mutated["spec"]["containers"][0]["args"] = [
        f"--kv-transfer-config={json.dumps(config, separators=(',', ':'))}"
    ]
    failures = verify(original, mutated, Intent("vllm", config)).failures
    assert [f.check for f in failures] == ["kubelet-expansion"]


def test_nothing_from_the_spec_runs_for_real(tmp_path: Path) -> None:
    """Programs the script names (by name or by absolute path) are stubs; a write outside the
    run, or a file the input set lacks, makes the run refuse (unverified), not execute."""
    keep = tmp_path / "keep"
    keep.write_text("x")
    script = f"rm -f {keep}; /usr/bin/touch {tmp_path}/made; pip install x && exec vllm serve m"
    original = pod(command=["sh", "-c", script])
    mutated, intent = injected(original)
    assert run_delivery(mutated, intent).status == OK
    assert keep.exists() and not (tmp_path / "made").exists()
    for script, why in (
        (f"echo x > {tmp_path}/out; vllm serve m", "writes to"),
        ("echo x >> $LOG; vllm serve m", "writes to"),
        (". /etc/profile; vllm serve m", "sources"),
    ):
        mutated, intent = injected(pod(command=["sh", "-c", script]))
        run = run_delivery(mutated, intent)
        assert run.status == UNVERIFIED and why in run.message, run
    assert not (tmp_path / "out").exists()
    mutated, intent = injected(pod(VIA_ARGS, command=["bash", "/opt/start.sh"]))
    run = run_delivery(mutated, intent)
    assert run.status == UNVERIFIED and "not in the input set" in run.message


def test_a_script_from_a_configmap_of_the_input_runs_with_its_mount() -> None:
    original = pod(
        VIA_ARGS,
        command=["bash", "/scripts/start.sh"],
        volumeMounts=[{"name": "s", "mountPath": "/scripts"}],
    )
    original["spec"]["volumes"] = [{"name": "s", "configMap": {"name": "start"}}]
    mutated, intent = injected(original)
    good = {"start": {"start.sh": 'source /scripts/env.sh\nexec vllm serve "$MODEL" "$@"\n',
                      "env.sh": "MODEL=facebook/opt-125m\n"}}  # fmt: skip
    run = run_delivery(mutated, intent, good)
    assert run.status == OK, run.message
    assert run.engine_argv[:3] == ("vllm", "serve", "facebook/opt-125m")
    bad = {"start": {"start.sh": 'eval "exec vllm serve m $*"\n'}}
    assert run_delivery(mutated, intent, bad).status == FAILED


# -- the CLI --------------------------------------------------------------------------------------
TESTDATA = Path(__file__).parent / "testdata"


def duplicate_mounts(pod: Any, decision: Any, defaults: Any) -> dict[str, Any]:
    """A broken renderer: the real one, plus the vLLM container's pool mount twice."""
    out = RENDER(pod, decision, defaults)
    vllm = next(c for c in out["spec"]["containers"] if c["name"] == decision.container)
    vllm["volumeMounts"].append({"name": "kvoffload-run", "mountPath": "/kvoffload/pool"})
    return out


RENDER = inject_pkg.render


def test_cli_verify_passes_a_good_manifest(tmp_path: Path, capsys: Any) -> None:
    out = tmp_path / "out.yaml"
    args = [
        "-f",
        str(TESTDATA / "deployment-command.yaml"),
        "--policy",
        str(TESTDATA / "policy.yaml"),
    ]
    assert main_inject([*args, "--verify", "-o", str(out)]) == 0
    assert "kvoffload.io/status" in out.read_text()
    assert "verification-failed" not in capsys.readouterr().err


@pytest.mark.parametrize("flag", [[], ["--verify"]], ids=["plain", "verify"])
def test_cli_withdraws_a_rendering_that_fails(
    tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch, flag: list[str]
) -> None:
    monkeypatch.setattr(inject_pkg, "render", duplicate_mounts)
    source = TESTDATA / "deployment-command.yaml"
    out = tmp_path / "out.yaml"
    rc = main_inject(["-f", str(source), "--policy", str(TESTDATA / "policy.yaml"), *flag,
                      "-o", str(out)])  # fmt: skip
    assert rc == (1 if flag else 0)
    (doc,) = yaml.safe_load_all(out.read_text())
    (original,) = yaml.safe_load_all(source.read_text())
    template = doc["spec"]["template"]
    assert template["metadata"]["annotations"]["kvoffload.io/skip-reason"] == "verification-failed"
    assert template["spec"] == original["spec"]["template"]["spec"]
    err = capsys.readouterr().err
    assert "unique-mount-paths" in err and "/kvoffload/pool" in err


def test_an_args_only_container_runs_its_images_entrypoint() -> None:
    """No command: vLLM images run `vllm serve`, KServe's huggingfaceserver its module."""
    for image, start in (
        ("vllm/vllm-openai:v0.11.0", ("vllm", "serve")),
        ("kserve/huggingfaceserver:v0.15.2-gpu", ("python3", "-m", "huggingfaceserver")),
    ):
        mutated, intent = injected(pod(image=image, args=["--model_id=m", "--backend=vllm"]))
        run = run_delivery(mutated, intent)
        assert run.status == OK, run.message
        assert run.engine_argv[: len(start) + 1] == (*start, "--model_id=m")
