"""Pause Python's cyclic garbage collector around bulk IR construction, with a bounded policy for what it built.

Ops and their result values reference each other, so building a large graph allocates millions of objects in
cycles; each full collection then walks the whole heap, which made parsing and rewriting slower per op as
graphs grew. Nothing built inside is garbage yet, so collecting during the build only costs time.

Leaving the pause, the objects it built would all be young, and the next young collection would walk every one
of them (then the middle generation again) to find what is mostly a live graph: the per-op cost that grew from
10k to 1M ops (issue 15). Instead they join the oldest generation at once (`gc.freeze()` then `gc.unfreeze()`:
two list splices). That alone would hide dropped graphs from the collector, since objects moved this way do not
count toward CPython's trigger for full collections; so `PROMOTION` counts them, and once more have moved since
the last full collection (its own or anyone's) than `PromotionPolicy.limit` (as many as were alive after that
one, at least `floor`), the next pause begins with one. The heap thus grows by at most that many objects plus
one pause's between full collections (dropped graphs cannot pile up), and on average a moved object costs at
most one object walked by a full collection, where the young and middle sweeps walked it twice before CPython's
own full collections did.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass
class PromotionPolicy:
    """When objects built under `gc_paused` go straight to the oldest generation, and when a full collection
    catches up with them: after `limit` moved objects; each full collection sets `limit` to `share` of its
    survivors. A pause leaving fewer than `small` young objects keeps the collector's usual course (a cheap sweep)."""

    small: int = 10_000
    floor: int = 1_000_000
    share: float = 1.0
    moved: int = 0
    limit: int = 1_000_000

    def settle(self) -> None:
        """Move the young objects to the oldest generation, counting them."""
        if gc.get_count()[0] < self.small or gc.get_freeze_count():  # frozen on purpose: unfreezing would undo it
            return
        # the young count is the net of tracked allocations and frees since the last young collection (listing the
        # young objects would touch each one, as a sweep does); the middle generation is small, so it is listed
        self.moved += gc.get_count()[0] + len(gc.get_objects(generation=1))
        gc.freeze()
        gc.unfreeze()

    def catch_up_if_due(self) -> None:
        """The full collection that more than `limit` moved objects made due, run as a pause begins: it walks what
        earlier pauses built, not what this one will (`_caught_up` then restarts the count)."""
        if self.moved > self.limit:
            gc.collect()

    def caught_up(self) -> None:
        """A full collection walked every moved object: count anew, up to `share` of the objects it left."""
        self.moved = 0
        self.limit = max(self.floor, int(self.share * len(gc.get_objects(generation=2))))


PROMOTION = PromotionPolicy()


def _caught_up(phase: str, info: dict[str, int]) -> None:
    """After any full collection (CPython's own, a caller's `gc.collect()`, the policy's)."""
    if phase == "stop" and info["generation"] == 2:
        PROMOTION.caught_up()


gc.callbacks.append(_caught_up)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Disable the cyclic collector for the block (re-enabling it only if it was on); the outermost pause first
    runs a full collection if `PROMOTION` says one is due, and on a normal exit moves what it built to the oldest
    generation."""
    was_enabled = gc.isenabled()
    if was_enabled:
        PROMOTION.catch_up_if_due()
    gc.disable()
    try:
        yield
        if was_enabled:
            PROMOTION.settle()
    finally:
        if was_enabled:
            gc.enable()
