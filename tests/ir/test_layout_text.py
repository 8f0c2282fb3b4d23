"""The `.kir` form of a parameter's layout (`layout = permute[1, 0] reshape[6]`): printed canonically, parsed
back, and refused with file:line:col when malformed or not fitting its parameter."""

from __future__ import annotations

import pytest

from kiln.ir import IRParseError, Layout, VerifyError, parse, verify

PARAM = 'module @M {{\n  param @w : tensor<2x3xf32> {{id = "0x1", init = ones, layout = {}}}\n}}'
COLUMN = PARAM.format("HERE").splitlines()[1].index("HERE") + 1  # where the layout text starts on line 2


@pytest.mark.parametrize("text, layout", [
    ("permute[1, 0]", Layout(permute=(1, 0))),
    ("reshape[6]", Layout(reshape=(6,))),
    ("reshape[3, 1, 2]", Layout(reshape=(3, 1, 2))),
    ("permute[1, 0] reshape[6]", Layout((1, 0), (6,))),
])
def test_layout_round_trips(text: str, layout: Layout) -> None:
    graph = parse(PARAM.format(text))
    assert graph.params["w"].layout == layout
    assert f"layout = {text}," in str(graph) and parse(str(graph)).params["w"].layout == layout


@pytest.mark.parametrize("text, offset, message", [
    ("permute[0, 0]", 0, "layout permute[0, 0] is not a permutation of the axes"),
    ("permute[2, 0, 1]", 0, "param @w: layout permute[2, 0, 1] permutes 3 axes but the parameter has shape [2, 3]"),
    ("reshape[4]", 0, "param @w: layout reshape[4] cannot reshape a parameter of shape [2, 3] (6 elements) to [4]"),
    ("reshape[-6]", 0, "layout reshape[-6] needs non-negative sizes"),
    ("flip[1, 0]", 0, "expected a layout like permute[1, 0] or reshape[6]"),
    ("permute[1.0, 0]", 0, "layout permute needs a list of integers like permute[1, 0]"),
    ("permute", 7, "expected an attribute value"),
])
def test_bad_layout_is_a_parse_error_at_its_position(text: str, offset: int, message: str) -> None:
    with pytest.raises(IRParseError) as info:
        parse(PARAM.format(text), "in.kir")
    assert str(info.value).startswith(f"in.kir:2:{COLUMN + offset}: {message}"), str(info.value)


def test_verifier_checks_a_layout_against_its_parameter() -> None:
    graph = parse(PARAM.format("permute[1, 0]"))
    w = graph.params["w"]
    bad = graph.replace(params={"w": w.replace(layout=Layout(reshape=(5,)))})
    with pytest.raises(VerifyError, match="param @w: layout reshape\\[5\\] cannot reshape"):
        verify(bad)
