"""The sidecar's modules import each other without a circle (TYPE_CHECKING imports included):
each one can be read, tested and replaced from the bottom up."""

from __future__ import annotations

import pytest

grimp = pytest.importorskip("grimp")


def test_no_import_cycle_in_the_sidecar() -> None:
    graph = grimp.build_graph("kvoffload_sidecar", include_external_packages=False)
    cycles = []
    for module in sorted(graph.modules):
        for imported in sorted(graph.find_modules_directly_imported_by(module)):
            back = graph.find_shortest_chain(importer=imported, imported=module)
            if back is not None:
                cycles.append(f"{module} -> {' -> '.join(back)}")
    assert not cycles, "\n".join(cycles)
