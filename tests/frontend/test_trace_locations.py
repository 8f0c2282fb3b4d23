"""Traced ops carry the user's line and module path (issue 17, "Locations": "Every op carries a location: the
Python file:line (and module path, e.g. `encoder.layers.2.attn`) of the call that traced it ... so an error
points at the user's line and layer")."""

from __future__ import annotations

import pytest

import kiln
from kiln import nn
from kiln.ir import FileLoc, NameLoc, ShapeError, print_graph
from kiln.passes import PassManager

HERE = __file__


def line_of(marker: str) -> int:
    """The line of this file holding `marker` (so the expected lines move with the code)."""
    with open(HERE) as f:
        return next(i for i, text in enumerate(f, 1) if marker in text and "line_of" not in text)


class Block(kiln.Module):
    def __init__(self, d: int):
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return nn.functional.relu(self.fc(x))  # @block-forward


class Encoder(kiln.Module):
    def __init__(self, d: int, bad: bool = False):
        self.layers = [Block(d), Block(d)]
        self.bad = bad

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        if self.bad:
            x = x @ kiln.tensor(__import__("numpy").ones((5, 2), "float32"))  # @bad-matmul
        return x


class Model(kiln.Module):
    def __init__(self, d: int, bad: bool = False):
        self.encoder = Encoder(d, bad)

    def forward(self, x):
        return self.encoder(x) * 2.0  # @model-forward


def test_traced_ops_name_the_user_line_and_module_path():
    """Each op is at the innermost line outside kiln that recorded it, under the path of the module whose forward
    ran: the Linear inside `encoder.layers.1` is `encoder.layers.1.fc`, the relu its block's."""
    graph = kiln.trace(Model(4), ((None, 4), "f32"))
    locs = [(op.kind, op.loc) for op in graph.functions["forward"].ops]
    block, top = FileLoc(HERE, line_of("@block-forward")), FileLoc(HERE, line_of("@model-forward"))
    assert locs[:4] == [("linear", NameLoc("encoder.layers.0.fc", block)), ("relu", NameLoc("encoder.layers.0", block)),
                        ("linear", NameLoc("encoder.layers.1.fc", block)), ("relu", NameLoc("encoder.layers.1", block))]
    assert locs[-1] == ("mul", top)  # the root module has the empty path: a bare line
    shown = print_graph(graph, elide_data=True, locations=True)
    assert f'loc("encoder.layers.1.fc"({__import__("json").dumps(HERE)}:{line_of("@block-forward")}))' in shown


class Trained(kiln.Module):
    def __init__(self, d: int):
        self.model = Model(d)

    def forward(self, x):
        return nn.mse_loss(self.model(x), x)  # @loss


def test_locations_survive_autodiff_and_cse():
    """ "kept through every pass": after autodiff and cse the forward copy keeps the traced locations, and the
    gradient ops of `model.encoder.layers.1.fc` are at its line too (the loss, built inside kiln, at the
    user's call of it)."""
    graph = kiln.trace(Trained(4).train(), ((2, 4), "f32"))
    after = PassManager.parse("autodiff,cse,dce").run(graph)
    ops = after.functions["forward_backward"].ops
    fc1 = NameLoc("model.encoder.layers.1.fc", FileLoc(HERE, line_of("@block-forward")))
    assert [op.loc for op in ops[:len(graph.functions["forward"].ops)]] == [
        op.loc for op in graph.functions["forward"].ops]
    backward = ops[len(graph.functions["forward"].ops):]
    assert sum(op.loc == fc1 for op in backward) >= 2  # d/dx and d/dW of that linear
    assert any(op.loc == FileLoc(HERE, line_of("@loss")) for op in backward)


def test_a_shape_error_in_a_traced_model_names_the_line_and_layer():
    """A shape error while tracing names the user's line (the matmul) and the module whose forward it is in."""
    with pytest.raises(ShapeError, match=rf"^encoder \(.*test_trace_locations\.py:{line_of('@bad-matmul')}\): matmul"):
        kiln.trace(Model(4, bad=True), ((None, 4), "f32"))


def test_an_eager_shape_error_names_the_line():
    """Outside a trace there is no module path, but the error still names the user's line."""
    x = kiln.tensor(__import__("numpy").ones((2, 3), "float32"))
    with pytest.raises(ShapeError, match=r"^.*test_trace_locations\.py:\d+: matmul"):
        x @ x  # noqa: B018
