"""Fixtures for the node-mode tests: a node agent process and the kubelet stand-in."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from nodeharness import POD_A, POD_B, Agent, Kubelet, Node


@pytest.fixture
def agent() -> Iterator[tuple[Agent, Kubelet]]:
    with Node(holder=False) as n:
        yield n.agent, n.kubelet


@pytest.fixture(scope="module")
def published() -> Iterator[tuple[Agent, Kubelet]]:
    """One agent with pods A (tenant alpha) and B (tenant beta) published."""
    with Node(POD_A, POD_B, holder=False) as n:
        yield n.agent, n.kubelet
