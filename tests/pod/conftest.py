"""Pod-level tests: their helpers load under unique module names (tests/operator has its own
`harness` module, and pytest puts every test folder on sys.path)."""

import importlib.util
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
if "pod_harness" not in sys.modules:
    _spec = importlib.util.spec_from_file_location("pod_harness", HERE / "harness.py")
    assert _spec is not None and _spec.loader is not None
    _mod = importlib.util.module_from_spec(_spec)
    sys.modules["pod_harness"] = _mod
    _spec.loader.exec_module(_mod)
