"""The per-policy block-hash seed (pure): a random ``PYTHONHASHSEED`` kept in a Secret.

vLLM seeds its prefix-cache block hashes from ``PYTHONHASHSEED``; the pool keeps blocks across
engine restarts only when every engine of a policy uses one seed. A public constant (``0``)
would also turn off Python's hash randomization in the API server and let anyone precompute
block hashes, which with a non-cryptographic hash (``--prefix-caching-hash-algo xxhash``)
makes collisions, and so cache poisoning, a matter of arithmetic. So the operator creates one
Secret per policy, ``kvoffload-hashseed-<policy>`` with a random key ``PYTHONHASHSEED``, and the
injector references it (``valueFrom.secretKeyRef``, ``optional: true``): the seed is stable
across the pod's restarts, never in a pod spec, and a KV-aware router that must hash the same
way may be granted read on that one Secret. ``optional``: where the operator cannot create it
(no RoleBinding in that namespace) the variable stays unset, vLLM seeds per process, the pod
serves, and the policy status says ``Limited`` (hits last one engine's life).

Python accepts an integer in [0, 4294967295]: 32 bits. That keeps the seed out of reach of
anyone who cannot read the Secret, not of a brute-force search over all seeds: pair it with the
cryptographic default hash (sha256), which the admission warning below asks for.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

KEY = "PYTHONHASHSEED"
PREFIX = "kvoffload-hashseed-"
MAX_NAME = 253
LABEL = "kvoffload.io/hash-seed-for"
WEAK_ALGOS = ("xxhash", "xxhash_cbor")
_ALGO_FLAG = re.compile(r"--prefix-caching-hash-algo(?:=|\s+)(\S+)")


def secret_name(policy: str) -> str:
    """``kvoffload-hashseed-<policy>``; a hash suffix where that would exceed 253 characters."""
    name = PREFIX + policy
    if len(name) <= MAX_NAME:
        return name
    digest = hashlib.sha256(policy.encode()).hexdigest()[:10]
    return f"{name[: MAX_NAME - 11]}-{digest}"


def new_seed() -> bytes:
    """A random seed Python accepts (1..4294967295; 0 would disable randomization)."""
    return str(secrets.randbelow(4294967295) + 1).encode()


def env_entry(policy: str) -> dict[str, Any]:
    return {
        "name": KEY,
        "valueFrom": {"secretKeyRef": {"name": secret_name(policy), "key": KEY, "optional": True}},
    }


def weak_hash_algo(container: Mapping[str, Any]) -> str | None:
    """The non-cryptographic ``--prefix-caching-hash-algo`` a vLLM container asks for, if any."""
    words: Sequence[Any] = [*(container.get("command") or []), *(container.get("args") or [])]
    text = " ".join(str(w) for w in words)
    for match in _ALGO_FLAG.finditer(text):
        algo = match.group(1).strip("'\"")
        if algo in WEAK_ALGOS:
            return algo
    for e in container.get("env") or []:
        if e.get("name") == "VLLM_PREFIX_CACHING_HASH_ALGO" and e.get("value") in WEAK_ALGOS:
            return str(e["value"])
    return None


def weak_hash_warning(algo: str, policy: str) -> str:
    return (
        f"kvoffload: --prefix-caching-hash-algo {algo} is not collision-resistant and this "
        f"pod's block-hash seed is shared by every engine of policy {policy!r} (and the pool "
        "keeps blocks across restarts): whoever learns the seed can craft colliding prompts "
        "that read or poison another request's cached KV; use sha256 (vLLM's default)"
    )
