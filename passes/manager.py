"""The PassManager: runs a pipeline with instrumentation (IR dumps and diffs, verification, timing, equivalence,
statistics, bisection) and turns a pass's crash into a `PassCrash` holding the IR that reproduces it."""

from __future__ import annotations

import dataclasses
import difflib
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TextIO

from kiln.ir import Graph, KilnError, Op, ParamGroupWarning, PassError, VerifyError, print_graph, verify
from kiln.ir.gcpause import gc_paused
from kiln.ir.printer import function_lines
from kiln.ir.tracking import tracking

from .base import Pass
from .equivalence import first_difference
from .pipeline import parse_pipeline
from .statistics import PassStatistics, graph_changes, statistics_table

_RESULTS = ("timings", "pass_statistics", "applied", "skipped", "events")


class PassCrash(Exception):
    """A pass raised something other than a kiln input error: a bug in the pass. `graph` is the IR it was given
    and `pipeline` the pipeline text that runs it alone, which together reproduce the crash."""

    def __init__(self, label: str, graph: Graph, cause: BaseException):
        super().__init__(f"pass {label} crashed: {type(cause).__name__}: {cause}")
        self.label, self.pipeline, self.graph, self.cause = label, label, graph, cause


@dataclass
class PassManager:
    """Runs passes in order. Dumps go to `out`. After `run`: `timings` holds (pass, seconds), `pass_statistics`
    one PassStatistics per pass application, `events` how many pass applications and rewrites were numbered for
    bisection, `applied` the numbered pass applications that ran and `skipped` those `bisect_limit` skipped.
    `strict` turns a ParamGroupWarning (a group option selecting nothing) into a PassError. `print_before` and
    `print_after` name passes to dump around; `print_after_change="diff"` dumps a unified diff instead of the
    whole IR; `print_function` restricts dumps to one function, printed alone unless `print_module_scope` adds
    the module's nodes around it, `print_locations` with each op's location. `statistics` prints the statistics
    table after the run."""

    passes: Sequence[Pass]
    verify_each: bool = False
    print_before_all: bool = False
    print_after_all: bool = False
    print_after_change: bool | Literal["diff"] = False
    print_before: Sequence[str] = ()
    print_after: Sequence[str] = ()
    print_function: str | None = None
    print_module_scope: bool = False
    print_locations: bool = False
    timing: bool = False
    statistics: bool = False
    bisect_limit: int | None = None
    check_equivalence: bool = False
    strict: bool = False
    out: TextIO = field(default_factory=lambda: sys.stderr)
    timings: list[tuple[str, float]] = field(default_factory=list)
    pass_statistics: list[PassStatistics] = field(default_factory=list)
    applied: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    events: int = 0

    @classmethod
    def parse(cls, pipeline: str, **options: Any) -> PassManager:
        return cls(parse_pipeline(pipeline), **options)

    def run(self, graph: Graph, **options: Any) -> Graph:
        """Run the pipeline over `graph`; `options` override this manager's instruments for this run only."""
        if not options:
            return self._run(graph)
        settable = {f.name for f in dataclasses.fields(self)} - {"passes", *_RESULTS}
        unknown = sorted(options.keys() - settable)
        if unknown:
            raise PassError(f"PassManager.run has no option {unknown[0]!r} (options: {', '.join(sorted(settable))})")
        runner = dataclasses.replace(self, **options)
        try:
            return runner._run(graph)
        finally:
            for name in _RESULTS:
                setattr(self, name, getattr(runner, name))

    def _run(self, graph: Graph) -> Graph:
        self.timings, self.pass_statistics, self.applied, self.skipped, self.events = [], [], [], [], 0
        self._check_filters(graph)
        tracker = _Tracker(self)
        for p in self.passes:
            label = p.pipeline_text()
            if not tracker.next_event(f"pass {label}"):
                continue
            self.applied.append(f"({tracker.events}) pass {label}")
            if self.print_before_all or p.name in self.print_before:
                self._dump(f"Before {label}", graph)
            tracker.stats = PassStatistics(label)
            tracker.label = label
            start = time.perf_counter()
            with warnings.catch_warnings(), gc_paused(), tracking(tracker):  # nothing a pass builds is garbage yet
                if self.strict:
                    warnings.simplefilter("error", ParamGroupWarning)
                try:
                    after = p.apply(graph)
                except ParamGroupWarning as w:
                    raise PassError(str(w)) from None  # the warning already names the pass
                except KilnError as e:
                    raise type(e)(f"in pass {label}: {e}") from None
                except Exception as e:
                    raise PassCrash(label, graph, e) from e
            self.timings.append((label, time.perf_counter() - start))
            for name, n in graph_changes(graph, after).items():
                tracker.stats.add(name, n)
            self.pass_statistics.append(tracker.stats)
            if self.verify_each:
                try:
                    verify(after)
                except VerifyError as e:
                    raise VerifyError(f"after pass {label}: {e}") from None
            if self.check_equivalence and p.preserves_semantics:
                self._check(label, graph, after)
            self._dump_after(label, graph, after, p.name)
            graph = after
        self.events = tracker.events
        if self.timing:
            self._report_timing()
        if self.statistics:
            self.out.write(statistics_table(self.pass_statistics))
        if self.bisect_limit is not None:
            self._report_bisection()
        return graph

    def _check_filters(self, graph: Graph) -> None:
        """Dump filters that can never match are usage errors, reported before any pass runs."""
        names = {p.name for p in self.passes}
        for option, wanted in (("print-ir-before", self.print_before), ("print-ir-after", self.print_after)):
            for name in wanted:
                if name not in names:
                    raise PassError(f"--{option}: pass {name!r} is not in the pipeline "
                                    f"({', '.join(p.name for p in self.passes) or 'empty'})")
        if self.print_function is not None and self.print_function not in graph.functions:
            raise PassError(f"--print-function: module @{graph.name} has no function @{self.print_function}")
        if self.bisect_limit is not None and self.bisect_limit < 0:
            raise PassError(f"--bisect-limit must be at least 0, not {self.bisect_limit}")

    def _check(self, label: str, before: Graph, after: Graph) -> None:
        for fn in before.functions.values():
            if fn.name not in after.functions:
                raise PassError(f"pass {label} removed function @{fn.name}")
            diff = first_difference(fn, before, after)
            if diff is not None:
                raise PassError(f"pass {label} changed behaviour: {diff}")

    def _dump_after(self, label: str, before: Graph, after: Graph, name: str) -> None:
        changed = after is not before
        if self.print_after_change == "diff" and changed:
            old, new = self._text(before).splitlines(True), self._text(after).splitlines(True)
            diff = "".join(difflib.unified_diff(old, new, f"before {label}", f"after {label}")) or \
                "// (the printed IR is unchanged: the pass changed what --print-function leaves out)\n"
            self.out.write(f"// ----- IR diff After {label} ----- //\n{diff}")
        elif self.print_after_all or name in self.print_after or (self.print_after_change and changed):
            self._dump(f"After {label}", after)

    def _text(self, graph: Graph) -> str:
        """The IR a dump shows: the whole module, or the `print_function` alone or in its module scope."""
        locations = self.print_locations
        if self.print_function is None:
            return print_graph(graph, elide_data=True, locations=locations)
        fn = graph.functions.get(self.print_function)
        if self.print_module_scope:
            return print_graph(graph.replace(functions={fn.name: fn} if fn else {}), elide_data=True,
                               locations=locations)
        if fn is None:
            return f"// no function @{self.print_function}\n"
        return "\n".join(function_lines(fn, indent="", locations=locations)) + "\n"

    def _dump(self, title: str, graph: Graph) -> None:
        self.out.write(f"// ----- IR dump {title} ----- //\n{self._text(graph)}\n")

    def _report_timing(self) -> None:
        total = sum(t for _, t in self.timings) or 1e-12
        self.out.write("// ----- pass timing ----- //\n")
        width = max([len(n) for n, _ in self.timings] + [5])
        for name, t in self.timings:
            self.out.write(f"{name:<{width}}  {t * 1e3:10.3f} ms  {100 * t / total:5.1f}%\n")
        self.out.write(f"{'total':<{width}}  {total * 1e3:10.3f} ms\n")

    def _report_bisection(self) -> None:
        self.out.write(f"// ----- bisect-limit {self.bisect_limit}: ran {self.events - len(self.skipped)}, skipped "
                       f"{len(self.skipped)} pass applications and rewrites ----- //\n")
        self.out.write("".join(f"skipped {s}\n" for s in self.skipped))


class _Tracker:
    """Numbers pass applications and rewrites for `bisect_limit`, vetoing those past it, and counts rewrites
    into the statistics of the pass running (the rewrite hook of `kiln.ir.tracking`)."""

    def __init__(self, manager: PassManager):
        self.limit, self.skipped = manager.bisect_limit, manager.skipped
        self.events = 0
        self.label = ""
        self.stats = PassStatistics("")

    def next_event(self, what: str) -> bool:
        self.events += 1
        if self.limit is not None and self.events > self.limit:
            self.skipped.append(f"({self.events}) {what}")
            return False
        return True

    def allow_rewrite(self, op: Op) -> bool:
        names = ", ".join(f"%{r.name}" for r in op.results)
        if not self.next_event(f"rewrite of {names} ({op.kind}) in pass {self.label}"):
            return False
        self.stats.add(f"rewrote-{op.kind}", 1)
        return True

    def count(self, name: str, n: int) -> None:
        self.stats.add(name, n)
