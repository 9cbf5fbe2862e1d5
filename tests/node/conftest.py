"""Fixtures for the node-mode tests: a node agent process and the kubelet stand-in."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest
from nodeharness import POD_A, POD_B, Agent, Kubelet, make_root


@pytest.fixture
def agent() -> Iterator[tuple[Agent, Kubelet]]:
    root = make_root()
    a = Agent(root)
    a.start()
    k = Kubelet(root, a.csi_socket)
    try:
        yield a, k
    finally:
        k.channel.close()
        a.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def published() -> Iterator[tuple[Agent, Kubelet]]:
    """One agent with pods A (tenant alpha) and B (tenant beta) published."""
    root = make_root()
    a = Agent(root)
    a.start()
    k = Kubelet(root, a.csi_socket)
    try:
        k.publish(POD_A)
        k.publish(POD_B)
        yield a, k
    finally:
        k.channel.close()
        a.stop()
        shutil.rmtree(root, ignore_errors=True)
