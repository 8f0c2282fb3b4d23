"""Bisection (LLVM's `-opt-bisect-limit` search): the first pass application, or rewrite inside a rewrite pass,
after which an interestingness check fails, found by binary search over `PassManager(bisect_limit=N)`."""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass

from kiln.ir import Graph, KilnError
from kiln.passes import PassManager, parse_pipeline


@dataclass(frozen=True)
class Culprit:
    """The first bad event: its number, what it was, the pass application holding it, and the IR after it."""

    number: int
    event: str
    application: str
    graph: Graph


def bisect(graph: Graph, pipeline: str, is_good: Callable[[Graph], bool],
           progress: Callable[[str], None] = lambda line: None) -> Culprit:
    """Binary search for the smallest bisect limit whose output `is_good` rejects; the input must be good and the
    whole pipeline's output bad (checked first, each a KilnError otherwise)."""
    passes = parse_pipeline(pipeline)

    def run(limit: int | None) -> tuple[Graph, PassManager]:
        manager = PassManager(passes, bisect_limit=limit, out=io.StringIO())
        return manager.run(graph), manager

    full, manager = run(None)
    total = manager.events
    if not is_good(graph):
        raise KilnError("the check fails on the input, before any pass: nothing to bisect")
    if is_good(full):
        raise KilnError(f"the check passes after the whole pipeline ({total} pass applications and rewrites): "
                        "nothing to bisect")
    good, bad, bad_graph = 0, total, full
    while bad - good > 1:
        mid = (good + bad) // 2
        out, _ = run(mid)
        ok = is_good(out)
        progress(f"bisect-limit {mid}: {'good' if ok else 'bad'} ({good}..{bad})")
        if ok:
            good = mid
        else:
            bad, bad_graph = mid, out
    _, before = run(bad - 1)
    event = before.skipped[0]
    _, at = run(bad)
    return Culprit(bad, event, at.applied[-1], bad_graph)
