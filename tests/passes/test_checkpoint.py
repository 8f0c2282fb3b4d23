"""The checkpoint pass on a transformer encoder layer: recomputing trades peak live activation bytes for ops,
and never changes a result (dropout included: a recomputed dropout draws the same mask)."""

from __future__ import annotations

import numpy as np
import pytest

import kiln
from kiln import nn
from kiln.frontend.autograd import differentiate
from kiln.frontend.module import Module
from kiln.frontend.nn import functional as F
from kiln.frontend.tensor import apply
from kiln.frontend.trace import trace_function
from kiln.ir import DType, Function, Graph, Interpreter, Op, PassError, TensorType, Trait, Value, ops_with, registered
from kiln.ir.liveness import peak_live_bytes
from kiln.passes import PassManager
from kiln.passes.checkpoint import checkpoint

SHAPE = (4, 16, 32)
X = np.random.default_rng(0).standard_normal(SHAPE).astype(np.float32)


def block_graph(device: kiln.Device) -> Graph:
    """A transformer encoder layer (dropout on) with a squared-error loss, traced on a static shape."""
    block = nn.TransformerEncoderLayer(32, 4, 64, device=device)
    graph, _ = trace_function(block, lambda x: nn.mse_loss(block(x), x), (SHAPE, "f32"))
    return graph


@pytest.fixture(scope="module")
def block() -> Graph:
    return block_graph(kiln.Device("cpu").autodiff())


def checkpointed(graph: Graph, strategy: str) -> Graph:
    return PassManager.parse(f"autodiff,cse,checkpoint{{strategy={strategy}}},dce", verify_each=True).run(graph)


def test_recomputing_lowers_peak_memory_and_keeps_every_result(block: Graph) -> None:
    graphs = {s: checkpointed(block, s) for s in ("none", "balanced", "all")}
    peaks = {s: peak_live_bytes(g.functions["forward_backward"]) for s, g in graphs.items()}
    assert peaks["all"] < peaks["balanced"] < peaks["none"]
    ops = {s: len(g.functions["forward_backward"].ops) for s, g in graphs.items()}
    assert ops["none"] < ops["balanced"]  # the price: recomputed ops
    want = Interpreter(graphs["none"]).run([X], "forward_backward", seed=5)
    for strategy in ("balanced", "all"):
        got = Interpreter(graphs[strategy]).run([X], "forward_backward", seed=5)
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a, b, err_msg=strategy)


def test_balanced_keeps_compute_bound_values(block: Graph) -> None:
    fn = checkpointed(block, "balanced").functions["forward_backward"]
    recomputed = {op.kind for op in fn.ops if any(r.name.endswith(".recompute") for r in op.results)}
    assert recomputed and not recomputed & {"matmul", "linear", "softmax", "layer_norm"}
    assert "dropout" in recomputed


def test_the_strategy_comes_from_the_device() -> None:
    balanced = differentiate(block_graph(kiln.Device("cpu").autodiff(checkpointing="balanced")))
    plain = differentiate(block_graph(kiln.Device("cpu").autodiff()))
    assert (peak_live_bytes(balanced.functions["forward_backward"])
            < peak_live_bytes(plain.functions["forward_backward"]))


def test_parameters_must_agree_on_a_strategy(block: Graph) -> None:
    params = dict(block.params)
    first = next(iter(params))
    params[first] = params[first].replace(checkpointing="all")
    mixed = block.replace(params={k: v.replace(checkpointing=v.checkpointing or "balanced") for k, v in params.items()})
    with pytest.raises(PassError, match="disagree on checkpointing"):
        PassManager.parse("autodiff,checkpoint").run(mixed)


def test_balanced_recomputes_exactly_the_memory_bound_ops() -> None:
    """Every op kind's value read by the backward: balanced recomputes those with Trait.MEMORY_BOUND, no others."""
    t = TensorType((2,), DType.f32)
    x = Value(t, "x")
    values = {kind: Op(kind, (x,), {}, (Value(t, kind),)).results[0] for kind in registered()}
    loss = Op("concat", tuple(values.values()), {}, (Value(t, "loss"),)).results[0]
    grad = Op("concat", tuple(values.values()), {}, (Value(t, "grad"),)).results[0]
    fn = Function("forward_backward", (x,), tuple(v.owner for v in (*values.values(), loss, grad)), (loss, grad))
    out = checkpoint(Graph("Kinds"), fn, 1, "balanced")
    recomputed = {op.kind for op in out.ops if op.results[0].name.endswith(".recompute")}
    assert recomputed == ops_with(Trait.MEMORY_BOUND)


class Tagger(Module):
    """An embedding lookup (take) and a linear head."""

    def __init__(self, device: kiln.Device):
        self.emb = nn.Embedding(10, 8, device=device)
        self.head = nn.Linear(8, 5, device=device)


def test_balanced_recomputes_take_and_gather_and_keeps_every_result() -> None:
    model = Tagger(kiln.Device("cpu").autodiff())

    def loss(tokens, targets):
        logp = F.log_softmax(model.head(model.emb(tokens)), axis=-1)
        picked = apply("gather", logp, apply("reshape", targets, shape=(-1, 1)), axis=1)
        return apply("mean", picked * picked)  # the backward reads the gathered value

    graph, _ = trace_function(model, loss, ((6,), "i64"), ((6,), "i64"))
    none, balanced = checkpointed(graph, "none"), checkpointed(graph, "balanced")
    fn = balanced.functions["forward_backward"]
    assert {"take", "gather"} <= {op.kind for op in fn.ops if op.results[0].name.endswith(".recompute")}
    inputs = [np.array([1, 3, 3, 0, 9, 2]), np.array([4, 0, 1, 1, 3, 2])]
    for a, b in zip(Interpreter(balanced).run(inputs, "forward_backward"),
                    Interpreter(none).run(inputs, "forward_backward")):
        np.testing.assert_array_equal(a, b)


CHAIN_SCRIPT = """
import sys
import numpy as np
from kiln.ir import Builder, interpret
from kiln.passes import PassManager
b = Builder("Chain")
x = b.input("x", ((4,), "f32"))
y = b.mul(x, b.param("w", (4,), grad=True, data=np.full(4, 0.5, np.float32)))
for i in range(int(sys.argv[1])):
    y = b.op("tanh", y)
b.ret(b.sum(y))
graph = PassManager.parse("autodiff").run(b.build())
sys.setrecursionlimit(400)  # far below the chain's length: a recursive walk would fail
for strategy in ("balanced", "all"):
    out = PassManager.parse(f"checkpoint{{strategy={strategy}}},dce").run(graph)
    loss, grad = interpret(out, [np.ones(4, np.float32)], function="forward_backward")
    print(strategy, float(loss), float(grad[0]))
"""


def test_checkpointing_a_long_chain_needs_no_recursion():
    """issue 15: `checkpoint{strategy=balanced}` hit RecursionError on ~600 chained elementwise ops. A 5,000-op
    chain (over ten times the limit) runs under a recursion limit of 400; both strategies agree with numpy's chain
    rule. `KILN_CHAIN_OPS=100000` runs the issue's 100,000-op chain (about a minute)."""
    import os
    import subprocess
    import sys
    n = int(os.environ.get("KILN_CHAIN_OPS", "5000"))
    done = subprocess.run([sys.executable, "-c", CHAIN_SCRIPT, str(n)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    y, dy = np.float64(0.5), 1.0  # the oracle: tanh applied n times to 0.5, and the product of the derivatives
    for _ in range(n):
        y = np.tanh(y)
        dy *= 1.0 - y * y
    for line in done.stdout.splitlines():
        strategy, loss, grad = line.split()
        assert float(loss) == pytest.approx(4 * y, rel=1e-4), strategy
        assert float(grad) == pytest.approx(dy, rel=1e-3, abs=1e-9), strategy
