"""Golden cases: ``testdata/<case>.yaml`` → ``testdata/<case>.injected.yaml``.

A case uses ``testdata/<case>.policy.yaml`` when present, else ``testdata/policy.yaml``. Run with
``KVOFFLOAD_UPDATE_GOLDEN=1`` to rewrite the expected files (then review the diff).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from kvoffload_operator.inject import RenderDefaults
from kvoffload_operator.policy import Policy, policies_from_documents

TESTDATA = Path(__file__).parent / "testdata"
DEFAULT_POLICY = TESTDATA / "policy.yaml"
UPDATE = os.environ.get("KVOFFLOAD_UPDATE_GOLDEN") == "1"
# Fixed images so golden files do not change with the package version.
DEFAULTS = RenderDefaults(
    "ghcr.io/kvoffload/kvoffload:test", "ghcr.io/kvoffload/kvoffload-connector:test", "test"
)
IMAGE_ARGS = [
    "--sidecar-image",
    DEFAULTS.sidecar_image,
    "--connector-image",
    DEFAULTS.connector_image,
]


@dataclass(frozen=True)
class Case:
    name: str
    input: Path
    golden: Path
    policy_file: Path

    def policies(self) -> list[Policy]:
        return policies_from_documents(list(yaml.safe_load_all(self.policy_file.read_text())))

    def docs(self) -> list[Any]:
        return [d for d in yaml.safe_load_all(self.input.read_text()) if d is not None]

    def expected_docs(self) -> list[Any]:
        return [d for d in yaml.safe_load_all(self.golden.read_text()) if d is not None]


def _is_input(p: Path) -> bool:
    return not p.name.endswith((".injected.yaml", ".policy.yaml")) and p != DEFAULT_POLICY


def cases() -> list[Case]:
    out = []
    for path in sorted(TESTDATA.glob("*.yaml")):
        if not _is_input(path):
            continue
        name = path.name[: -len(".yaml")]
        own = TESTDATA / f"{name}.policy.yaml"
        out.append(
            Case(
                name,
                path,
                TESTDATA / f"{name}.injected.yaml",
                own if own.exists() else DEFAULT_POLICY,
            )
        )
    return out


def orphans() -> list[str]:
    """Golden or policy files no case uses (a typo in a name would silently skip a test)."""
    names = {c.name for c in cases()}
    out = []
    for path in TESTDATA.glob("*.yaml"):
        for suffix in (".injected.yaml", ".policy.yaml"):
            if path.name.endswith(suffix) and path.name[: -len(suffix)] not in names:
                out.append(path.name)
    return sorted(out)
