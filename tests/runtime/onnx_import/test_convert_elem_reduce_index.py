"""ONNX import of the elementwise, reduction and indexing families (convert_elementwise, convert_reduce,
convert_index): one-node models made with onnx.helper, imported and interpreted by kiln, against
onnx.reference.ReferenceEvaluator (the ONNX spec's own implementation) on the same inputs.

An input given as `Const(array)` is an initializer (a compile-time value: axes, k, repeats...), a plain array a
graph input, None an omitted optional input.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from kiln.ir import interpret
from kiln.runtime.onnx.importer.driver import UnsupportedModel, import_graph

RNG = np.random.default_rng(12)


@dataclass(frozen=True)
class Const:
    value: np.ndarray


@dataclass
class Case:
    name: str
    op: str
    opset: int
    inputs: Sequence[np.ndarray | Const | None]
    attrs: dict[str, Any] = field(default_factory=dict)
    outputs: int = 1
    tol: float = 1e-5
    oracle: tuple[str, int] | None = None  # (op, opset) the reference runs instead, for ops it lacks


def model(c: Case) -> tuple[onnx.ModelProto, list[np.ndarray]]:
    """The one-node model and its run-time feeds."""
    names, graph_inputs, inits, feeds = [], [], [], []
    for i, x in enumerate(c.inputs):
        if x is None:
            names.append("")
            continue
        name = f"in{i}"
        names.append(name)
        if isinstance(x, Const):
            inits.append(numpy_helper.from_array(np.asarray(x.value), name))
        else:
            elem = helper.np_dtype_to_tensor_dtype(x.dtype)
            graph_inputs.append(helper.make_tensor_value_info(name, elem, x.shape))
            feeds.append(x)
    outs = [f"out{j}" for j in range(c.outputs)]
    node = helper.make_node(c.op, names, outs, name=c.name, **c.attrs)
    graph = helper.make_graph([node], "g", graph_inputs,
                              [helper.make_tensor_value_info(o, TensorProto.UNDEFINED, None) for o in outs], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", c.opset)]), feeds


def f32(*shape: int, lo: float = -3.0, hi: float = 3.0) -> np.ndarray:
    return RNG.uniform(lo, hi, shape).astype(np.float32)


def i64(*values: int) -> Const:
    return Const(np.array(values, np.int64))


X = f32(3, 4)
X3 = f32(2, 3, 4)
POS = f32(2, 3, 4, lo=0.5, hi=1.5)
HALVES = np.array([-2.5, -1.5, -0.5, -0.0, 0.5, 1.5, 2.5, 2.6, -3.7, np.inf, -np.inf], np.float32)
B1, B2 = RNG.random((3, 4)) < 0.5, RNG.random((4,)) < 0.5
INTS = np.array([[7, -7, 7, -7, 0, 5], [3, 3, -3, -3, 4, -2]], np.int64)
DIVS = np.array([[2, 2, -2, -2, 3, 5], [3, -2, 5, 3, -4, -2]], np.int64)

CASES = [
    # elementwise: rounding and logic
    Case("floor", "Floor", 13, [HALVES]),
    Case("ceil", "Ceil", 13, [HALVES]),
    Case("round", "Round", 11, [HALVES]),  # "rounds halves to the nearest even integer"
    Case("sign", "Sign", 13, [np.array([-2.0, 0.0, -0.0, 3.5], np.float32)]),
    Case("sign-i64", "Sign", 13, [INTS]),
    Case("not", "Not", 7, [B1]),
    Case("and", "And", 7, [B1, B2]),
    Case("or", "Or", 7, [B1, B2]),
    Case("xor", "Xor", 7, [B1, B2]),
    # Clip: attributes before opset 11, optional inputs after
    Case("clip-7-attrs", "Clip", 7, [X], {"min": -1.0, "max": 0.5}),
    Case("clip-7-max-only", "Clip", 7, [X], {"max": 0.5}),
    Case("clip-13-inputs", "Clip", 13, [X, Const(np.float32(-1.0)), Const(np.float32(2.0))]),
    Case("clip-13-min-omitted", "Clip", 13, [X, None, Const(np.float32(0.25))]),
    Case("clip-13-runtime-min", "Clip", 13, [X, np.array(-0.5, np.float32)]),
    Case("clip-13-i64", "Clip", 13, [INTS, Const(np.int64(-3)), Const(np.int64(4))]),
    Case("clip-13-unbounded", "Clip", 13, [X]),
    # activations
    Case("hard-sigmoid", "HardSigmoid", 7, [X], {"alpha": 0.3, "beta": 0.4}),
    Case("hard-sigmoid-default", "HardSigmoid", 7, [X]),
    Case("hard-swish", "HardSwish", 14, [f32(3, 4, lo=-5, hi=5)]),
    Case("softplus", "Softplus", 7, [np.array([-100.0, -20.0, -1.0, 0.0, 1.0, 20.0, 100.0], np.float32)]),
    Case("softsign", "Softsign", 7, [X]),
    Case("elu", "Elu", 7, [X], {"alpha": 0.7}),
    Case("selu", "Selu", 7, [X]),
    Case("selu-attrs", "Selu", 7, [X], {"alpha": 1.5, "gamma": 2.0}),
    Case("celu", "Celu", 12, [X], {"alpha": 2.0}),
    Case("mish", "Mish", 18, [np.array([-30.0, -2.0, -0.5, 0.0, 0.5, 3.0, 30.0], np.float32)]),
    Case("prelu-channel", "PRelu", 16, [f32(2, 3, 4, 4), Const(f32(3, 1, 1))]),
    Case("prelu-scalar-slope", "PRelu", 9, [X, np.array([0.25], np.float32)]),
    # Mod: fmod = 0 takes the divisor's sign, fmod = 1 the dividend's
    Case("mod", "Mod", 13, [INTS, DIVS]),
    Case("mod-fmod", "Mod", 13, [INTS, DIVS], {"fmod": 1}),
    # reductions: axes as an attribute (ReduceSum until 12, the others until 17), then as an input
    Case("sum-11-attr", "ReduceSum", 11, [X3], {"axes": [0, 2], "keepdims": 0}),
    Case("sum-13-input", "ReduceSum", 13, [X3, i64(-1)]),
    Case("sum-13-all", "ReduceSum", 13, [X3], {"keepdims": 0}),
    Case("sum-13-noop", "ReduceSum", 13, [X3, Const(np.zeros(0, np.int64))], {"noop_with_empty_axes": 1}),
    Case("sum-13-i64", "ReduceSum", 13, [INTS, i64(1)]),
    Case("mean-13-attr", "ReduceMean", 13, [X3], {"axes": [1]}),
    Case("mean-18-input", "ReduceMean", 18, [X3, i64(0, 1)], {"keepdims": 0}),
    Case("max-18", "ReduceMax", 18, [X3, i64(2)]),
    Case("min-13-i64", "ReduceMin", 13, [INTS], {"axes": [0]}),
    Case("prod-13", "ReduceProd", 13, [POS], {"axes": [1, 2]}),
    Case("prod-18-all", "ReduceProd", 18, [POS], {"keepdims": 0}),
    Case("l1-13", "ReduceL1", 13, [X3], {"axes": [2]}),
    Case("l2-18", "ReduceL2", 18, [X3, i64(0, 2)], {"keepdims": 0}),
    Case("sum-square-13", "ReduceSumSquare", 13, [X3], {"axes": [1]}),
    Case("log-sum-exp-18", "ReduceLogSumExp", 18, [X3 * 30, i64(1)]),
    Case("log-sum-exp-13-all", "ReduceLogSumExp", 13, [X3], {"keepdims": 0}),
    Case("l2-18-noop", "ReduceL2", 18, [X3], {"noop_with_empty_axes": 1}),
    Case("log-sum-18", "ReduceLogSum", 18, [POS, i64(0, 2)]),
    Case("log-sum-13-attr", "ReduceLogSum", 13, [POS], {"axes": [1], "keepdims": 0}),
    Case("max-20-bool", "ReduceMax", 20, [B1, i64(1)]),  # bool since opset 20: max is any, min is all
    Case("min-20-bool", "ReduceMin", 20, [B1], {"keepdims": 0}),
    # over no element: "reduction over an empty set of values yields ... minus infinity (ReduceMax) ... plus
    # infinity (ReduceMin)", false / true for bool; log(0) = -inf for ReduceLogSum
    Case("max-18-empty", "ReduceMax", 18, [np.zeros((2, 0, 3), np.float32), i64(1)]),
    Case("min-18-empty-all", "ReduceMin", 18, [np.zeros((0, 3), np.float32)], {"keepdims": 0}),
    Case("max-20-empty-bool", "ReduceMax", 20, [np.zeros((2, 0), np.bool_), i64(1)]),
    Case("min-18-empty-i64", "ReduceMin", 18, [np.zeros((0, 3), np.int64), i64(0)]),
    Case("log-sum-exp-18-empty", "ReduceLogSumExp", 18, [np.zeros((2, 0, 3), np.float32), i64(1)]),
    Case("log-sum-18-empty", "ReduceLogSum", 18, [np.zeros((2, 0, 3), np.float32), i64(1)]),
    # along one axis
    Case("argmax", "ArgMax", 13, [X3], {"axis": 1}),
    Case("argmin-flat", "ArgMin", 13, [X3], {"axis": -1, "keepdims": 0}),
    Case("argmax-last", "ArgMax", 13, [np.array([[1, 3, 3], [2, 2, 0]], np.int64)], {"axis": 1,
                                                                                      "select_last_index": 1}),
    Case("topk-7-attr", "TopK", 7, [X], {"k": 2}, outputs=2),
    Case("topk-11", "TopK", 11, [X3, i64(2)], {"axis": 1}, outputs=2),
    Case("topk-11-smallest", "TopK", 11, [X, i64(3)], {"largest": 0}, outputs=2),
    Case("topk-11-ties", "TopK", 11, [np.array([[3, 1, 3, 1, 2]], np.int64), i64(4)], outputs=2),
    Case("cumsum", "CumSum", 14, [X3, Const(np.int64(1))]),
    Case("cumsum-exclusive-reverse", "CumSum", 14, [INTS, Const(np.int32(-1))], {"exclusive": 1, "reverse": 1}),
    # indexing
    Case("tile", "Tile", 13, [X, i64(2, 3)]),
    Case("tile-i64", "Tile", 13, [INTS, i64(1, 2)]),
    Case("scatter-nd-rows", "ScatterND", 16, [f32(5, 3), Const(np.array([[4], [0]], np.int64)), f32(2, 3)]),
    Case("scatter-nd-elements", "ScatterND", 11, [INTS, Const(np.array([[0, 1], [1, 5]], np.int64)),
                                                   np.array([9, 8], np.int64)]),
    # ScatterND-18 reduction: "output[indices[idx]] = f(output[indices[idx]], updates[idx])", repeated indices
    # combining in order; ScatterElements: "output[i][indices[i][j]][k] = updates[i][j][k]" for axis 1.
    *(Case(f"scatter-nd-{r}-repeated", "ScatterND", 18, [f32(4, 3), Const(np.array([[1], [-3], [3], [1]], np.int64)),
                                                          f32(4, 3)], {"reduction": r})
      for r in ("add", "mul", "max", "min")),
    Case("scatter-elements-axis1-negative", "ScatterElements", 11, [f32(2, 3, 4),
                                                                   Const(np.array([[[0, -1], [2, 1]]], np.int64)),
                                                                   f32(1, 2, 2)], {"axis": 1}),
    Case("scatter-elements-add-duplicates", "ScatterElements", 18, [INTS, Const(np.array([[1, 1], [0, 2]], np.int32)),
                                                                    np.array([[4, 5], [6, 7]], INTS.dtype)],
         {"axis": 1, "reduction": "add"}),
    # Scatter-9: "deprecated. Please use ScatterElements, which provides the same functionality"
    Case("scatter-9", "Scatter", 9, [f32(3, 3), Const(np.array([[1, 0, 2]], np.int64)), f32(1, 3)],
         oracle=("ScatterElements", 11)),
    # Trilu: "returns the upper or lower triangular part of a 2-D matrix, or batches of 2-D matrices ... A
    # positive k value includes as many diagonals above the main diagonal", "a negative k value excludes"
    Case("triu", "Trilu", 14, [f32(4, 5)]),
    Case("triu-k-positive-batched", "Trilu", 14, [f32(2, 3, 4), Const(np.array(1, np.int64))]),
    Case("triu-k-past-the-matrix", "Trilu", 14, [f32(3, 4), Const(np.array(6, np.int64))]),
    Case("tril-k-negative", "Trilu", 14, [f32(5, 3), Const(np.array(-1, np.int64))], {"upper": 0}),
    Case("tril-bool", "Trilu", 14, [f32(4, 4) > 0], {"upper": 0}),
    # Einsum: the batched-matmul forms of attention and bilinear layers
    Case("einsum-attention", "Einsum", 12, [f32(2, 3, 4, 5), f32(2, 3, 6, 5)], {"equation": "bhid,bhjd->bhij"}),
    Case("einsum-attention-values", "Einsum", 12, [f32(2, 3, 4, 6), f32(2, 3, 6, 5)],
         {"equation": "bhij,bhjd->bhid"}),
    Case("einsum-bmm", "Einsum", 12, [f32(2, 3, 4), f32(2, 4, 5)], {"equation": "bij,bjk->bik"}),
    Case("einsum-bilinear", "Einsum", 12, [f32(4, 3), f32(2, 3, 5), f32(4, 5)], {"equation": "bn,anm,bm->ba"}),
    Case("einsum-outer-implicit", "Einsum", 12, [f32(3), f32(4)], {"equation": "i,j"}),
    Case("einsum-transpose-sum", "Einsum", 12, [f32(2, 3, 4)], {"equation": "ijk->ki"}),
    Case("einsum-matvec", "Einsum", 12, [f32(3, 4), f32(4)], {"equation": "ij, j -> i"}),
    # Einsum in general: "a repeated label in one operand takes the diagonal", "an ellipsis ... broadcast
    # dimensions", implicit output "in increasing alphabetical order" after the ellipsis dims
    Case("einsum-diagonal", "Einsum", 12, [f32(3, 3)], {"equation": "ii->i"}),
    Case("einsum-trace-implicit", "Einsum", 12, [f32(4, 4)], {"equation": "ii"}),
    Case("einsum-batch-diagonal-ellipsis", "Einsum", 12, [f32(2, 3, 4, 4)], {"equation": "...ii->...i"}),
    Case("einsum-triple-diagonal", "Einsum", 12, [f32(3, 2, 3, 3)], {"equation": "ijii->ij"}),
    Case("einsum-ellipsis-matmul-ranks", "Einsum", 12, [f32(2, 3, 4, 5), f32(3, 5, 6)],
         {"equation": "...ij,...jk->...ik"}),
    Case("einsum-ellipsis-implicit", "Einsum", 12, [f32(2, 3, 4), f32(4, 5)], {"equation": "...j,jk"}),
    Case("einsum-inner", "Einsum", 12, [f32(5), f32(5)], {"equation": "i,i"}),
    Case("einsum-sum-all", "Einsum", 12, [f32(3, 4)], {"equation": "ij->"}),
    Case("einsum-outer", "Einsum", 12, [f32(3), f32(2, 4)], {"equation": "i,jk->kij"}),
    Case("einsum-diagonal-contract", "Einsum", 12, [f32(2, 3, 3), f32(2, 3, 4)], {"equation": "bii,bij->bj"}),
    Case("einsum-merged-dims", "Einsum", 12, [f32(2, 3, 4, 5), f32(4, 5, 6)], {"equation": "abcd,cde->abe"}),
    # "the ellipsis dims ... broadcast" (numpy's rules, 1 against n): as batch dims, summed, implicit, across
    # ellipsis widths and over three operands
    Case("einsum-ellipsis-broadcast-batch", "Einsum", 12, [f32(2, 1, 3, 4), f32(1, 3, 4, 5)],
         {"equation": "...ij,...jk->...ik"}),
    Case("einsum-ellipsis-broadcast-summed", "Einsum", 12, [f32(2, 1, 3, 4), f32(1, 3, 4, 5)],
         {"equation": "...ij,...jk->ik"}),
    Case("einsum-ellipsis-broadcast-implicit", "Einsum", 12, [f32(3, 1, 4), f32(2, 4)], {"equation": "...j,...j"}),
    Case("einsum-ellipsis-broadcast-widths", "Einsum", 12, [f32(5, 1, 3, 4), f32(2, 4, 6)],
         {"equation": "...ij,...jk->...ik"}),
    Case("einsum-ellipsis-broadcast-three", "Einsum", 12, [f32(2, 1, 4), f32(1, 3, 4), f32(4)],
         {"equation": "...i,...i,...i->..."}),
]


@pytest.mark.parametrize("c", CASES, ids=lambda c: c.name)
def test_import_matches_the_onnx_reference(c: Case) -> None:
    onnx_model, feeds = model(c)
    reference = onnx_model if c.oracle is None else model(replace(c, op=c.oracle[0], opset=c.oracle[1]))[0]
    want = ReferenceEvaluator(reference).run(None, {f"in{i}": x for i, x in enumerate(c.inputs)
                                                      if isinstance(x, np.ndarray)})
    got = interpret(import_graph(onnx_model), feeds)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        w = np.asarray(w)
        assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, g.dtype, w.shape, w.dtype)
        np.testing.assert_allclose(g, w, rtol=c.tol, atol=c.tol)


def test_every_converter_of_these_families_has_a_case() -> None:
    from kiln.runtime.onnx.importer import convert_elementwise, convert_index, convert_reduce  # noqa: F401
    from kiln.runtime.onnx.importer.registry import converters

    mine = {c.op_type for c in converters() if c.fn.__module__.rsplit(".", 1)[-1] in
            ("convert_elementwise", "convert_reduce", "convert_index")}
    assert mine - {c.op for c in CASES} == set()


@pytest.mark.parametrize(("op", "opset", "inputs", "attrs", "match"), [
    ("Einsum", 12, [f32(3, 3), f32(1, 3)], {"equation": "ij,ij->i"}, r"'i' is 3 in one operand and 1 in another"),
    ("Einsum", 12, [f32(3, 4)], {"equation": "ij->ii"}, r"the output 'ii' names each letter at most once"),
    ("Einsum", 12, [f32(3, 4)], {"equation": "ijk->i"}, r"subscripts 'ijk' do not match the rank"),
    ("ScatterND", 16, [f32(4), Const(np.array([[1]], np.int64)), f32(1)], {"reduction": "sub"},
     r"reduction = 'sub'"),
    ("TopK", 11, [X, np.array([2], np.int64)], {}, r"k \(input 1\) is computed at run time"),
    ("Mod", 13, [X, X], {"fmod": 1}, r"Mod of f32 tensors"),
    ("Trilu", 14, [f32(3, 3), np.array(1, np.int64)], {}, r"k \(input 1\) is computed at run time"),
    ("Trilu", 14, [f32(3)], {}, r"Trilu of tensor<3xf32>: it needs rank 2 or more"),
    ("ReduceSum", 13, [X3, np.array([1], np.int64)], {}, r"the axes \(input 1\) is computed at run time"),
])
def test_unsupported_forms_name_the_node_and_the_reason(op: str, opset: int, inputs: list, attrs: dict,
                                                        match: str) -> None:
    onnx_model, _ = model(Case("bad_node", op, opset, inputs, attrs))
    with pytest.raises(UnsupportedModel, match=r"bad_node \(" + op + r", opset \d+\): " + ".*" + match):
        import_graph(onnx_model)


@pytest.mark.parametrize(("equation", "shapes"), [
    ("bhid,bhjd->bhij", [(2, 4, 5), (2, 6, 5)]),
    ("bn,anm,bm->ba", [(3,), (2, 3, 4), (4,)]),
])
def test_einsum_keeps_a_dynamic_batch(equation: str, shapes: list[tuple[int, ...]]) -> None:
    """A `dim_param` batch (the leading dim of every operand) stays one dynamic dim through the reshapes."""
    names = [f"in{i}" for i in range(len(shapes))]
    batched = [i for i, term in enumerate(equation.split("->")[0].split(",")) if term[0] == "b"]
    infos = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", *s] if i in batched else list(s))
             for i, (n, s) in enumerate(zip(names, shapes))]
    node = helper.make_node("Einsum", names, ["out"], equation=equation)
    graph = helper.make_graph([node], "g", infos, [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)])
    onnx_model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 12)])
    kiln_graph = import_graph(onnx_model)
    assert kiln_graph.functions["forward"].results[0].type.shape[0] is None
    for n in (1, 3):
        feeds = [f32(n, *s) if i in batched else f32(*s) for i, s in enumerate(shapes)]
        (want,) = ReferenceEvaluator(onnx_model).run(None, dict(zip(names, feeds)))
        (got,) = interpret(kiln_graph, feeds)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_einsum_broadcasts_an_ellipsis_dim_against_a_dynamic_batch() -> None:
    """An ellipsis dim of 1 broadcasts against a `dim_param` batch (and a 1 against 5 in the next dim): the result
    keeps the batch dynamic, and matches the ONNX reference at two batch sizes."""
    infos = [helper.make_tensor_value_info("in0", TensorProto.FLOAT, ["batch", 1, 3, 4]),
             helper.make_tensor_value_info("in1", TensorProto.FLOAT, [1, 5, 4, 2])]
    node = helper.make_node("Einsum", ["in0", "in1"], ["out"], equation="...ij,...jk->...ik")
    graph = helper.make_graph([node], "g", infos, [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)])
    onnx_model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 12)])
    kiln_graph = import_graph(onnx_model)
    assert kiln_graph.functions["forward"].results[0].type.shape == (None, 5, 3, 2)
    for n in (1, 3):
        feeds = [f32(n, 1, 3, 4), f32(1, 5, 4, 2)]
        (want,) = ReferenceEvaluator(onnx_model).run(None, dict(zip(["in0", "in1"], feeds)))
        (got,) = interpret(kiln_graph, feeds)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
