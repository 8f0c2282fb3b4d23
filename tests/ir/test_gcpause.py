"""The collector policy around bulk IR construction (`kiln.ir.gcpause`): what a pause built joins the oldest
generation without a young sweep, and a full collection catches up after a bounded number of such objects, so
cyclic garbage (a dropped graph: each op and its results form a cycle) never piles up without bound."""

from __future__ import annotations

import dataclasses
import gc

import pytest

from kiln.ir import Builder, gcpause
from kiln.passes import PassManager


def _graph(width: int):
    b = Builder("Chain")
    x = b.input("x", ((None, 4), "f32"))
    for _ in range(width):
        x = b.relu(b.neg(b.neg(x)))
    b.ret(x)
    return b.build()


@pytest.fixture
def small_policy(monkeypatch):
    """A policy for every pause, with a floor of 50,000 objects and no share of the live heap (restored afterwards)."""
    policy = gcpause.PromotionPolicy(small=0, floor=50_000, share=0.0, limit=50_000)
    monkeypatch.setattr(gcpause, "PROMOTION", policy)
    return policy


def test_a_thousand_pass_runs_over_dropped_graphs_hold_bounded_garbage(small_policy) -> None:
    """Issue 15: "nothing grows without bound". Each run builds a graph and a pass rewrites it, then both are
    dropped (cyclic garbage); objects moved past the young sweep count toward a full collection, so what the
    collector has not seen stays under the policy's limit plus one run's objects, however many runs there are."""
    canonicalize = PassManager.parse("canonicalize")
    gc.collect()
    for _ in range(1_000):
        canonicalize.run(_graph(5))
    held = gc.collect()
    assert held <= small_policy.limit + 2_000, f"{held} unreachable objects held after 1,000 runs"  # + one run's


def test_objects_someone_froze_stay_frozen() -> None:
    """`gc.freeze()` is an application's choice (e.g. before forking workers); a pause must not unfreeze them."""
    sentinel: list[object] = []
    gc.freeze()
    try:
        PassManager.parse("canonicalize").run(_graph(50))
        assert not any(o is sentinel for o in gc.get_objects()), "a frozen object went back to the collector"
    finally:
        gc.unfreeze()


def test_the_limit_follows_the_heap_after_a_full_collection(monkeypatch) -> None:
    """After a full collection, the next one waits for `share` of the objects that survived (at least `floor`):
    full collections per moved object stay bounded as graphs grow, as in CPython's own rule."""
    policy = gcpause.PromotionPolicy(small=0, floor=10, share=0.5, limit=0)
    monkeypatch.setattr(gcpause, "PROMOTION", policy)
    keep = _graph(20)
    with gcpause.gc_paused():
        keep = dataclasses.replace(keep)
    assert policy.moved > policy.limit  # due: the next pause begins with a full collection
    with gcpause.gc_paused():
        pass
    assert policy.moved < 1_000
    assert policy.limit >= len(gc.get_objects(generation=2)) // 2 - 1_000

def test_a_small_pause_is_left_to_the_usual_sweep() -> None:
    """A pause that built fewer than `small` objects (a one-line `.kir` parse) keeps them young: their sweep is cheap,
    and the collector's own schedule stays as it was."""
    gc.collect()
    with gcpause.gc_paused():
        built = [[] for _ in range(100)]
    assert any(o is built for o in gc.get_objects(generation=0))


def test_any_full_collection_restarts_the_count(small_policy) -> None:
    """A full collection, whoever runs it, walks every object moved so far: the count toward the next restarts."""
    small_policy.moved = 40_000
    gc.collect()
    assert small_policy.moved == 0
