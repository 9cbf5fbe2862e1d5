"""Structure checks of images/Dockerfile and images/connector.Dockerfile (no Docker engine here).

What can be checked without building: every COPY source exists and survives .dockerignore, the
sources `pip install .` needs are all copied, the final stage is non-root with the right
entrypoint and no build tooling, pinned dependency versions fit pyproject.toml, and the payload
image's copy command matches what the operator injects.
"""

from __future__ import annotations

import json
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")

REPO = Path(__file__).resolve().parents[2]
MAIN = REPO / "images" / "Dockerfile"
CONNECTOR = REPO / "images" / "connector.Dockerfile"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
BUILD_TOOLS = re.compile(r"\b(apt-get|apk|gcc|g\+\+|make|build-essential|cmake|cargo)\b")


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, op: str) -> list[str]:
        return [args for o, args in self.instructions if o == op]


def parse(path: Path) -> tuple[dict[str, str], list[Stage]]:
    """(ARG defaults before the first FROM, stages) of a Dockerfile; continuations joined."""
    text = re.sub(
        r"\\\n",
        " ",
        "\n".join(ln for ln in path.read_text().splitlines() if not ln.lstrip().startswith("#")),
    )
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in filter(None, (ln.strip() for ln in text.splitlines())):
        op, _, args = line.partition(" ")
        op, args = op.upper(), args.strip()
        if op == "FROM":
            words = args.split()
            base = re.sub(r"\$\{(\w+)\}", lambda m: global_args.get(m[1], m[0]), words[0])
            stages.append(
                Stage(base, words[2] if len(words) > 2 and words[1].upper() == "AS" else None)
            )
        elif not stages and op == "ARG":
            name, _, default = args.partition("=")
            global_args[name] = default
        elif stages:
            stages[-1].instructions.append((op, args))
    return global_args, stages


def copy_sources(stage: Stage) -> list[str]:
    sources = []
    for args in stage.all("COPY"):
        words = shlex.split(args)
        if any(w.startswith("--from") for w in words):
            continue
        sources += [w for w in words if not w.startswith("--")][:-1]
    return sources


def dockerignore_excludes(rel: str) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents wins."""
    patterns = [
        ln.strip()
        for ln in (REPO / ".dockerignore").read_text().splitlines()
        if ln.strip() and not ln.startswith("#")
    ]
    parts = rel.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        regex = _glob(pattern.lstrip("!").rstrip("/"))
        if any(regex.fullmatch(p) for p in prefixes):
            excluded = not negate
    return excluded


def _glob(pattern: str) -> re.Pattern[str]:
    out = ""
    for token in re.split(r"(\*\*/|\*\*|\*|\?)", pattern):
        out += {"**/": "(.*/)?", "**": ".*", "*": "[^/]*", "?": "[^/]"}.get(token, re.escape(token))
    return re.compile(out)


def final(path: Path) -> Stage:
    return parse(path)[1][-1]


@pytest.mark.parametrize("dockerfile", [MAIN, CONNECTOR], ids=["main", "connector"])
def test_multi_stage_with_a_named_build_stage(dockerfile):
    _, stages = parse(dockerfile)
    assert len(stages) >= 2 and stages[0].name == "build"
    assert [a for a in stages[-1].all("COPY") if "--from=build" in a]


@pytest.mark.parametrize("dockerfile", [MAIN, CONNECTOR], ids=["main", "connector"])
def test_final_stage_runs_as_the_non_root_uid_the_chart_expects(dockerfile):
    (user,) = final(dockerfile).all("USER")
    assert user.split(":")[0] == "65532"


@pytest.mark.parametrize("dockerfile", [MAIN, CONNECTOR], ids=["main", "connector"])
def test_final_stage_installs_no_build_tools(dockerfile):
    assert not [r for r in final(dockerfile).all("RUN") if BUILD_TOOLS.search(r)]


@pytest.mark.parametrize("dockerfile", [MAIN, CONNECTOR], ids=["main", "connector"])
def test_every_copy_source_exists_and_survives_dockerignore(dockerfile):
    problems = []
    for stage in parse(dockerfile)[1]:
        for source in copy_sources(stage):
            path = REPO / source
            files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
            kept = [f for f in files if not dockerignore_excludes(f.relative_to(REPO).as_posix())]
            if not kept:
                problems.append(source)
    assert not problems


def test_main_build_stage_copies_everything_pip_install_needs():
    copied = set(copy_sources(parse(MAIN)[1][0]))
    needed = {
        "pyproject.toml",
        PYPROJECT["project"]["readme"],
        *PYPROJECT["tool"]["setuptools"]["packages"]["find"]["where"],
    }
    assert needed <= copied


def test_connector_build_stage_copies_exactly_the_payload_sources():
    builder = _builder()
    copied = set(copy_sources(parse(CONNECTOR)[1][0]))
    assert copied == {*builder.PACKAGES.values(), "images/build_payload.py"}


def test_dockerignore_keeps_tests_and_venvs_out():
    assert all(
        dockerignore_excludes(p)
        for p in (
            ".venv/bin/python",
            "tests/chart/conftest.py",
            "charts/kvoffload/Chart.yaml",
            ".git/HEAD",
            "sidecar/kvoffload_sidecar/__pycache__/x.pyc",
        )
    )
    assert not dockerignore_excludes("sidecar/kvoffload_sidecar/__init__.py")


def test_main_image_entrypoint_is_the_kvoffload_script():
    stage = final(MAIN)
    (entrypoint,) = stage.all("ENTRYPOINT")
    assert json.loads(entrypoint) == ["kvoffload"]
    assert PYPROJECT["project"]["scripts"]["kvoffload"] == "kvoffload_cli.main:main"


def test_main_image_installs_the_operator_extra_into_a_venv_it_copies():
    build = parse(MAIN)[1][0]
    assert any('pip install ".[operator]"' in r for r in build.all("RUN"))
    assert "operator" in PYPROJECT["project"]["optional-dependencies"]
    assert final(MAIN).all("COPY") == ["--from=build /opt/kvoffload /opt/kvoffload"]


def test_main_image_base_is_python_slim_in_both_stages():
    _, stages = parse(MAIN)
    assert {s.base for s in stages} == {"python:3.12-slim"}


def test_connector_payload_is_built_by_the_layout_script_for_every_python():
    build = parse(CONNECTOR)[1][0]
    (run,) = [r for r in build.all("RUN") if "build_payload.py" in r]
    assert "python images/build_payload.py /payload" in run
    assert '--grpcio "${GRPCIO_VERSION}" --protobuf "${PROTOBUF_VERSION}"' in run
    assert "--pythons ${PAYLOAD_PYTHONS}" in run
    pins = dict(a.partition("=")[::2] for a in build.all("ARG") if "=" in a)
    assert pins["PAYLOAD_PYTHONS"].strip('"').split() == ["3.10", "3.11", "3.12", "3.13"]
    assert "add_payload_deps()" in run  # the build checks the imports the way the connector does


def test_connector_pins_fit_pyproject_ranges():
    specifiers = pytest.importorskip("packaging.requirements")
    build = parse(CONNECTOR)[1][0]
    pins = dict(a.partition("=")[::2] for a in build.all("ARG") if "=" in a)
    requirements = {
        r.name: r for r in map(specifiers.Requirement, PYPROJECT["project"]["dependencies"])
    }
    assert requirements["grpcio"].specifier.contains(pins["GRPCIO_VERSION"])
    assert requirements["grpcio-health-checking"].specifier.contains(pins["GRPCIO_VERSION"])
    assert requirements["protobuf"].specifier.contains(pins["PROTOBUF_VERSION"])


def test_connector_payload_image_copies_where_the_operator_expects():
    render = pytest.importorskip("kvoffload_operator.inject.render")
    (entrypoint,) = final(CONNECTOR).all("ENTRYPOINT")
    assert json.loads(entrypoint) == ["cp", "-R", "/payload/.", render.PYTHON_DIR]
    assert final(CONNECTOR).base.startswith("busybox:")


def test_connector_build_stage_base_is_python_slim():
    global_args, stages = parse(CONNECTOR)
    assert stages[0].base == f"python:{global_args['BUILD_PYTHON_VERSION']}-slim"


# Modules the payload carries: our packages at top level, grpc/protobuf in _kvoffload_deps.
PAYLOAD_MODULES = {"grpc", "grpc_health", "google", "kvoffload", "kvoffload_connector"}


def _third_party_imports(package: Path) -> dict[str, set[str]]:
    """Top-level module -> files importing it (lazy imports inside functions included)."""
    import ast

    found: dict[str, set[str]] = {}
    for source in package.rglob("*.py"):
        for node in ast.walk(ast.parse(source.read_text(), str(source))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top != "__future__":
                    found.setdefault(top, set()).add(source.name)
    return found


def test_connector_payload_covers_every_import_of_the_connector():
    """A new third-party import in kvoffload_connector must be put in the payload or declared as
    provided by the vLLM image (the `vllm-image-provides:` line of connector.Dockerfile)."""
    package = REPO / "connector" / "kvoffload_connector"
    if not (package / "connector.py").exists():
        pytest.skip("kvoffload_connector not written yet")
    (line,) = [ln for ln in CONNECTOR.read_text().splitlines() if "vllm-image-provides:" in ln]
    provided = set(line.split(":", 1)[1].split())
    missing = {m: f for m, f in _third_party_imports(package).items()
               if m not in PAYLOAD_MODULES | provided}  # fmt: skip
    assert not missing


def _builder():
    import importlib.util

    spec = importlib.util.spec_from_file_location("build_payload", REPO / "images/build_payload.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _pins() -> dict[str, str]:
    build = parse(CONNECTOR)[1][0]
    return dict(a.partition("=")[::2] for a in build.all("ARG") if "=" in a)


@pytest.fixture(scope="module")
def payload(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The payload layout for this Python, built by images/build_payload.py with real pip (the
    wheels are cached under .cache/, so a rerun needs no index)."""
    builder, pins = _builder(), _pins()
    out = tmp_path_factory.mktemp("payload") / "payload"
    cache = REPO / ".cache" / "payload-wheels"
    cache.mkdir(parents=True, exist_ok=True)
    reqs = [
        f"grpcio=={pins['GRPCIO_VERSION']}",
        f"grpcio-health-checking=={pins['GRPCIO_VERSION']}",
        f"protobuf=={pins['PROTOBUF_VERSION']}",
    ]
    pip = [sys.executable, "-m", "pip"]
    import subprocess

    subprocess.run(
        [*pip, "download", "-q", "--only-binary=:all:", "-d", str(cache), *reqs], check=True
    )
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    builder.build(out, REPO, [here], reqs, pip_options=["--no-index", "--find-links", str(cache)])
    return out


def _run(python: str, payload: Path, code: str) -> str:
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    res = subprocess.run(
        [python, "-c", code],
        env={**env, "PYTHONPATH": str(payload)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout


@pytest.mark.process
def test_payload_top_level_holds_only_our_packages(payload: Path) -> None:
    assert {p.name for p in payload.iterdir()} == {
        "kvoffload_connector",
        "kvoffload",
        "_kvoffload_deps",
    }
    here = f"cp{sys.version_info.major}{sys.version_info.minor}"
    deps = payload / "_kvoffload_deps" / here
    assert {"grpc", "grpc_health", "google"} <= {p.name for p in deps.iterdir()}


@pytest.mark.process
def test_payload_never_shadows_the_images_own_packages(payload: Path) -> None:
    """In an environment that has grpc and protobuf (like a vLLM image), PYTHONPATH=<payload>
    plus the connector's deps hook still import the image's copies."""
    out = _run(
        sys.executable,
        payload,
        "import kvoffload_connector.guard as g; added = g.add_payload_deps(); "
        "import google.protobuf, grpc, kvoffload.v1.pool_pb2_grpc; "
        "print(added); print(google.protobuf.__file__); print(grpc.__file__)",
    )
    added, protobuf_file, grpc_file = out.split()
    assert added.startswith(str(payload / "_kvoffload_deps"))
    assert not protobuf_file.startswith(str(payload)) and "site-packages" in protobuf_file
    assert not grpc_file.startswith(str(payload)) and "site-packages" in grpc_file


@pytest.mark.process
def test_payload_fills_gaps_in_an_image_without_grpc(payload: Path, tmp_path: Path) -> None:
    """A bare interpreter (no grpc, no protobuf): the deps folder supplies them, at the end."""
    import subprocess

    base = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else sys.executable
    venv = tmp_path / "bare"
    subprocess.run([base, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    if (
        f"{sys.version_info.major}.{sys.version_info.minor}"
        not in subprocess.run(
            [python, "-c", "import sys; print(sys.version)"], capture_output=True, text=True
        ).stdout
    ):
        pytest.skip("the bare interpreter is another Python minor than the payload's deps")
    out = _run(
        python,
        payload,
        "import importlib.util as u; print(u.find_spec('grpc') is None); "
        "import kvoffload_connector.guard as g; g.add_payload_deps(); "
        "import sys, grpc, kvoffload.v1.pool_pb2_grpc; print(grpc.__file__); "
        "print(sys.path[-1])",
    )
    missing_before, grpc_file, last = out.split()
    assert missing_before == "True"
    assert grpc_file.startswith(str(payload / "_kvoffload_deps"))
    assert last.startswith(str(payload / "_kvoffload_deps"))


# top-level import name -> distribution (pyproject names) for what the main image runs
DISTRIBUTIONS = {
    "grpc": "grpcio",
    "grpc_health": "grpcio-health-checking",
    "google": "protobuf",
    "yaml": "pyyaml",
    "jsonpatch": "jsonpatch",
    "numpy": "numpy",
    "prometheus_client": "prometheus-client",
    "kopf": "kopf",
    "kubernetes": "kubernetes",
    "cryptography": "cryptography",
}
OWN = {"kvoffload", "kvoffload_sidecar", "kvoffload_operator", "kvoffload_cli",
       "kvoffload_connector"}  # fmt: skip


def test_main_image_installs_everything_its_entrypoints_import():
    """`kvoffload sidecar|probe|stats|inject|operator` in the main image: every third-party import
    of sidecar/, operator/ and cli/ must come from the base dependencies or the operator extra
    (the image installs `.[operator]`); the connector's run in vLLM's image (checked above)."""
    from packaging.requirements import Requirement

    project = PYPROJECT["project"]
    installed = {
        Requirement(r).name.lower()
        for r in [*project["dependencies"], *project["optional-dependencies"]["operator"]]
    }
    imports: dict[str, set[str]] = {}
    for package in ("sidecar/kvoffload_sidecar", "operator/kvoffload_operator", "cli"):
        for name, files in _third_party_imports(REPO / package).items():
            imports.setdefault(name, set()).update(files)
    # `kvoffload demo` starts a vLLM engine: it runs where vLLM is installed (make demo's venv)
    for name, files in _third_party_imports(REPO / "cli" / "kvoffload_cli" / "demo").items():
        if not imports[name] - files:
            del imports[name]
    unknown = {m: f for m, f in imports.items() if m not in OWN and m not in DISTRIBUTIONS}
    assert not unknown, f"map these imports to their distribution: {unknown}"
    missing = {
        m: DISTRIBUTIONS[m]
        for m in imports
        if m in DISTRIBUTIONS and DISTRIBUTIONS[m] not in installed
    }
    assert not missing, f"imported but not installed in the image: {missing}"
