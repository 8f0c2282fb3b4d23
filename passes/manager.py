"""The PassManager: runs a pipeline with instrumentation (IR dumps, verification, timing, equivalence)."""

from __future__ import annotations

import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TextIO

from kiln.ir import Graph, KilnError, ParamGroupWarning, PassError, VerifyError, print_graph, verify
from kiln.ir.gcpause import gc_paused

from .base import Pass
from .equivalence import first_difference
from .pipeline import parse_pipeline


@dataclass
class PassManager:
    """Runs passes in order. Dumps go to `out`; `timings` holds (pass, seconds) after `run`. `strict` turns a
    ParamGroupWarning (a group option selecting nothing) into a PassError."""

    passes: Sequence[Pass]
    verify_each: bool = False
    print_before_all: bool = False
    print_after_all: bool = False
    print_after_change: bool = False
    timing: bool = False
    check_equivalence: bool = False
    strict: bool = False
    out: TextIO = field(default_factory=lambda: sys.stderr)
    timings: list[tuple[str, float]] = field(default_factory=list)

    @classmethod
    def parse(cls, pipeline: str, **options) -> PassManager:
        return cls(parse_pipeline(pipeline), **options)

    def run(self, graph: Graph) -> Graph:
        self.timings = []
        for p in self.passes:
            label = p.pipeline_text()
            if self.print_before_all:
                self._dump(f"Before {label}", graph)
            start = time.perf_counter()
            with warnings.catch_warnings(), gc_paused():  # a pass builds a graph: nothing in it is garbage yet
                if self.strict:
                    warnings.simplefilter("error", ParamGroupWarning)
                try:
                    after = p.apply(graph)
                except ParamGroupWarning as w:
                    raise PassError(str(w)) from None  # the warning already names the pass
                except KilnError as e:
                    raise type(e)(f"in pass {label}: {e}") from None
            self.timings.append((label, time.perf_counter() - start))
            if self.verify_each:
                try:
                    verify(after)
                except VerifyError as e:
                    raise VerifyError(f"after pass {label}: {e}") from None
            if self.check_equivalence and p.preserves_semantics:
                self._check(label, graph, after)
            if self.print_after_all or (self.print_after_change and after is not graph):
                self._dump(f"After {label}", after)
            graph = after
        if self.timing:
            self._report_timing()
        return graph

    def _check(self, label: str, before: Graph, after: Graph) -> None:
        for fn in before.functions.values():
            if fn.name not in after.functions:
                raise PassError(f"pass {label} removed function @{fn.name}")
            diff = first_difference(fn, before, after)
            if diff is not None:
                raise PassError(f"pass {label} changed behaviour: {diff}")

    def _dump(self, title: str, graph: Graph) -> None:
        self.out.write(f"// ----- IR dump {title} ----- //\n{print_graph(graph, elide_data=True)}\n")

    def _report_timing(self) -> None:
        total = sum(t for _, t in self.timings) or 1e-12
        self.out.write("// ----- pass timing ----- //\n")
        width = max([len(n) for n, _ in self.timings] + [5])
        for name, t in self.timings:
            self.out.write(f"{name:<{width}}  {t * 1e3:10.3f} ms  {100 * t / total:5.1f}%\n")
        self.out.write(f"{'total':<{width}}  {total * 1e3:10.3f} ms\n")
