"""kiln demo: build a small MLP graph with the Python builder, print its IR, optimize it, run it."""

from __future__ import annotations

import numpy as np

from kiln import ir
from kiln.passes import PassManager


def build_mlp() -> ir.Graph:
    b = ir.Builder("MLP")
    x = b.input("x", ((None, 784), "f32"))
    w1 = b.param("fc1.weight", (784, 128), init=ir.Init("kaiming_uniform", (("fan_in", 784),)))
    b1 = b.param("fc1.bias", (128,), init=ir.Init("zeros"))
    w2 = b.param("fc2.weight", (128, 10), init=ir.Init("kaiming_uniform", (("fan_in", 128),)))
    training = b.flag("drop.training", value=False)
    h = b.relu(b.linear(x, w1, b1))
    h = b.dropout(h, training, p=0.1)
    h = b.mul(h, 1.0)  # an identity canonicalize removes
    b.ret(b.softmax(b.linear(h, w2)))
    return b.build()


def main() -> None:
    graph = ir.verify(build_mlp())
    print(ir.print_graph(graph))
    optimized = PassManager.parse("canonicalize,cse,dce", verify_each=True, check_equivalence=True).run(graph)
    print(ir.print_graph(optimized))
    x = np.random.default_rng(0).standard_normal((4, 784)).astype(np.float32)
    (probs,) = ir.interpret(optimized, [x])
    print("class probabilities of 4 inputs sum to", probs.sum(axis=1))


if __name__ == "__main__":
    main()
