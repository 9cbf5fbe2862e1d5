"""The presence map through a real `kvoffload sidecar` process: named at registration, marked
by stores, rebuilt from the adopted pool file after a SIGKILL, re-mapped at re-registration."""

from __future__ import annotations

import hashlib
import os
import time

import pytest
from kvoffload_cli.sidecar_child import SidecarProcess
from kvoffload_connector.common.keys import make_key

from tests.connector.engine_ranks import commit, hold, new_client
from tests.connector.specs import TINY_SPEC

SPEC = TINY_SPEC


def key(i: int) -> bytes:
    return make_key(hashlib.sha256(i.to_bytes(8, "big")).digest(), 0)


@pytest.mark.process
@pytest.mark.timeout(90)
@pytest.mark.parametrize("framed", [True, False], ids=["framed", "grpc"])
def test_stores_mark_the_map_and_a_restarted_sidecar_marks_what_it_adopted(framed: bool) -> None:
    sc = SidecarProcess(pool_size="16Mi").start()
    try:
        c = new_client(sc.socket, "test/scheduler", rpc_timeout_s=2, framed=framed)
        reg = c.register(SPEC, 1, 8192)
        locks = hold(reg)
        view = c.presence
        assert view is not None and os.path.dirname(view.path) == os.path.dirname(sc.socket)
        assert not any(view.maybe_present(key(i)) for i in range(50))
        res = c.reserve_store([key(1), key(2)])
        assert view.maybe_present(key(1)) and view.maybe_present(key(2))  # before the commit
        assert commit(c, reg, res.store_id)
        assert not any(view.maybe_present(key(i)) for i in range(3, 50))
        sc.kill()  # no goodbye: the next sidecar adopts the pool file and rebuilds the map
        sc.start()
        deadline = time.monotonic() + 10
        while not c.ensure() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert c.connected and c.registrations == 2
        again = c.presence
        assert again is not None and again is not view  # the new instance's file, mapped anew
        assert again.maybe_present(key(1)) and again.maybe_present(key(2))
        assert not again.maybe_present(key(3))
        assert c.lookup([[key(1), key(2)]]) == [2]  # and the pool agrees
        c.close()
        for lock in locks:
            lock.release()
    finally:
        sc.close()
