"""Op locations (issue 17, "Locations"): carried by every op, printed only on request, parsed back, never hashed,
kept by the rewrite driver and named in errors.

Each case quotes the issue's item: "Every op carries a location: the Python file:line (and module path ...) of
the call that traced it, or the ONNX node name it was imported from, or `file.kir:line:col` when parsed.
Printed optionally (`--print-locations`, like MLIR's `-mlir-print-debuginfo`), kept through every pass (a
rewritten op inherits or fuses its sources' locations), and named in every error a pass, the verifier, shape
inference, lowering or an executable raises".
"""

from __future__ import annotations

import numpy as np
import pytest

from kiln.ir import (
    DType,
    FileLoc,
    Function,
    FunctionBuilder,
    FusedLoc,
    IRParseError,
    NameLoc,
    Op,
    PassError,
    Rewriter,
    ShapeError,
    TensorType,
    Value,
    VerifyError,
    fuse,
    interpret,
    parse,
    print_graph,
    structural_hash,
    verify,
)
from kiln.passes import PassManager

TEXT = """module @m {
  param @w : tensor<3x3xf32> {id = "0x1", init = normal(std = 1.0), grad = true}
  func @forward(%x: tensor<2x3xf32>) -> (tensor<2x3xf32>) {
    %a = matmul %x, @w : tensor<2x3xf32>
    %b = matmul %x, @w : tensor<2x3xf32> loc("enc.layers.1.fc"("model.py":12))
    %c = add %a, %b : tensor<2x3xf32> loc(fused["x.kir":1:2, "Add_0"("Add"), "model.py":4])
    return %c
  }
}
"""


def test_parsed_ops_are_at_file_line_col():
    """ "or `file.kir:line:col` when parsed": an op without a written location is at its first result's position;
    a written `loc(...)` is read back as the location it prints."""
    fn = parse(TEXT, "m.kir").functions["forward"]
    a, b, c = fn.ops
    assert a.loc == FileLoc("m.kir", 4, 5)
    assert b.loc == NameLoc("enc.layers.1.fc", FileLoc("model.py", 12))
    assert c.loc == FusedLoc((FileLoc("x.kir", 1, 2), NameLoc("Add_0", NameLoc("Add")), FileLoc("model.py", 4)))


def test_locations_print_only_on_request_and_round_trip():
    """ "Printed optionally": without `locations=True` the text is the plain `.kir` (byte for byte what it was
    before locations existed); with it, every op has a `loc(...)` suffix that parses back to the same text."""
    graph = parse(TEXT, "m.kir")
    plain = print_graph(graph)
    assert "loc(" not in plain and plain == print_graph(parse(plain))
    shown = print_graph(graph, locations=True)
    assert shown.count(" loc(") == 3 and 'loc("m.kir":4:5)' in shown
    assert print_graph(parse(shown, "other.kir"), locations=True) == shown


def test_locations_never_enter_the_structural_hash():
    """Locations are metadata: moving ops to other lines changes no structural hash (and so no compile-cache key)."""
    moved = "\n\n" + TEXT.replace('loc("enc.layers.1.fc"("model.py":12))', "")
    assert structural_hash(parse(TEXT, "m.kir")) == structural_hash(parse(moved, "n.kir"))


@pytest.mark.parametrize("text", ['loc(fused[])', 'loc("a":x)', 'loc("a"("b")', 'loc(7)', 'loc("a":-1)'])
def test_malformed_locations_are_parse_errors(text: str):
    """Bad input is one `IRParseError` with `file:line:col` (the `.kir` contract), never a traceback."""
    bad = TEXT.replace('loc("enc.layers.1.fc"("model.py":12))', text)
    with pytest.raises(IRParseError, match=r"^m\.kir:[56]:\d+: expected"):
        parse(bad, "m.kir")


def test_fuse_flattens_and_drops_repeats():
    """ "fuses its sources' locations": a fused location lists each source once, in order, nested fusions flat."""
    a, b, c = FileLoc("a.py", 1), FileLoc("b.py", 2), NameLoc("n")
    assert fuse([]) is None and fuse([None, a, a]) == a
    assert fuse([a, FusedLoc((b, a)), None, c]) == FusedLoc((a, b, c))


def test_cse_fuses_merged_locations_and_leaves_the_input_graph_alone():
    """cse keeps one of two equal matmuls at the fusion of both locations; the input graph is a value, so its
    ops keep theirs; the result computes the same (interpreter before and after)."""
    graph = parse(TEXT, "m.kir")
    after = PassManager.parse("cse", verify_each=True).run(graph)
    (matmul, add) = after.functions["forward"].ops
    assert matmul.loc == FusedLoc((FileLoc("m.kir", 4, 5), NameLoc("enc.layers.1.fc", FileLoc("model.py", 12))))
    assert add.loc == graph.functions["forward"].ops[2].loc
    assert [op.loc for op in graph.functions["forward"].ops] == [op.loc for op in parse(TEXT, "m.kir")
                                                                  .functions["forward"].ops]
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert (interpret(graph, [x])[0] == interpret(after, [x])[0]).all()


def test_rule_emitted_ops_inherit_the_rewritten_ops_location():
    """ "a rewritten op inherits ... its sources' locations": what a rule emits in place of an op is at its
    location, with no location handling in the rule."""
    graph = parse(TEXT, "m.kir")
    fn = graph.functions["forward"]

    def add_as_sub_of_neg(rw: Rewriter, op: Op):
        if op.kind != "add":
            return None
        return (rw.emit("sub", op.operands[0], rw.emit("neg", op.operands[1])),)

    out = Rewriter.in_place(graph, fn, [add_as_sub_of_neg]).run(fn)
    assert [(op.kind, op.loc) for op in out.ops[2:]] == [("neg", fn.ops[2].loc), ("sub", fn.ops[2].loc)]


def test_verifier_error_names_the_kir_location():
    """ "named in every error ... the verifier ... raises": an op whose result type disagrees with inference (a
    broken pass's output) is reported at the `.kir` line it was parsed from."""
    graph = parse(TEXT, "m.kir")
    fn = graph.functions["forward"]
    a = fn.ops[0]
    broken = Op(a.kind, a.operands, a.attrs, (Value(TensorType((2, 4), a.results[0].type.dtype), "a"),), a.loc)
    bad = graph.with_function(Function(fn.name, fn.args, (broken,), broken.results))
    with pytest.raises(VerifyError, match=r"^m\.kir:4:5: @forward op #0 \(%a = matmul\): results are typed"):
        verify(bad)


def test_rewrite_rule_error_names_the_location():
    """ "named in every error a pass ... raises": a rule replacing an op by a value of another type is a
    `PassError` at the op's location."""
    graph = parse(TEXT, "m.kir")
    fn = graph.functions["forward"]

    def wrong(rw: Rewriter, op: Op):
        return (rw.emit("sum", op.operands[0]),) if op.kind == "add" else None

    with pytest.raises(PassError, match=r'^\[x\.kir:1:2, Add_0 \(Add\), model\.py:4\]: rule wrong replaced add'):
        Rewriter.in_place(graph, fn, [wrong]).run(fn)


def test_builder_shape_error_names_the_location():
    """ "named in every error ... shape inference ... raises": an op made at a location whose operands do not fit
    is a `ShapeError` prefixed by it."""
    fb = FunctionBuilder("f", lambda name: None)
    x = fb.input("x", TensorType((2, 3), DType.f32))
    with pytest.raises(ShapeError, match=r"^layers\.0\.fc \(model\.py:9\): "):
        fb.emit("matmul", x, x, loc=NameLoc("layers.0.fc", FileLoc("model.py", 9)))
