"""The slot protocol, checked over schedules: a pool hit gives exactly the bytes a recompute
would, whatever the order of copies, session losses, reaper ticks, evictions, engine deaths
and restarts.

`machine.py` is the model (real Pool, servicer, client, scheduler and worker; copies as
explicit steps; real engine locks). Here:
- the two classes' counterexample schedules of a protocol whose answers and reservations rest
  on the session's pins and grace, replayed step by step: each runs every step, its copy
  included, and keeps every byte, for the reason the protocol gives (the load fails on its
  versions; the late copy finds its slots still its engine's);
- negative controls: with the worker's version re-read off, the class-1 schedule serves a
  wrong byte; with reservations reclaimed by a timer, the class-2 schedule overwrites a
  committed slot (so each replay can fail, and fails for that mechanism alone);
- the random search (swarm-tested rules, hypothesis' targeted phase) finds both classes on its
  own in those broken variants, and nothing in the protocol as shipped (CI profile;
  `KVO_MODEL_DEPTH=deep`, `make model-check`, for a long run);
- replays of engine death, sidecar restart and a late commit of the previous instance; after
  a restart the slots withheld for a living engine come back on its worker's drained report,
  which waits for the copy in flight (a report that does not wait overwrites a committed slot:
  negative control, replayed here and found by the deep profile's search).
"""

from __future__ import annotations

import logging
import os

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from tests.model.machine import BrokenVariant, SlotProtocol, step_engines
from tests.model.shim import Broken

DEEP = os.environ.get("KVO_MODEL_DEPTH", "") == "deep"

# (rule, arguments) per step.
SCHEDULES = {
    # A request is admitted with a pinned answer and its load job is with the worker, its copy
    # not run; the scheduler's session is lost (a deadline), the grace passes and the reaper
    # drops the pins; the other engine's stores evict the chunks and rewrite their slots; the
    # copy runs and copies the other keys' bytes.
    "class 1": [
        ("start", {"warm": 0, "stage": 1}),
        ("admit", {"i": 0, "catch_up": False}),
        ("session_loss", {"who": "scheduler"}),
        ("advance", {"dt": 2.5, "keep": True}),
        ("other_store", {"keys": [0, 1, 2, 3]}),
        ("copy", {"i": 0}),
        ("step", {"admit": False, "catch_up": False}),
    ],
    # A store's job is with the worker, its copy not landed; the scheduler's session is lost
    # and the grace passes; the other engine stores four keys; the first store's copy lands.
    "class 2": [
        ("start", {"warm": None, "stage": 1}),
        ("admit", {"i": 0, "catch_up": True}),
        ("step", {"admit": False, "catch_up": False}),
        ("session_loss", {"who": "scheduler"}),
        ("advance", {"dt": 2.5, "keep": True}),
        ("other_store", {"keys": [0, 1, 2, 3]}),
        ("copy", {"i": 0}),
    ],
}


@pytest.fixture(autouse=True)
def _quiet():
    """The pool logs every adoption and reap at INFO/WARNING: thousands per run."""
    logging.disable(logging.WARNING)
    yield
    logging.disable(logging.NOTSET)


def replay(cls: type[SlotProtocol], schedule: list[tuple[str, dict]], then=None) -> None:
    """Run `schedule` on a fresh model, every invariant checked after each step; `then(m)`
    checks the model afterwards."""
    with step_engines():
        m = cls()
        try:
            for name, kwargs in schedule:
                getattr(m, name)(**kwargs)
                m.pool_bookkeeping_holds()
                m.committed_slots_hold_their_keys()
            wanted = sum(1 for name, _ in schedule if name == "copy")
            assert m.copies_run == wanted, (
                f"the schedule ran {m.copies_run} of its {wanted} copies: the protocol refused "
                "it earlier (a miss, a refused reservation), so it proves nothing; fix the shim"
            )
            if then is not None:
                then(m)
        finally:
            m.teardown()


def _committed(m: SlotProtocol) -> set[str]:
    ns = m.pool._namespaces[m.worker.namespace_id]
    return {m.names[k] for k in ns.index.committed_keys()}


def test_class_1_schedule_the_load_fails_on_its_versions():
    """The copy ran and read another key's bytes; the worker's re-read of the slot versions
    fails the load, vLLM recomputes (no load reported done)."""

    def then(m):
        assert (m.loads_failed, m.loads_checked) == (1, 0), (m.loads_failed, m.loads_checked)
        assert {"f0", "f1", "f2", "f3"} <= _committed(m)  # the eviction did happen

    replay(SlotProtocol, SCHEDULES["class 1"], then)


def test_class_2_schedule_the_late_copy_finds_its_slots_still_owned():
    """The reservation outlived the session and the grace (its engine's lock is held), so the
    other engine got only the free slots; the late copy lands in its own slots and the commit
    makes the prompt's chunks visible with their bytes."""

    def then(m):
        ns = m.pool._namespaces[m.worker.namespace_id]
        assert len(ns.index.stores) == 1 and _committed(m) == {"f0", "f1"}, _committed(m)
        m.step(admit=False, catch_up=True)  # the copy is reported, the worker commits
        m.committed_slots_hold_their_keys()
        assert _committed(m) == {"f0", "f1", "p0c0", "p0c1"}, _committed(m)

    replay(SlotProtocol, SCHEDULES["class 2"], then)


NO_VERSIONS = BrokenVariant.variant(Broken.NO_VERSION_CHECK)
TIMER = BrokenVariant.variant(Broken.TIMER_RECLAIM)
TIMER_SLOTS = BrokenVariant.variant(Broken.TIMER_RECLAIM, "slots")  # class 2 invariants only


def test_negative_control_without_the_version_re_read_class_1_serves_a_wrong_byte():
    with pytest.raises(AssertionError, match="class 1: load of r0 .* holds bytes of f"):
        replay(NO_VERSIONS, SCHEDULES["class 1"])


def test_negative_control_with_timer_reclaim_class_2_overwrites_a_committed_slot():
    with pytest.raises(AssertionError, match="class 2: committed f. in slot . holds p0c"):
        replay(TIMER, SCHEDULES["class 2"])


def test_each_switch_breaks_only_its_own_class():
    """The version re-read alone guards class 1 here, engine ownership alone class 2."""
    replay(TIMER, SCHEDULES["class 1"])
    replay(NO_VERSIONS, SCHEDULES["class 2"])


def test_engine_death_frees_its_reservation_and_its_copy_never_lands():
    """A store in flight when its engine dies: the reaper finds no lock and frees the slots
    (no timer: one tick, 0.5 s); the other engine stores all four keys."""

    def then(m):
        assert _committed(m) == {"f0", "f1", "f2", "f3"}, _committed(m)
        assert not m.pool._namespaces[m.worker.namespace_id].index.stores

    schedule = SCHEDULES["class 2"][:3] + [
        ("engine_dies", {}),
        ("advance", {"dt": 0.5, "keep": False}),
        ("other_store", {"keys": [0, 1, 2, 3]}),
    ]
    replay(SlotProtocol, schedule, then)


# A store's copy is in flight when the sidecar restarts; the worker registers with the new
# instance and steps (its drained report waits for the copy); a late commit of the dead
# instance is forged; the other engine stores four keys; the copy lands.
RESTART = SCHEDULES["class 2"][:3] + [
    ("restart_sidecar", {}),
    ("reconnect", {"who": "worker"}),
    ("step", {"admit": False, "catch_up": True}),
    ("stale_commit", {"i": 0, "forge": True}),
    ("other_store", {"keys": [0, 1, 2, 3]}),
]


def _withheld(m: SlotProtocol) -> int:
    return len(m.pool._namespaces[m.worker.namespace_id].withheld)


def test_restart_withholds_reserved_slots_until_the_worker_drained():
    """The adopter withholds the in-flight store's slots, the old instance's commits are
    refused and the other engine gets only the free slots; the copy lands in the withheld
    slots; once the worker handled it, its drained report frees them (the engine lives)."""

    def then(m):
        assert m.refused_commits == 1
        assert _committed(m) == {"f0", "f1"}, _committed(m)
        assert _withheld(m) == 2  # the copy landed; the worker has not seen it finish
        m.step(admit=False, catch_up=True)  # handled: the commit is refused, the report freed
        assert _withheld(m) == 0
        m.other_store([2, 3])
        m.committed_slots_hold_their_keys()
        assert _committed(m) == {"f0", "f1", "f2", "f3"}, _committed(m)

    replay(SlotProtocol, RESTART + [("copy", {"i": 0})], then)


def test_restart_withheld_slots_come_back_when_the_engine_dies_first():
    """The engine dies with the copy still to run: the reaper finds no lock and the withheld
    slots come back without a report."""

    def then(m):
        assert _committed(m) == {"f0", "f1"} and _withheld(m) == 2, _committed(m)
        m.engine_dies()
        m.advance(0.5, keep=False)
        assert _withheld(m) == 0
        m.other_store([2, 3])
        m.committed_slots_hold_their_keys()
        assert _committed(m) == {"f0", "f1", "f2", "f3"}, _committed(m)

    replay(SlotProtocol, RESTART, then)


EARLY = BrokenVariant.variant(Broken.EARLY_DRAINED)
EARLY_SLOTS = BrokenVariant.variant(Broken.EARLY_DRAINED, "slots")


def test_negative_control_a_drained_report_before_the_copy_ends_overwrites_a_committed_slot():
    """Reported at registration with the copy in flight: the adopter frees the withheld slots,
    the other engine commits into them, the late copy overwrites its bytes."""
    with pytest.raises(AssertionError, match="class 2: committed f. in slot . holds p0c"):
        replay(EARLY, RESTART + [("copy", {"i": 0})])


def _settings(examples: int, steps: int, shrink: bool = True) -> settings:
    """CI: derandomized (the same schedules every run); deep: 10x the examples, 2x the steps,
    random. `shrink`: print the shortest failing schedule (in CI only where a failure is a
    bug; the broken variants' searches shrink in the deep profile)."""
    phases = [Phase.explicit, Phase.generate, Phase.target]
    return settings(
        max_examples=examples * (10 if DEEP else 1),
        stateful_step_count=steps * (2 if DEEP else 1),
        derandomize=not DEEP,
        database=None,
        deadline=None,
        phases=phases + [Phase.shrink] if shrink or DEEP else phases,
        suppress_health_check=list(HealthCheck),  # a heavy machine: slow, filtered by design
        print_blob=DEEP,
    )


def test_random_schedules_keep_every_byte():
    """Hypothesis explores schedules of every rule; both invariants on, nothing held back."""
    with step_engines():
        run_state_machine_as_test(SlotProtocol, settings=_settings(300, 20))


def test_the_search_finds_class_1_without_the_version_re_read():
    with step_engines(), pytest.raises(AssertionError, match="class 1"):
        run_state_machine_as_test(NO_VERSIONS, settings=_settings(2000, 20, shrink=False))


@pytest.mark.skipif(
    not DEEP,
    reason="the derandomized CI budget does not reach class 2 reliably yet (make model-check)",
)
def test_the_search_finds_class_2_with_timer_reclaim():
    with step_engines(), pytest.raises(AssertionError, match="class 2"):
        run_state_machine_as_test(TIMER_SLOTS, settings=_settings(300, 20, shrink=False))


@pytest.mark.skipif(
    not DEEP,
    reason="the derandomized CI budget does not reach it reliably yet (make model-check)",
)
def test_the_search_finds_class_2_with_an_early_drained_report():
    with step_engines(), pytest.raises(AssertionError, match="class 2"):
        run_state_machine_as_test(EARLY_SLOTS, settings=_settings(300, 20, shrink=False))
