"""`kiln.ir.assert_structurally_equal`: graphs compare up to SSA value names, and nothing else."""

from __future__ import annotations

import pytest

from kiln.ir import assert_structurally_equal, canonical_text, parse, print_graph, structurally_equal

BASE = """
module @M {
  param @w : tensor<4x4xf32> {id = "0x1", init = normal(std = 0.5), grad = true}
  func @forward(%x: tensor<2x4xf32>, %y: tensor<2x4xf32>) -> (tensor<2x4xf32>, tensor<2xf32>) {
    %a = matmul %x, @w : tensor<2x4xf32>
    %b = sub %a, %y : tensor<2x4xf32>
    %k = constant {value = dense<tensor<f32>, 2.0>} : tensor<f32>
    %m = mul %b, %k : tensor<2x4xf32>
    %s = sum %m {axes = [1]} : tensor<2xf32>
    return %b, %s
  }
}
"""


def variant(old: str, new: str) -> str:
    """BASE with one piece of text replaced (asserting it was there, so a variant can't silently equal BASE)."""
    assert old in BASE
    return BASE.replace(old, new)


def test_equal_under_renaming_of_arguments_and_results() -> None:
    renamed = BASE
    for old, new in (("%x", "%input"), ("%y", "%target"), ("%a", "%0"), ("%b", "%diff"), ("%s", "%total"),
                     ("%k", "%two"), ("%m", "%scaled")):
        renamed = renamed.replace(old, new)
    assert renamed != BASE
    assert structurally_equal(parse(renamed), parse(BASE))
    assert_structurally_equal(parse(renamed), parse(BASE))


@pytest.mark.parametrize(("what", "old", "new"), [
    ("an attribute value", "dense<tensor<f32>, 2.0>", "dense<tensor<f32>, 3.0>"),
    ("operand order", "sub %a, %y", "sub %y, %a"),
    ("an operand", "sub %a, %y", "sub %a, %x"),
    ("an argument type", "%y: tensor<2x4xf32>)", "%y: tensor<1x4xf32>)"),
    ("a result type", "dense<tensor<f32>, 2.0>} : tensor<f32>", "dense<tensor<1xf32>, 2.0>} : tensor<1xf32>"),
    ("a function name", "func @forward", "func @infer"),
    ("parameter state", "grad = true", "grad = false"),
    ("a returned value", "return %b, %s", "return %a, %s"),
])
def test_differs(what: str, old: str, new: str) -> None:
    other = parse(variant(old, new))
    assert not structurally_equal(other, parse(BASE)), what
    with pytest.raises(AssertionError, match="graphs differ structurally"):
        assert_structurally_equal(other, parse(BASE))


def test_differs_on_a_symbol_name() -> None:
    """Symbols are names the module exposes (record paths), so renaming one everywhere still differs."""
    assert not structurally_equal(parse(BASE.replace("@w", "@v")), parse(BASE))


def test_attributes_at_their_default_are_the_same_graph() -> None:
    """The printer omits defaults, so spelling one out changes nothing (as `print(parse(t))` shows)."""
    explicit = variant("{axes = [1]}", "{axes = [1], keepdims = false}")
    assert structurally_equal(parse(explicit), parse(BASE))


def test_differs_on_op_order() -> None:
    """Two independent ops swapped compute the same values but are not the same graph."""
    text = """
module @M {
  func @f(%x: tensor<3xf32>) -> (tensor<3xf32>, tensor<3xf32>) {
    %a = exp %x : tensor<3xf32>
    %b = tanh %x : tensor<3xf32>
    return %a, %b
  }
}
"""
    swapped = text.replace("    %a = exp %x : tensor<3xf32>\n    %b = tanh %x : tensor<3xf32>\n",
                           "    %b = tanh %x : tensor<3xf32>\n    %a = exp %x : tensor<3xf32>\n")
    assert swapped != text
    assert not structurally_equal(parse(swapped), parse(text))


def test_differs_on_parameter_data() -> None:
    with_data = variant('init = normal(std = 0.5)', 'data = dense<tensor<4x4xf32>, 1.0>')
    assert not structurally_equal(parse(with_data), parse(variant('init = normal(std = 0.5)',
                                                                     'data = dense<tensor<4x4xf32>, 2.0>')))


def test_the_message_is_a_diff_of_the_differing_lines() -> None:
    with pytest.raises(AssertionError) as info:
        assert_structurally_equal(parse(variant("sub %a, %y", "add %a, %y")), parse(BASE))
    message = str(info.value)
    assert "-    %3 = sub %2, %1 : tensor<2x4xf32>" in message
    assert "+    %3 = add %2, %1 : tensor<2x4xf32>" in message
    assert "%b = add %a, %y" in message  # the actual graph with its own names, for finding the line


def test_canonical_text_parses_back_and_leaves_the_graph_alone() -> None:
    graph = parse(BASE)
    before = print_graph(graph)
    text = canonical_text(graph)
    assert "%a" not in text and "%0: tensor<2x4xf32>" in text
    assert print_graph(graph) == before
    assert canonical_text(parse(text)) == text
