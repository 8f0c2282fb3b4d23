"""`TVMBackend`: the Backend protocol on compiled code, for eager tensors and anything else that runs graphs."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kiln.ir import Graph

from .compile import TargetLike, compile_graph


class TVMBackend:
    """Runs a function of a graph through TVM: compiled once per structure (the compile cache) with the
    parameters as inputs, so a graph whose weights change reuses its build."""

    def __init__(self, target: TargetLike = "llvm", fast_math: bool = True):
        self.target, self.fast_math = target, fast_math
        self.name = f"tvm-{target}"

    def run(self, graph: Graph, inputs: Sequence[np.ndarray], function: str = "forward", seed: int = 0
            ) -> tuple[np.ndarray, ...]:
        exe = compile_graph(graph, target=self.target, params="inputs", fast_math=self.fast_math,
                            functions=(function,))
        return exe.run(*inputs, function=function, seed=seed)
