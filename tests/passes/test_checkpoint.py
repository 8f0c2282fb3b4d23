"""The checkpoint pass on a transformer encoder layer: recomputing trades peak live activation bytes for ops,
and never changes a result (dropout included: a recomputed dropout draws the same mask)."""

from __future__ import annotations

import numpy as np
import pytest

import kiln
from kiln import nn
from kiln.frontend.autograd import differentiate
from kiln.frontend.trace import trace_function
from kiln.ir import Graph, Interpreter, PassError
from kiln.ir.liveness import peak_live_bytes
from kiln.passes import PassManager

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
