"""Named dynamic dims (issue 12: "Dynamic dims stay symbolic (a `batch`/`height`/`width` dim becomes a `?` dim and
a TVM symbolic shape)"): inputs of an ONNX model sharing a `dim_param` share one dim. `?{batch}` is a dim whose size
is known at run time only and is the same wherever the name appears; `?` alone stays an anonymous dim.
"""

from __future__ import annotations

import numpy as np
import pytest

from kiln.ir import (
    DType,
    Function,
    Graph,
    Interpreter,
    IRParseError,
    Op,
    ShapeError,
    TensorType,
    Value,
    VerifyError,
    parse,
    print_graph,
    verify,
)
from kiln.ir.registry import infer
from kiln.ir.types import broadcast_axes

F32 = DType.f32

TEXT = """module @M {
  func @forward(%a: tensor<?{n}x?{x}x4xf32>, %m: tensor<?x1x4xf32>, %c: tensor<?{n}x4x2xf32>) -> \
(tensor<?{n}x?{x}x2xf32>) {
    %s = add %a, %m : tensor<?{n}x?{x}x4xf32>
    %t = transpose %s {perm = [1, 0, 2]} : tensor<?{x}x?{n}x4xf32>
    %u = transpose %t {perm = [1, 0, 2]} : tensor<?{n}x?{x}x4xf32>
    %o = matmul %u, %c : tensor<?{n}x?{x}x2xf32>
    return %o
  }
}
"""


def types(text: str) -> list[str]:
    fn = parse(text).functions["forward"]
    return [str(a.type) for a in fn.args] + [str(r.type) for op in fn.ops for r in op.results]


def test_named_dims_print_and_parse_back():
    """`print(parse(print(g))) == print(g)`; a name may hold an `x` (the dim separator) and `?` stays anonymous."""
    graph = verify(parse(TEXT))
    assert print_graph(graph) == TEXT
    a = graph.functions["forward"].args[0].type
    assert a.shape == (None, None, 4) and a.names == ("n", "x", None)
    assert graph.functions["forward"].args[1].type.names == ()  # no name: exactly today's type
    assert TensorType((None, 4), F32) == TensorType((None, 4), F32, (None, None))


@pytest.mark.parametrize("bad, why", [
    ("tensor<?{}x4xf32>", "bad dimension '\\?\\{\\}'"),
    ("tensor<4{n}x4xf32>", "bad dimension '4\\{n\\}'"),
    ("tensor<?{a b}x4xf32>", "invalid dim name 'a b'"),
    ("tensor<?{n}}x4xf32>", "invalid dim name 'n}'"),
])
def test_bad_named_dims_are_parse_errors(bad: str, why: str):
    text = f"module @M {{\n  func @forward(%a: {bad}) -> ({bad}) {{\n    return %a\n  }}\n}}\n"
    with pytest.raises(IRParseError, match=why):
        parse(text)


def test_a_name_is_only_for_a_dynamic_dim():
    with pytest.raises(ShapeError, match="invalid dim name 'n' for dim 4"):
        TensorType((4,), F32, ("n",))
    with pytest.raises(ShapeError, match="dim names .* do not match shape"):
        TensorType((None, 4), F32, ("n",))


@pytest.mark.parametrize("a, b, want", [
    (("n",), ("n",), ("n",)),      # equal names: that name
    (("n",), (1,), ("n",)),        # a name against 1: the name
    (("n",), (None,), ("n",)),     # against an anonymous `?` (which must be n or 1): the name
    (("n",), (5,), (5,)),          # against n > 1: the int (the name must be 5 or 1)
    (("n",), ("m",), (None,)),     # two names: either may be 1, so an anonymous `?`
    ((None,), (1,), (None,)),      # unnamed dims broadcast as before
])
def test_broadcasting_with_names(a, b, want):
    assert broadcast_axes(a, b) == want == broadcast_axes(b, a)


def test_broadcasting_two_ints_still_fails():
    with pytest.raises(ShapeError, match=r"shapes \[\?\{n\}, 2\] and \[3\] do not broadcast"):
        broadcast_axes(("n", 2), (3,))


def named(*axes) -> TensorType:
    return TensorType.of(axes, F32)


@pytest.mark.parametrize("kind, operands, attrs, want", [
    ("mul", [named("b", 1, 4), named(1, "s", 4)], {}, "tensor<?{b}x?{s}x4xf32>"),
    ("matmul", [named("b", "s", 4), named(4, 3)], {}, "tensor<?{b}x?{s}x3xf32>"),
    ("transpose", [named("b", "s", 4)], {"perm": (2, 0, 1)}, "tensor<4x?{b}x?{s}xf32>"),
    ("concat", [named("b", 2), named(None, 3)], {"axis": 1}, "tensor<?{b}x5xf32>"),
    ("concat", [named("b", 2), named("b", "s")], {"axis": 1}, "tensor<?{b}x?xf32>"),
    ("reshape", [named("b", "s", 8), named("b", "s", 8)], {"shape": (-1, -1, 2, 4), "copy": (0, 1, -1, -1)},
     "tensor<?{b}x?{s}x2x4xf32>"),
    ("tanh", [named("b", 4)], {}, "tensor<?{b}x4xf32>"),
])
def test_inference_keeps_the_name_of_a_dim_it_copies(kind, operands, attrs, want):
    _, (result,) = infer(kind, operands, attrs)
    assert str(result) == want


def test_take_keeps_the_index_dims_names():
    table, ids = named(10, 4), TensorType.of(("b", "s"), DType.i64)
    assert str(infer("take", [table, ids], {})[1][0]) == "tensor<?{b}x?{s}x4xf32>"


def test_a_result_that_drops_a_name_is_refused():
    """A declared type must be the inferred one, names included (the parser and the verifier check it)."""
    wrong = TEXT.replace("%s = add %a, %m : tensor<?{n}x", "%s = add %a, %m : tensor<?x")
    with pytest.raises(IRParseError, match=r"add gives \(tensor<\?\{n\}x\?\{x\}x4xf32>\) but the text "
                                           r"declares \(tensor<\?x\?\{x\}x4xf32>\)"):
        parse(wrong)
    x = Value(named("b", 3), "x")
    neg = Op("neg", (x,), {}, (Value(named(None, 3), "y"),))
    graph = Graph("M", functions={"forward": Function("forward", (x,), (neg,), neg.results)})
    with pytest.raises(VerifyError, match=r"results are typed \(tensor<\?x3xf32>\) but the op infers "
                                          r"\(tensor<\?\{b\}x3xf32>\)"):
        verify(graph)


def test_inputs_sharing_a_name_must_agree_at_run_time():
    graph = parse(TEXT)
    x = np.ones((2, 3, 4), np.float32)
    m = np.ones((1, 1, 4), np.float32)
    got, = Interpreter(graph).run([x, m, np.ones((2, 4, 2), np.float32)])
    np.testing.assert_allclose(got, np.full((2, 3, 2), 8.0))
    with pytest.raises(ShapeError, match=r"dim \?\{n\} is 2 in @forward input %a dim 0 but 3 in @forward input "
                                         r"%c dim 0"):
        Interpreter(graph).run([x, m, np.ones((3, 4, 2), np.float32)])


@pytest.mark.parametrize("kind, operand, attrs, want", [
    # reductions: "the reduced axis drops or becomes 1, the others keep their names"
    ("sum", named("b", "s", 4), {"axes": (1,)}, "tensor<?{b}x4xf32>"),
    ("sum", named("b", "s", 4), {"axes": (1,), "keepdims": True}, "tensor<?{b}x1x4xf32>"),
    ("mean", named("b", "s", 4), {"axes": (-1,)}, "tensor<?{b}x?{s}xf32>"),
    ("max", named("b", "s", 4), {"axes": (0, 2), "keepdims": True}, "tensor<1x?{s}x1xf32>"),
    ("prod", named("b", "s", 4), {"axes": None}, "tensor<f32>"),
    ("argmax", named("b", "s", 4), {"axis": 2}, "tensor<?{b}x?{s}xi64>"),
    ("argmin", named("b", "s", 4), {"axis": 0, "keepdims": True}, "tensor<1x?{s}x4xi64>"),
    # broadcast_to (what ONNX Expand becomes): a kept (-1) dim keeps its name, a 1 grown to n is n
    ("broadcast_to", named("b", 1, 4), {"shape": (-1, 3, 4)}, "tensor<?{b}x3x4xf32>"),
    ("broadcast_to", named("b", 4), {"shape": (2, -1, 4)}, "tensor<2x?{b}x4xf32>"),
    ("broadcast_to", named(1, "s"), {"shape": (5, -1)}, "tensor<5x?{s}xf32>"),
])
def test_reductions_and_broadcast_to_keep_the_names_of_the_dims_they_keep(kind, operand, attrs, want):
    _, results = infer(kind, [operand], attrs)
    assert str(results[0]) == want


def test_topk_keeps_the_other_dims_names_in_both_results():
    _, (values, indices) = infer("topk", [named("b", "s", 8)], {"k": 3})
    assert (str(values), str(indices)) == ("tensor<?{b}x?{s}x3xf32>", "tensor<?{b}x?{s}x3xi64>")


def test_a_named_sum_parses_and_runs():
    """The parser checks the declared (named) type against inference; the interpreter keeps numpy's sum."""
    text = """module @M {
  func @forward(%a: tensor<?{b}x?{s}x4xf32>) -> (tensor<?{b}x1x4xf32>) {
    %r = sum %a {axes = [1], keepdims = true} : tensor<?{b}x1x4xf32>
    return %r
  }
}
"""
    graph = verify(parse(text))
    assert print_graph(graph) == text
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    got, = Interpreter(graph).run([x])
    np.testing.assert_array_equal(got, x.sum(axis=1, keepdims=True))
