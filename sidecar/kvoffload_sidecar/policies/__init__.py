"""Eviction policies behind one small protocol (`base.CachePolicy`), resolved by name."""

from kvoffload_sidecar.policies.base import CachePolicy
from kvoffload_sidecar.policies.factory import POLICY_NAMES, make_policy

__all__ = ["POLICY_NAMES", "CachePolicy", "make_policy"]
