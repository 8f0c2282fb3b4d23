"""Quantized parameters in the IR: i4/u4 codes in the text form, the verifier's one allowed nesting (a lora over a
dequantized base, as QLoRA has), and the interpreter evaluating that chain."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from kiln.ir import (
    DType,
    Graph,
    Interpreter,
    IRParseError,
    ParamNode,
    ReparamNode,
    TensorType,
    VerifyError,
    parse,
    print_graph,
    verify,
)

CODES = np.array([[-8, 7, 0], [1, -1, 3]], ml_dtypes.int4)
SCALES = np.array([[0.5], [0.25]], np.float32)
A = np.array([[1.0], [2.0]], np.float32)
B = np.array([[0.5, -1.0, 2.0]], np.float32)


def node(name: str, data: np.ndarray, id: int) -> ParamNode:
    return ParamNode(name, TensorType(data.shape, DType.from_numpy(data.dtype)), id, data=data)


def dequantized(name: str = "w.base", codes: str = "w.codes") -> ReparamNode:
    return ReparamNode(name, TensorType((2, 3), DType.f32), "dequantize", (codes, "w.scales"),
                       {"value": "q4f", "block": (1, 3), "dtype": DType.f32})


def lora(name: str = "w", base: str = "w.base") -> ReparamNode:
    return ReparamNode(name, TensorType((2, 3), DType.f32), "lora", (base, "a", "b"), {"scale": 0.5})


def qlora_graph(*reparams: ReparamNode) -> Graph:
    params = [node("w.codes", CODES, 1), node("w.scales", SCALES, 2), node("a", A, 3), node("b", B, 4)]
    chosen = reparams or (dequantized(), lora())
    return Graph("M", params={p.name: p for p in params}, reparams={r.name: r for r in chosen})


# -- text form -----------------------------------------------------------------------------------------------------


def test_i4_and_u4_param_data_round_trip() -> None:
    u4 = np.array([0, 15, 9], ml_dtypes.uint4)
    graph = qlora_graph()
    graph = graph.replace(params={**graph.params, "u": node("u", u4, 5)})
    text = print_graph(graph)
    assert 'data = dense<tensor<2x3xi4>, [-8, 7, 0, 1, -1, 3]>' in text
    assert 'data = dense<tensor<3xu4>, [0, 15, 9]>' in text
    assert 'dequantize(@w.codes, @w.scales) {value = "q4f", block = [1, 3]}' in text
    again = verify(parse(text))
    assert print_graph(again) == text
    for name, want in [("w.codes", CODES), ("u", u4)]:
        got = again.params[name].data
        assert got.dtype == want.dtype and np.array_equal(got, want)


def test_splat_codes_round_trip() -> None:
    text = print_graph(Graph("M", params={"c": node("c", np.full((2, 2), -3, ml_dtypes.int4), 1)}))
    assert "dense<tensor<2x2xi4>, -3>" in text
    assert parse(text).params["c"].data.tolist() == [[-3, -3], [-3, -3]]


PARAM = 'module @M {{\n  param @c : tensor<2x{0}> {{id = "0x1", data = dense<tensor<2x{0}>, {1}>}}\n}}\n'


@pytest.mark.parametrize("dtype, elements, message", [
    ("i4", "[-9, 0]", "-9 is out of range for i4"),
    ("i4", "[8, 0]", "8 is out of range for i4"),
    ("u4", "[16, 0]", "16 is out of range for u4"),
    ("u4", "-1", "-1 is out of range for u4"),
    ("i4", "[0.5, 1]", "i4 element is not an integer"),
    ("u4", "true", "expected a number for u4"),
    ("nf4", "[1, 2]", "dense data needs a static, unpacked type or i4/u4 codes"),
])
def test_bad_code_data_is_a_parse_error(dtype: str, elements: str, message: str) -> None:
    with pytest.raises(IRParseError, match=message):
        parse(PARAM.format(dtype, elements))


def test_codes_stay_out_of_op_constants() -> None:
    text = ('module @M {\n  func @f() -> (tensor<2xi4>) {\n    %c = constant {value = dense<tensor<2xi4>, 1>} : '
            'tensor<2xi4>\n    return %c\n  }\n}\n')
    with pytest.raises(IRParseError, match="dense data needs a static, unpacked type at"):
        parse(text)


# -- verifier ------------------------------------------------------------------------------------------------------


def test_lora_over_a_dequantized_base_verifies() -> None:
    verify(qlora_graph())
    verify(qlora_graph(dequantized("w")))  # a plain quantized weight


def expect_verify_error(graph: Graph, message: str) -> None:
    with pytest.raises(VerifyError, match=message):
        verify(graph)


def test_lora_over_lora_is_nested() -> None:
    graph = qlora_graph(dequantized(), lora("inner"), lora("outer", "inner"))
    expect_verify_error(graph, r"reparam @outer: operand @inner is a derived parameter \(nested reparameterization\)")


def test_a_derived_operand_must_dequantize_stored_parameters() -> None:
    scales = ReparamNode("s", TensorType((2, 1), DType.f32), "lora", ("w.scales", "a", "b"), {"scale": 1.0})
    base = ReparamNode("w.base", TensorType((2, 3), DType.f32), "dequantize", ("w.codes", "s"),
                       {"value": "q4f", "block": (1, 3)})
    expect_verify_error(qlora_graph(lora(), base, scales), r"reparam @w: operand @w\.base is a derived parameter "
                        r"\(nested reparameterization\); only a dequantize of stored parameters may be an operand")


def test_dequantize_of_a_dequantize_is_a_type_error() -> None:
    graph = qlora_graph(dequantized("first"), dequantized("second", "first"))
    expect_verify_error(graph, r"reparam @second: dequantize: operand 0 \(codes\) has dtype f32")


def test_cycles_are_rejected() -> None:
    expect_verify_error(qlora_graph(lora("w", "w")), r"reparam @w: operand @w derives from @w itself \(a cycle\)")
    pair = ReparamNode("w.base", TensorType((2, 3), DType.f32), "dequantize", ("w", "w.scales"), {"value": "q4f"})
    expect_verify_error(qlora_graph(pair, lora()), r"reparam @w\.base: operand @w derives from @w\.base itself")


def test_missing_and_mistyped_operands() -> None:
    expect_verify_error(qlora_graph(lora("w", "nowhere")), r"reparam @w: operand @nowhere is not a parameter")
    wrong = ReparamNode("w.base", TensorType((2, 3), DType.f32), "dequantize", ("w.codes", "w.scales"),
                        {"value": "q8s", "block": (1, 3)})
    expect_verify_error(qlora_graph(wrong, lora()), r"reparam @w\.base: dequantize: operand 0 \(codes\) has dtype i4")


# -- interpreter -----------------------------------------------------------------------------------------------


def test_interpreter_evaluates_a_lora_over_a_dequantized_base() -> None:
    base = CODES.astype(np.float32) * SCALES
    values = Interpreter(qlora_graph())
    np.testing.assert_array_equal(values.symbol("w.base"), base)
    np.testing.assert_allclose(values.symbol("w"), base + 0.5 * (A @ B), rtol=1e-6)
