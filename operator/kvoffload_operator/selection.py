"""Which policy wins a pod (pure).

Precedence when several policies of the pod's namespace select it: the highest ``priority``
wins; among equal priorities the policy whose name sorts first wins (a deterministic tie-break
every replica agrees on). The others are *losers*: the operator gives each a ``Conflicting``
condition naming the winner (reason ``LowerPriority``, or ``PriorityTie`` when only the name
decided), and pods are injected by the winner alone. Label selectors themselves live in
`labels` (shared with `policy`, so neither module imports the other's user).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from kvoffload_operator.labels import LabelSelector, Requirement, selector_from_spec
from kvoffload_operator.policy import Policy

__all__ = ["LabelSelector", "Requirement", "Selection", "select_policy", "selector_from_spec"]


@dataclass(frozen=True)
class Selection:
    """The outcome for one pod: ``winner`` (None when nothing matched) and the ``losers``."""

    winner: Policy | None
    losers: tuple[Policy, ...] = ()

    @property
    def tie(self) -> bool:
        """True when a loser had the winner's priority (the name decided)."""
        return self.winner is not None and any(
            p.priority == self.winner.priority for p in self.losers
        )


def select_policy(labels: Mapping[str, str] | None, policies: Iterable[Policy]) -> Selection:
    """The winning policy among those whose selector matches ``labels`` (see module doc)."""
    matching = sorted(
        (p for p in policies if p.selector.matches(labels)), key=lambda p: (-p.priority, p.name)
    )
    if not matching:
        return Selection(None)
    return Selection(matching[0], tuple(matching[1:]))
