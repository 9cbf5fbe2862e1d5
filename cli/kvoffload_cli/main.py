"""`kvoffload` console script: one entry point, one subcommand per component.

Each subcommand lives in the package that owns it and is imported lazily, so
`kvoffload stats` does not import the operator and `kvoffload sidecar` does not
import torch.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Sequence

# name -> ("module:function", one-line help). The function takes argv and returns an exit code.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "sidecar": (
        "kvoffload_sidecar.cli:main_sidecar",
        "run the pool sidecar (gRPC on a Unix socket)",
    ),
    "stats": ("kvoffload_sidecar.cli:main_stats", "print a sidecar's stats as a table or JSON"),
    "probe": (
        "kvoffload_sidecar.probe:main_probe",
        "startup probe: exit 0 once the sidecar serves or a deadline passed (stdlib only)",
    ),
    "inject": ("kvoffload_operator.cli:main_inject", "print manifests with the sidecar injected"),
    "operator": ("kvoffload_operator.cli:main_operator", "run the Kubernetes operator and webhook"),
    "demo": ("kvoffload_cli.demo.chat:main", "sidecar + vLLM (CPU) multi-turn demo"),
    "node-agent": (
        "kvoffload_sidecar.node.agent:main",
        "run the node agent: CSI node plugin and per-tenant memory (node mode)",
    ),
    "node-holder": (
        "kvoffload_sidecar.node.holder:main",
        "hold the node pool's tenant memfds across node agent restarts (node mode)",
    ),
}


def _usage() -> str:
    width = max(map(len, SUBCOMMANDS))
    lines = ["usage: kvoffload <command> [options]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    lines += ["", "Run 'kvoffload <command> --help' for a command's options."]
    return "\n".join(lines)


def _resolve(target: str) -> Callable[[Sequence[str]], int]:
    module_name, func_name = target.split(":")
    return getattr(importlib.import_module(module_name), func_name)  # type: ignore[no-any-return]


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    name, rest = args[0], args[1:]
    if name not in SUBCOMMANDS:
        print(f"kvoffload: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    return _resolve(SUBCOMMANDS[name][0])(rest)


if __name__ == "__main__":
    sys.exit(main())
