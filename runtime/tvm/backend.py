"""`TVMBackend`: the Backend protocol on compiled code, for eager tensors and anything else that runs graphs."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence

import numpy as np

from kiln.ir import Graph

from .compile import TargetLike, compile_graph
from .executable import Executable

_RECENT = 64  # graphs remembered by identity (a captured training step reruns one graph every step)


class TVMBackend:
    """Runs a function of a graph through TVM: compiled once per structure (the compile cache) with the
    parameters as inputs, so a graph whose weights change reuses its build.

    Graphs are immutable, so the executable of a graph seen recently is found by identity, skipping the
    structural hash (milliseconds for a training step's graph) on every run.
    """

    def __init__(self, target: TargetLike = "llvm", fast_math: bool = True):
        self.target, self.fast_math = target, fast_math
        self.name = f"tvm-{target}"
        self._recent: OrderedDict[tuple[int, str, frozenset[int]], tuple[Graph, Executable]] = OrderedDict()

    def executable(self, graph: Graph, function: str, donate: Collection[int] = ()) -> Executable:
        """`function` of `graph` compiled with its inputs at the positions `donate` donated."""
        key = (id(graph), function, frozenset(donate))
        hit = self._recent.get(key)
        if hit is not None and hit[0] is graph:
            self._recent.move_to_end(key)
            return hit[1]
        args = graph.functions[function].args
        donated = {function: [args[i].name for i in sorted(donate)]} if donate else None
        exe = compile_graph(graph, target=self.target, params="inputs", fast_math=self.fast_math,
                            functions=(function,), donate=donated)
        self._recent[key] = (graph, exe)  # holding the graph keeps its id from being reused
        if len(self._recent) > _RECENT:
            self._recent.popitem(last=False)
        return exe

    def run(self, graph: Graph, inputs: Sequence[np.ndarray], function: str = "forward", seed: int = 0,
            copy: bool = True, donate: Collection[int] = ()) -> tuple[np.ndarray, ...]:
        return self.executable(graph, function, donate).run(*inputs, function=function, seed=seed, copy=copy)
