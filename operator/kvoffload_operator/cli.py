"""`kvoffload operator` and `kvoffload inject` entry points (argv in, exit code out).

`kvoffload inject` runs from the base install (no ``operator`` extra): this module imports
neither kopf nor a Kubernetes client (lint-imports checks it); the operator's imports happen in
`kvoffload_operator.run`, loaded only by ``kvoffload operator``, which names the missing extra.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from kvoffload_operator.inject import RenderDefaults
from kvoffload_operator.manifest_checks import check_documents
from kvoffload_operator.manifests import inject_documents
from kvoffload_operator.policy import KIND, PolicyError, policies_from_documents
from kvoffload_operator.version import VERSION

OPERATOR_EXTRA = ("kopf", "kubernetes", "cryptography", "prometheus_client")


def _read(path: str) -> str:
    return sys.stdin.read() if path == "-" else Path(path).read_text()


def main_inject(argv: Sequence[str]) -> int:
    """Print ``-f`` manifests with the sidecar injected for ``--policy`` (like kube-inject)."""
    parser = argparse.ArgumentParser(
        prog="kvoffload inject",
        description="Inject the kvoffload sidecar into Pods, Deployments, StatefulSets, Jobs, "
        "CronJobs and LeaderWorkerSets; other kinds pass through unchanged.",
    )
    parser.add_argument("-f", "--filename", required=True, help="manifest file, '-' for stdin")
    parser.add_argument(
        "--policy",
        required=True,
        action="append",
        help="KVOffloadPolicy file (repeatable; several policies compete as in "
        "a cluster: priority, then name)",
    )
    parser.add_argument("-o", "--output", help="write here instead of stdout")
    parser.add_argument("--sidecar-image", default=RenderDefaults().sidecar_image)
    parser.add_argument("--connector-image", default=RenderDefaults().connector_image)
    parser.add_argument(
        "--verify",
        action="store_true",
        help="also run each injected vLLM command line (its shell, eval, ConfigMap scripts) "
        "against a stand-in engine and check it receives --kv-transfer-config once, as the "
        "policy's JSON; exit 1 when a template fails (nothing from the manifest runs for real)",
    )
    args = parser.parse_args(list(argv))
    try:
        policy_docs = [d for p in args.policy for d in yaml.safe_load_all(_read(p))]
        policies = policies_from_documents(policy_docs)
        docs = [d for d in yaml.safe_load_all(_read(args.filename)) if d is not None]
    except (OSError, yaml.YAMLError) as exc:
        print(f"kvoffload inject: {exc}", file=sys.stderr)
        return 2
    except PolicyError as exc:
        print(f"kvoffload inject: invalid policy: {exc}", file=sys.stderr)
        return 2
    if not policies:
        print(f"kvoffload inject: no {KIND} in {', '.join(args.policy)}", file=sys.stderr)
        return 2
    defaults = RenderDefaults(args.sidecar_image, args.connector_image, VERSION)
    out_docs, notes = inject_documents(docs, policies, defaults)
    for note in notes:
        print(f"kvoffload inject: {note.where}: {note.text}", file=sys.stderr)
    # the webhook's checks on every injected template (with --verify, also the stand-in run)
    out_docs, checks = check_documents(docs, out_docs, policies, execute=args.verify)
    for check in checks:
        print(f"kvoffload inject: {check.where}: {check.text}", file=sys.stderr)
    text = dump_documents(out_docs)
    if args.output:
        Path(args.output).write_text(text)
    else:
        sys.stdout.write(text)
    return 1 if args.verify and any(c.failed for c in checks) else 0


def dump_documents(docs: Sequence[Any]) -> str:
    return yaml.safe_dump_all(docs, sort_keys=False, default_flow_style=False, width=1000)


def main_operator(argv: Sequence[str]) -> int:
    """Run the operator (kopf) with its webhook, metrics and health endpoints until stopped."""
    for module in OPERATOR_EXTRA:
        try:
            importlib.import_module(module)
        except ImportError:
            print(
                f"kvoffload operator: needs the operator extra ({module} is not installed): "
                "pip install 'kvoffload[operator]'",
                file=sys.stderr,
            )
            return 1
    from kvoffload_operator.run import run_operator

    return run_operator(argv)
