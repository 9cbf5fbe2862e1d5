"""NUMA placement of the pool's pages: the pre-fault thread binds its first touches to a node."""

from __future__ import annotations

import ctypes
import logging
import os
import platform
from pathlib import Path

log = logging.getLogger(__name__)

NUMA_ROOT = Path("/sys/devices/system/node")
_MPOL_BIND = 2
_SYSCALL_SET_MEMPOLICY = {"x86_64": 238, "aarch64": 237}


def bind_thread_to_node(node: int) -> None:
    """Bind this thread's allocations (the first touch of every page) to NUMA `node`."""
    nr = _SYSCALL_SET_MEMPOLICY.get(platform.machine())
    if nr is None:
        log.warning(
            "numa binding unsupported on %s; pages go to the default node", platform.machine()
        )
        return
    maxnode = max(64, node + 1)
    mask = (ctypes.c_ulong * (-(-maxnode // 64)))()
    mask[node // 64] = 1 << (node % 64)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(nr, _MPOL_BIND, mask, ctypes.c_ulong(maxnode + 1)) != 0:
        err = ctypes.get_errno()
        log.warning(
            "numa binding to node %d failed (%s); pages go to the default node",
            node,
            os.strerror(err),
        )
    else:
        log.info("pool pages bound to numa node %d", node)
