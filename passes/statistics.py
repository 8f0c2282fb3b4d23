"""Pass statistics: named counters per pass application, from the pass itself (`kiln.ir.tracking.count`), from
the rewrite driver (one `rewrote-<kind>` per rewrite) and from comparing the graph before and after the pass."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kiln.ir import Graph, ParamNode


@dataclass
class PassStatistics:
    """The counters of one pass application, by name, in the order they were first reported."""

    label: str
    counters: dict[str, int] = field(default_factory=dict)

    def add(self, name: str, n: int) -> None:
        self.counters[name] = self.counters.get(name, 0) + n


def _storage_bits(p: ParamNode) -> int:
    return p.type.numel() * p.type.dtype.bits if p.type.is_static else 0


def graph_changes(before: Graph, after: Graph) -> dict[str, int]:
    """What any pass may change, counted from the two graphs: ops, functions, parameters, their gradient state,
    derivations, and the bytes of parameter storage. Zero counts are left out."""
    ops = sum(len(f.ops) for f in after.functions.values()) - sum(len(f.ops) for f in before.functions.values())
    frozen = sum(1 for name, p in before.params.items()
                 if p.grad and name in after.params and not after.params[name].grad)
    unfrozen = sum(1 for name, p in before.params.items()
                   if not p.grad and name in after.params and after.params[name].grad)
    saved = (sum(map(_storage_bits, before.params.values())) - sum(map(_storage_bits, after.params.values()))) // 8
    counts = {
        "ops-removed": -ops, "ops-added": ops,
        "functions-removed": len(before.functions.keys() - after.functions.keys()),
        "functions-added": len(after.functions.keys() - before.functions.keys()),
        "params-removed": len(before.params.keys() - after.params.keys()),
        "params-added": len(after.params.keys() - before.params.keys()),
        "params-frozen": frozen, "params-unfrozen": unfrozen,
        "derivations-removed": len(before.reparams.keys() - after.reparams.keys()),
        "derivations-added": len(after.reparams.keys() - before.reparams.keys()),
        "bytes-saved": saved, "bytes-added": -saved,
    }
    return {name: n for name, n in counts.items() if n > 0}


def statistics_table(stats: Sequence[PassStatistics]) -> str:
    """The `--statistics` report: each pass application, then its counters, right-aligned."""
    lines = ["// ----- pass statistics ----- //"]
    for s in stats:
        lines.append(s.label)
        width = max((len(str(n)) for n in s.counters.values()), default=1)
        lines.extend(f"  {n:>{width}}  {name}" for name, n in s.counters.items())
        if not s.counters:
            lines.append("  (no changes)")
    return "\n".join(lines) + "\n"
