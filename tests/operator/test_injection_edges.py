"""Four edges where the injector must decide from what the pod will really run, not guess:

1. a pod that already uses a name, path or port kvoffload adds (a volume ``kvoffload-pool``, a
   container ``kvoffload-sidecar`` that is not ours, a device under ``/kvoffload``, port 9400)
   is skipped with a precise reason before anything is rendered (not answered with a rendering
   the API server would refuse, nor taken for "already injected": that is our annotation's word);
2. ``sh -c 'exec "$@"' --`` with the vLLM command in the container's args runs those args as
   the script's positional parameters: the flag goes into them;
3. the flag never lands after a bare ``--`` of an engine's argv (there it is a positional):
   it goes first among the engine's arguments, which vLLM's own parser reads;
4. a here-document is data for the command it feeds: ``vllm serve`` in its text is no engine,
   unless the text may run (fed to a shell, written to a file the script uses again), which is
   a precise skip.

Each injected shape is run as the kubelet runs it, in its real shell, with only stubs on
``PATH`` (`tests.operator.test_injection_classes.engine_calls`): the stand-in ``vllm`` must get
``--kv-transfer-config`` once, as the policy's JSON, before any bare ``--``.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
from kvoffload_operator import annotations as ann
from kvoffload_operator.admission import admit_pod
from kvoffload_operator.inject import RenderDefaults, inject_pod
from kvoffload_operator.inject.verify import intent_of, verify
from kvoffload_operator.inject.verify_exec import run_delivery
from kvoffload_operator.policy import policy_from_resource

from tests.operator.test_injection_classes import (
    POLICY,
    assert_delivered,
    assert_skipped,
    container_of,
    engine_calls,
)

pytestmark = pytest.mark.process

VLLM = {"name": "vllm", "image": "vllm/vllm-openai:v0.11.0", "command": ["vllm", "serve", "m"]}
NODE = policy_from_resource(
    {
        "kind": "KVOffloadPolicy",
        "metadata": {"name": "p", "namespace": "ns"},
        "spec": {
            "selector": {},
            "pool": {"placement": "node", "nodePool": "gpu-nodes", "tenant": "team-a"},
        },
    }
)
PREINSTALLED = policy_from_resource(
    {
        "kind": "KVOffloadPolicy",
        "metadata": {"name": "p", "namespace": "ns"},
        "spec": {
            "selector": {},
            "pool": {"size": "1Gi"},
            "connector": {"delivery": "preinstalled"},
        },
    }
)


def pod(*containers: dict[str, Any], **spec: Any) -> dict[str, Any]:
    return {"metadata": {"name": "x"}, "spec": {"containers": list(containers), **spec}}


def admitted(original: dict[str, Any], policy: Any = POLICY) -> Any:
    return admit_pod(copy.deepcopy(original), [policy], RenderDefaults())


def assert_precise_skip(original: dict[str, Any], reason: str, text: str, policy: Any = POLICY):
    """Skipped as ``reason`` by the decision itself (before rendering), with ``text`` in the
    message; the webhook answers the same reason and warning, the spec untouched."""
    result = inject_pod(copy.deepcopy(original), [policy])
    assert_skipped(result, original, reason)
    assert text in result.decision.message, result.decision.message
    answer = admitted(original, policy)
    assert (answer.outcome, answer.reason) == ("skipped", reason)
    assert answer.pod["spec"] == original["spec"]
    assert answer.pod["metadata"]["annotations"][ann.SKIP_REASON] == reason
    (warning,) = answer.warnings
    assert warning.startswith(f"kvoffload: not injected ({reason}): ") and text in warning


def assert_admitted_injected(original: dict[str, Any], policy: Any = POLICY) -> Any:
    answer = admitted(original, policy)
    assert (answer.outcome, answer.reason) == ("injected", "none"), answer.warnings
    return answer


# -- 1. names, paths and ports kvoffload adds ----------------------------------------------------
def _volume(name: str) -> dict[str, Any]:
    return {"name": name, "emptyDir": {}}


@pytest.mark.parametrize(
    ("volume", "policy"),
    [("kvoffload-pool", POLICY), ("kvoffload-run", POLICY), ("kvoffload-python", POLICY),
     ("kvoffload-node", NODE), ("kvoffload-python", NODE)],
)  # fmt: skip
def test_1_a_volume_named_like_ours_is_a_name_clash(volume: str, policy: Any) -> None:
    vllm = {**VLLM, "volumeMounts": [{"name": volume, "mountPath": "/data"}]}
    original = pod(vllm, volumes=[_volume(volume)])
    assert_precise_skip(original, "name-clash", f"volume {volume!r}", policy)


@pytest.mark.parametrize(
    ("volume", "policy"),
    [("kvoffload-node", POLICY), ("kvoffload-pool", NODE), ("kvoffload-python", PREINSTALLED)],
)
def test_1_a_name_this_rendering_does_not_add_is_no_clash(volume: str, policy: Any) -> None:
    vllm = {**VLLM, "volumeMounts": [{"name": volume, "mountPath": "/data"}]}
    assert_admitted_injected(pod(vllm, volumes=[_volume(volume)]), policy)


LOG_SHIPPER = {"image": "fluent/fluent-bit:3.0", "command": ["fluent-bit"]}


@pytest.mark.parametrize(
    ("spec", "name"),
    [
        ({"containers": [VLLM, {**LOG_SHIPPER, "name": "kvoffload-sidecar"}]},
         "kvoffload-sidecar"),
        ({"containers": [VLLM], "initContainers": [{**LOG_SHIPPER, "name": "kvoffload-sidecar",
                                                    "restartPolicy": "Always"}]},
         "kvoffload-sidecar"),
        ({"containers": [VLLM], "initContainers": [{"name": "kvoffload-connector-install",
                                                    "image": "busybox", "command": ["true"]}]},
         "kvoffload-connector-install"),
    ],
    ids=["app-container", "native-sidecar", "installer-name"],
)  # fmt: skip
def test_1_a_container_with_our_name_that_is_not_ours_is_a_name_clash(
    spec: dict[str, Any], name: str
) -> None:
    """Not "already injected": that is what our status annotation says, never a name alone."""
    original = {"metadata": {"name": "x"}, "spec": spec}
    assert_precise_skip(original, "name-clash", f"container {name!r}")


def test_1_already_injected_is_our_annotation() -> None:
    injected = inject_pod(pod(VLLM), [POLICY]).pod
    again = inject_pod(copy.deepcopy(injected), [POLICY])
    assert again.decision.reason.value == "already-injected" and again.patch == []
    # our label alone is no record of an injection (it may be copied into a selector)
    labelled = pod(VLLM)
    labelled["metadata"]["labels"] = {ann.INJECTED_LABEL: "true"}
    assert_admitted_injected(labelled)
    # our containers and volumes without the annotation: kvoffload wired by hand
    stripped = copy.deepcopy(injected)
    del stripped["metadata"]["annotations"][ann.STATUS]
    assert inject_pod(stripped, [POLICY]).decision.reason.value == "hand-wired"


def test_1_an_env_name_we_add_is_a_name_clash() -> None:
    vllm = {**VLLM, "env": [{"name": "KVOFFLOAD_USER_PYTHONPATH", "value": "/x"}]}
    assert_precise_skip(pod(vllm), "name-clash", "env KVOFFLOAD_USER_PYTHONPATH")


@pytest.mark.parametrize(
    ("path", "policy"),
    [("/kvoffload/pool", POLICY), ("/kvoffload", POLICY), ("/kvoffload/python/x", POLICY),
     ("/var/run/kvoffload", NODE), ("/var/run", NODE)],
)  # fmt: skip
def test_1_a_device_at_or_around_our_paths_is_a_path_clash(path: str, policy: Any) -> None:
    vllm = {**VLLM, "volumeDevices": [{"name": "blk", "devicePath": path}]}
    volumes = [{"name": "blk", "persistentVolumeClaim": {"claimName": "c"}}]
    assert_precise_skip(pod(vllm, volumes=volumes), "path-clash", f"at {path}", policy)


def test_1_a_device_elsewhere_is_no_clash() -> None:
    vllm = {**VLLM, "volumeDevices": [{"name": "blk", "devicePath": "/dev/xvdb"}]}
    volumes = [{"name": "blk", "persistentVolumeClaim": {"claimName": "c"}}]
    assert_admitted_injected(pod(vllm, volumes=volumes))


SERVE_9400 = {**VLLM, "command": ["vllm", "serve", "m", "--port", "9400"]}


@pytest.mark.parametrize(
    ("spec", "text"),
    [
        ({"containers": [{**VLLM, "ports": [{"containerPort": 9400}]}]}, "containerPort 9400"),
        ({"containers": [VLLM, {**LOG_SHIPPER, "name": "logs",
                                "ports": [{"containerPort": 9401, "name": "m"}]}]},
         "containerPort 9401"),
        ({"containers": [VLLM], "initContainers": [{**LOG_SHIPPER, "name": "proxy",
                                                    "restartPolicy": "Always",
                                                    "ports": [{"containerPort": 9400}]}]},
         "containerPort 9400"),
        ({"containers": [SERVE_9400]}, "--port 9400"),
        ({"containers": [{**VLLM, "args": ["--port=9401"]}]}, "--port=9401"),
        ({"containers": [{**VLLM, "command": ["sh", "-c", "exec vllm serve m --port 9400"]}]},
         "--port 9400"),
        ({"containers": [VLLM, {**LOG_SHIPPER, "name": "exporter",
                                "args": ["--web.listen-port=9400"]}]}, "9400"),
    ],
    ids=["vllm-declares", "other-declares", "native-sidecar-declares", "vllm-port-flag",
         "vllm-port-flag-eq", "vllm-port-in-script", "other-binds-by-flag"],
)  # fmt: skip
def test_1_a_port_our_sidecar_binds_is_a_port_clash(spec: dict[str, Any], text: str) -> None:
    original = {"metadata": {"name": "x"}, "spec": spec}
    assert_precise_skip(original, "port-clash", text)


def test_1_ports_that_cannot_clash_are_no_clash() -> None:
    # a plain init container has exited before the sidecar starts
    init = {"name": "fetch", "image": "busybox", "command": ["true"],
            "ports": [{"containerPort": 9400}]}  # fmt: skip
    assert_admitted_injected(pod(VLLM, initContainers=[init]))
    # placement node adds no sidecar, so no port
    assert_admitted_injected(pod({**VLLM, "ports": [{"containerPort": 9400}]}), NODE)


def test_1_hand_wiring_still_reads_as_hand_wired() -> None:
    """A hand-wired pod has our names too; it is named for what it is."""
    from tests.operator.test_injection_classes import shape

    template, _ = shape("hand-wired-kvoffload")
    assert inject_pod(template, [POLICY]).decision.reason.value == "hand-wired"


@pytest.mark.parametrize("policy", [POLICY, NODE, PREINSTALLED], ids=["pod", "node", "preinst"])
def test_1_what_the_clash_checks_reserve_is_what_the_renderer_adds(policy: Any) -> None:
    """The names the decision refuses are exactly those the rendering writes (no drift)."""
    from kvoffload_operator.inject.reserved import reserved

    original = pod({**VLLM, "env": [{"name": "PYTHONPATH", "valueFrom": {
        "configMapKeyRef": {"name": "c", "key": "k"}}}]})  # fmt: skip
    out = inject_pod(original, [policy]).pod
    spec = out["spec"]
    added = reserved(policy)
    inits = [c["name"] for c in spec.get("initContainers") or []]
    assert set(added.containers) == set(inits)
    assert set(added.volumes) == {v["name"] for v in spec["volumes"]}
    vllm = spec["containers"][0]
    assert set(added.paths) == {m["mountPath"] for m in vllm["volumeMounts"]}
    new_env = {e["name"] for e in vllm["env"]} - {"PYTHONPATH", "PYTHONHASHSEED"}
    assert set(added.env) >= new_env
    ports = {p["containerPort"] for c in spec.get("initContainers") or [] for p in c.get("ports")
             or []}  # fmt: skip
    assert set(added.ports) == ports


# -- 2. sh -c 'exec "$@"' with the command in args -----------------------------------------------
POSITIONAL = [
    pytest.param({"command": ["sh", "-c", 'exec "$@"', "--"], "args": ["vllm", "serve", "m"]},
                 id="sh-exec-args"),
    pytest.param({"command": ["bash", "-c", 'exec "$@"', "--"],
                  "args": ["vllm", "serve", "m", "--port", "8000"]}, id="bash-exec-args"),
    pytest.param({"command": ["/bin/sh", "-ec", 'pip list >/dev/null; exec "$@"', "sh"],
                  "args": ["python3", "-m", "vllm.entrypoints.openai.api_server", "--model", "m"]},
                 id="setup-then-exec"),
    pytest.param({"command": ["sh", "-c", 'set -eu\n"$@"', "sh", "vllm", "serve", "m"]},
                 id="positionals-in-command"),
    pytest.param({"command": ["bash", "-c"], "args": ['exec "${@}"', "--", "vllm", "run-batch",
                                                       "-i", "in.jsonl", "-o", "o.jsonl"]},
                 id="all-in-args"),
]  # fmt: skip


@pytest.mark.parametrize("container", POSITIONAL)
def test_2_a_script_that_runs_its_arguments_is_injected_in_them(
    container: dict[str, Any], tmp_path: Path
) -> None:
    original = pod({"name": "c", "image": "example.com/app:1", **container})
    result = inject_pod(copy.deepcopy(original), [POLICY])
    call = assert_delivered(result, tmp_path)
    before = container.get("args") or container["command"]
    c = container_of(result)
    assert c["command"] == container["command"] or container.get("args") is None
    assert [w for w in call if not w.startswith("--kv-transfer-config")] == [
        w for w in before[before.index(call[0]) :]
    ]
    assert_admitted_injected(original)


@pytest.mark.parametrize(
    ("container", "text"),
    [
        ({"command": ["sh", "-c", 'exec "$@"', "vllm", "serve", "m"]}, "$0"),
        ({"command": ["sh", "-c", 'shift; exec "$@"', "--"], "args": ["x", "vllm", "serve"]},
         "shift"),
        ({"command": ["sh", "-c", 'set -- vllm serve a; exec "$@"', "--"],
          "args": ["vllm", "serve", "m"]}, "set --"),
        ({"command": ["sh", "-c", 'run() { exec "$@"; }; run vllm serve a', "--"],
          "args": ["vllm", "serve", "m"]}, "function"),
        ({"command": ["sh", "-c", 'vllm serve a & exec "$@"', "--"],
          "args": ["vllm", "serve", "m"]}, "2 vLLM engines"),
    ],
    ids=["vllm-is-dollar-0", "shift", "set", "function", "two-engines"],
)  # fmt: skip
def test_2_arguments_the_script_changes_or_misreads_are_a_precise_skip(
    container: dict[str, Any], text: str
) -> None:
    original = pod({"name": "c", "image": "example.com/app:1", **container})
    assert_precise_skip(original, "shell-wrapper", text)


def test_2_inject_via_args_reaches_a_script_that_passes_its_arguments_on(tmp_path: Path) -> None:
    """`inject-via: args` on a `sh -c` script: the flag goes to the script's arguments; the
    webhook's pure check cannot follow `"$@"` through `"$VLLM"` and says so (unverified, not a
    failure), and running the script shows the engine gets it."""
    script = 'exec "$VLLM" serve m "$@"'
    c = {"name": "c", "image": "x", "command": ["sh", "-c", script, "sh"],
         "env": [{"name": "VLLM", "value": "vllm"}]}  # fmt: skip
    original = pod(c)
    original["metadata"]["annotations"] = {ann.VLLM_CONTAINER: "c", ann.INJECT_VIA: "args"}
    result = inject_pod(copy.deepcopy(original), [POLICY])
    verdict = verify(original, result.pod, intent_of(result.decision))
    assert verdict.ok and verdict.unverified, verdict
    assert_delivered(result, tmp_path)
    assert run_delivery(result.pod, intent_of(result.decision)).ok
    assert_admitted_injected(original)


def test_2_the_check_refuses_a_flag_in_arguments_the_script_never_reads() -> None:
    original = pod({"name": "c", "image": "x", "command": ["sh", "-c", "exec vllm serve m", "--"]})
    result = inject_pod(copy.deepcopy(original), [POLICY])
    broken = copy.deepcopy(original)
    broken["spec"]["containers"][0]["args"] = ["--kv-transfer-config={}"]
    verdict = verify(original, broken, intent_of(result.decision))
    assert [f.check for f in verdict.failures] == ["flag-placement"], verdict
    assert "never reads" in verdict.summary()


def test_2_the_arguments_are_read_for_conflicts_too() -> None:
    c = {"name": "c", "image": "x", "command": ["sh", "-c", 'exec "$@"', "--"]}
    kv = {**c, "args": ["vllm", "serve", "m", "--kv-transfer-config", "{}"]}
    assert inject_pod(pod(kv), [POLICY]).decision.reason.value == "has-kv-transfer-config"
    config = {**c, "args": ["vllm", "serve", "m", "--config", "/etc/vllm/c.yaml"]}
    assert inject_pod(pod(config), [POLICY]).decision.reason.value == "config-file"


# -- 3. never after a bare -- --------------------------------------------------------------------
DASHES = [
    pytest.param({"command": ["vllm", "serve", "m", "--port", "8000", "--"]}, id="trailing"),
    pytest.param({"command": ["vllm", "serve"], "args": ["m", "--", "--tensor-parallel-size"]},
                 id="in-args"),
    pytest.param({"command": ["/usr/bin/env", "--", "vllm", "serve", "m", "--"]},
                 id="after-wrapper"),
    pytest.param({"image": "vllm/vllm-openai:v0.11.0", "args": ["m", "--"]}, id="entrypoint"),
    pytest.param({"command": ["bash", "-c", 'exec "$@"', "--"], "args": ["vllm", "serve", "m",
                                                                          "--"]},
                 id="positionals"),
]  # fmt: skip


def _stand_in_reads_flags_before_dashes(call: list[str]) -> None:
    flags = [i for i, w in enumerate(call) if w.startswith("--kv-transfer-config")]
    assert len(flags) == 1, call
    assert "--" not in call[: flags[0]], f"the flag comes after a bare --: {call}"


@pytest.mark.parametrize("container", DASHES)
def test_3_the_flag_goes_before_a_bare_double_dash(container: dict[str, Any], tmp_path: Path):
    original = pod({"name": "c", "image": "example.com/app:1", **container})
    result = inject_pod(copy.deepcopy(original), [POLICY])
    assert result.decision.inject, result.decision.message
    c = container_of(result)
    if "command" not in container:  # the image's entrypoint: `vllm serve` before the args
        c = {**c, "command": ["vllm", "serve"]}
    (call,) = engine_calls(c, tmp_path)
    _stand_in_reads_flags_before_dashes(call)
    assert [w for w in call if not w.startswith("--kv-transfer-config")] == [
        w
        for w in [*(c.get("command") or []), *(c.get("args") or [])]
        if not w.startswith("--kv-transfer-config")
    ][-len(call) + 1 :]
    assert verify(original, result.pod, intent_of(result.decision)).ok
    assert run_delivery(result.pod, intent_of(result.decision)).ok
    assert_admitted_injected(original)


def test_3_the_checks_refuse_a_flag_after_a_bare_double_dash() -> None:
    """The pure check and the execution check both see a flag placed after `--`."""
    original = pod({**VLLM, "command": ["vllm", "serve", "m", "--"]})
    result = inject_pod(copy.deepcopy(original), [POLICY])
    broken = copy.deepcopy(result.pod)
    vllm = broken["spec"]["containers"][0]
    flag = next(w for w in [*vllm["command"], *vllm.get("args", [])] if "kv-transfer" in w)
    vllm["command"] = [w for w in vllm["command"] if w != flag]
    vllm["args"] = [*[w for w in vllm.get("args", []) if w != flag], flag]
    verdict = verify(original, broken, intent_of(result.decision))
    assert [f.check for f in verdict.failures] == ["flag-placement"], verdict.failures
    ran = run_delivery(broken, intent_of(result.decision))
    assert ran.status == "failed" and "after a bare --" in ran.message


def test_3_inject_via_args_also_goes_before_a_bare_double_dash() -> None:
    container = {"name": "vllm", "image": "x", "command": ["/scripts/start.sh"],
                 "args": ["--model", "m", "--", "extra"]}  # fmt: skip
    original = pod(container)
    original["metadata"]["annotations"] = {ann.INJECT_VIA: "args"}
    result = inject_pod(original, [POLICY])
    assert result.decision.inject, result.decision.message
    flag, *rest = container_of(result)["args"]
    assert flag.startswith("--kv-transfer-config=") and rest == container["args"]


@pytest.mark.vllm
@pytest.mark.parametrize(
    "command",
    [["vllm", "serve", "facebook/opt-125m", "--"], ["vllm", "serve", "--", "facebook/opt-125m"]],
    ids=["trailing", "before-the-model"],
)
def test_3_vllms_own_parser_reads_the_flag_placed_before_a_bare_double_dash(
    command: list[str],
) -> None:
    """vLLM's own parser takes the user's argv and the injected one alike (a `--` left over
    after options is an error to argparse, so the flag goes before the positional too)."""
    from vllm.entrypoints.cli import serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    sub = parser.add_subparsers(dest="subparser")
    for cmd in serve.cmd_init():
        cmd.subparser_init(sub)
    assert parser.parse_args(command[1:]).model_tag == "facebook/opt-125m"
    c = container_of(inject_pod(pod({**VLLM, "command": command}), [POLICY]))
    ns = parser.parse_args([*c["command"], *c.get("args", [])][1:])
    assert ns.kv_transfer_config.kv_connector == "KVOffloadConnector"
    assert ns.model_tag == "facebook/opt-125m"


# -- 4. here-documents ---------------------------------------------------------------------------
HEREDOC_DATA = [
    pytest.param("cat <<'EOF'\nUsage: vllm serve MODEL [--port N]\nEOF\nexec vllm serve m",
                 id="usage-text"),
    pytest.param("cat > notes.txt <<EOF\nDon't start vllm serve by hand here\nEOF\n"
                 "exec vllm serve m --port 8000", id="apostrophe-in-body"),
    pytest.param("cat <<-END\n\tvllm serve is started below\n\tEND\nexec vllm serve m",
                 id="tab-stripped"),
    pytest.param("cat <<A; cat <<B\nvllm serve a\nA\nvllm serve b\nB\nexec vllm serve m",
                 id="two-on-one-line"),
    pytest.param("N=$((1<<2))\nexec vllm serve m --max-num-seqs $N", id="arithmetic-shift"),
]  # fmt: skip


@pytest.mark.parametrize("script", HEREDOC_DATA)
@pytest.mark.parametrize("shell", ["sh", "bash"])
def test_4_a_here_document_is_data(script: str, shell: str, tmp_path: Path) -> None:
    original = pod({"name": "c", "image": "example.com/app:1", "command": [shell, "-c", script]})
    result = inject_pod(copy.deepcopy(original), [POLICY])
    call = assert_delivered(result, tmp_path)
    at = call.index("--kv-transfer-config")
    assert call[:at] == ["vllm", "serve"] and call[at + 2 : at + 3] == ["m"]
    new = container_of(result)["command"][2]
    # the here-document's text is as written: the flag went after the one real engine
    assert new.count("--kv-transfer-config") == 1
    engine = script.rsplit("exec vllm serve m", 1)[0] + "exec vllm serve"
    assert new.startswith(engine + " --kv-transfer-config ")
    assert verify(original, result.pod, intent_of(result.decision)).ok
    assert_admitted_injected(original)


@pytest.mark.parametrize(
    ("script", "text"),
    [
        ("bash <<EOF\nvllm serve a\nEOF\nexec vllm serve m", "fed to `bash`"),
        ("python3 - <<'EOF'\nimport os; os.system('vllm serve a')\nEOF\nexec vllm serve m",
         "fed to `python3`"),
        ("cat <<EOF | sh\nvllm serve a\nEOF\nexec vllm serve m", "piped"),
        ("cat > /tmp/run.sh <<'EOF'\nexec vllm serve m\nEOF\nexec sh /tmp/run.sh",
         "written to /tmp/run.sh"),
        ("cat <<EOF > run.sh\nvllm serve a\nEOF\nsh run.sh & exec vllm serve m",
         "written to run.sh"),
        ("cat <<EOF\n$(vllm serve a)\nEOF\nexec vllm serve m", "command substitution"),
        ('x=$(cat <<EOF\nvllm serve a\nEOF\n)\neval "$x" & exec vllm serve m', "captured"),
        ("cat <<EOF\nvllm serve a\nexec vllm serve m", "no end line"),
    ],
    ids=["fed-to-bash", "fed-to-python", "piped-to-sh", "file-run-later", "file-run-beside",
         "substitution", "captured", "unterminated"],
)  # fmt: skip
def test_4_a_here_document_that_may_run_is_a_precise_skip(script: str, text: str) -> None:
    original = pod({"name": "c", "image": "example.com/app:1", "command": ["sh", "-c", script]})
    assert_precise_skip(original, "shell-wrapper", text)


def test_4_a_config_file_written_by_a_here_document_is_still_read() -> None:
    script = ("cat > /tmp/c.yaml <<EOF\nkv-transfer-config: '{\"kv_connector\":\"X\"}'\nEOF\n"
              "vllm serve m --config /tmp/c.yaml")  # fmt: skip
    original = pod({"name": "c", "image": "x", "command": ["sh", "-c", script]})
    assert inject_pod(original, [POLICY]).decision.reason.value == "has-kv-transfer-config"
