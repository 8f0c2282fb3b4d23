"""Pipelines from text, the PassManager's instrumentation, passes leaving their input alone, and `kiln opt`."""

from __future__ import annotations

import dataclasses
import io
import re
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from kiln.ir import (
    Builder,
    DType,
    Function,
    Graph,
    Init,
    Op,
    ParamGroupWarning,
    PassError,
    ShapeError,
    Value,
    VerifyError,
    interpret,
    parse,
    print_graph,
    rewrite,
    verify,
)
from kiln.passes import Pass, PassManager, get_pass, parse_pipeline, pass_names, pipeline_text, register_pass
from kiln.passes.equivalence import random_input

# ---------------------------------------------------------------------------------------------------------------
# Test-only passes, registered by `module:Class` path into this module
# ---------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class BreakTypes(Pass):
    """Deliberately broken: retypes the first op's result so that it no longer matches inference."""

    name = "test-break-types"

    def apply(self, graph: Graph) -> Graph:
        fn = graph.functions["forward"]
        first = fn.ops[0]
        wrong = Value(first.results[0].type.with_dtype(DType.f64), first.results[0].name)
        op = Op(first.kind, first.operands, first.attrs, (wrong,))
        return graph.with_function(Function(fn.name, fn.args, (op, *fn.ops[1:]),
                                            tuple(wrong if r is first.results[0] else r for r in fn.results)))


@dataclass(frozen=True)
class AddToSub(Pass):
    """Deliberately wrong: turns every add into a sub (well typed, so only equivalence checking notices)."""

    name = "test-add-to-sub"
    only: str = ""  # a function name: change only that one

    def apply(self, graph: Graph) -> Graph:
        def rule(rw, op):
            if op.kind != "add" or (self.only and rw.builder.name != self.only):
                return None
            return (rw.emit("sub", *op.operands),)
        return rewrite(graph, lambda: [rule])


@dataclass(frozen=True)
class AddToSubOnPurpose(AddToSub):
    """The same change, declared as changing behaviour (as module-state passes do): never equivalence-checked."""

    name = "test-add-to-sub-on-purpose"
    preserves_semantics = False


@dataclass(frozen=True)
class Explode(Pass):
    name = "test-explode"

    def apply(self, graph: Graph) -> Graph:
        raise ShapeError("boom")


@dataclass(frozen=True)
class DropFunctions(Pass):
    name = "test-drop-functions"

    def apply(self, graph: Graph) -> Graph:
        return graph.replace(functions={})


@dataclass(frozen=True)
class Typed(Pass):
    """Options of every kind the pipeline parser converts."""

    name = "test-typed"
    count: int = 1
    ratio: float = 0.5
    enabled: bool = False
    label: str = "x"
    paths: tuple[str, ...] = ()

    def apply(self, graph: Graph) -> Graph:
        return graph


TEST_PASSES = [BreakTypes, AddToSub, AddToSubOnPurpose, Explode, DropFunctions, Typed]
for _cls in TEST_PASSES:
    register_pass(_cls.name, f"{__name__}:{_cls.__name__}")


# ---------------------------------------------------------------------------------------------------------------
# Pipeline text
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("", []),
    ("   ", []),
    ("canonicalize", [get_pass("canonicalize")()]),
    ("canonicalize,cse,dce", [get_pass("canonicalize")(), get_pass("cse")(), get_pass("dce")()]),
    ("  cse,  dce  ", [get_pass("cse")(), get_pass("dce")()]),
    ("cse{},dce", [get_pass("cse")(), get_pass("dce")()]),
    ("fold-constants{max-elements=7}", [get_pass("fold-constants")(max_elements=7)]),
    ("fold-constants{max_elements=7}", [get_pass("fold-constants")(max_elements=7)]),
    ("fold-constants{ max-elements=-3 }", [get_pass("fold-constants")(max_elements=-3)]),
    ("test-typed{count=3 ratio=1e-3 enabled=true label=hello paths=a.*,b.**}",
     [Typed(count=3, ratio=0.001, enabled=True, label="hello", paths=("a.*", "b.**"))]),
    ('test-typed{label="two words"}', [Typed(label="two words")]),
    ('test-typed{label="{braces}, commas"}', [Typed(label="{braces}, commas")]),
    ('test-typed{label="say \\"hi\\""}', [Typed(label='say "hi"')]),
    ('test-typed{label=""}', [Typed(label="")]),
    ("test-typed{label=}", [Typed(label="")]),
    ("test-typed{paths=,}", [Typed(paths=())]),
    # a comma before the next `key=` separates options; inside a value it separates tuple items
    ("test-typed{count=3,paths=a.*,b.**,enabled=true}", [Typed(count=3, enabled=True, paths=("a.*", "b.**"))]),
    ("test-typed{label=x, count=2}", [Typed(label="x", count=2)]),
    ('to-device{device="cuda:1"},cse', [get_pass("to-device")(device="cuda:1"), get_pass("cse")()]),
])
def test_parse_pipeline(text: str, expected: list[Pass]) -> None:
    passes = parse_pipeline(text)
    assert passes == expected
    assert [type(p) for p in passes] == [type(p) for p in expected]
    assert parse_pipeline(pipeline_text(passes)) == passes  # the text form reads back


def test_option_types_are_converted() -> None:
    (p,) = parse_pipeline("test-typed{count=12 ratio=2 enabled=false}")
    assert (p.count, p.ratio, p.enabled) == (12, 2.0, False)
    assert type(p.count) is int and type(p.ratio) is float and type(p.enabled) is bool


def test_pipeline_text_writes_only_changed_options_and_quotes() -> None:
    assert pipeline_text(parse_pipeline("test-typed{count=1 label=x}")) == "test-typed"
    assert pipeline_text([Typed(count=2, label="a b")]) == 'test-typed{count=2 label="a b"}'
    assert pipeline_text([Typed(label='q"x')]) == 'test-typed{label="q\\"x"}'
    assert pipeline_text([Typed(paths=("a", "b"))]) == "test-typed{paths=a,b}"


PIPELINE_ERRORS = [
    ("canonicalize,nosuchpass", 14, "unknown pass 'nosuchpass' (known: "),
    ("  nosuchpass", 3, "unknown pass 'nosuchpass'"),
    ("cse{bogus=1}", 5, "pass 'cse' has no option 'bogus' (options: none)"),
    ("test-typed{count=1 colour=red}", 20, "pass 'test-typed' has no option 'colour' (options: count, ratio, enabled"),
    ("fold-constants{max-elements=lots}", 16, "pass 'fold-constants' option max-elements='lots': expected an integer"),
    ("fold-constants{max-elements=1.5}", 16, "expected an integer"),
    ("test-typed{ratio=fast}", 12, "option ratio='fast': expected a number"),
    ("cse,test-typed{enabled=yes}", 16, "option enabled='yes': expected true or false"),
    ("cse{", 4, "'{' is never closed"),
    ("cse,test-typed{label=x", 15, "'{' is never closed"),
    ('test-typed{label="x}', 11, "'{' is never closed"),
    ("cse,", 4, "'cse,' ends with ','"),
    ("cse,dce,  ", 8, "ends with ','"),
    ("cse,,dce", 5, "expected a pass name"),
    (",cse", 1, "expected a pass name"),
    ("cse dce", 4, "expected ',' after pass 'cse'"),
    ("cse{}x", 6, "expected ',' after pass 'cse'"),
    ("test-typed{=3}", 12, "expected key=value options"),
    ("test-typed{count}", 12, "expected key=value options"),
    ("test-typed{count=1 count=2}", 20, "option 'count' given twice"),
    ("9lives", 1, "expected a pass name"),
]


@pytest.mark.parametrize("text, column, message", PIPELINE_ERRORS, ids=[e[0] for e in PIPELINE_ERRORS])
def test_pipeline_errors_name_the_column(text: str, column: int, message: str) -> None:
    with pytest.raises(PassError) as info:
        parse_pipeline(text)
    assert str(info.value).startswith(f"pipeline column {column}: "), str(info.value)
    assert message in str(info.value)


# ---------------------------------------------------------------------------------------------------------------
# Graphs to run passes on
# ---------------------------------------------------------------------------------------------------------------

SIMPLE = """\
module @M {
  param @w : tensor<4x4xf32> {id = "0x10", data = dense<tensor<4x4xf32>, 0.25>, grad = true}
  flag @train = false {id = "0x2", configured = true}
  func @forward(%x: tensor<2x4xf32>) -> (tensor<2x4xf32>) {
    %one = constant {value = dense<tensor<f32>, 1.0>} : tensor<f32>
    %a = matmul %x, @w : tensor<2x4xf32>
    %b = matmul %x, @w : tensor<2x4xf32>
    %c = add %a, %b : tensor<2x4xf32>
    %d = mul %c, %one : tensor<2x4xf32>
    %e = dropout %d, @train {p = 0.5} : tensor<2x4xf32>
    %dead = exp %x : tensor<2x4xf32>
    return %e
  }
}
"""


def rich_graph() -> Graph:
    """Params (with init, data, lora), flags, two functions, and something for every program pass to do."""
    b = Builder("Rich")
    w = b.param("enc.0.weight", (4, 4), init=Init("normal", (("std", 0.5),)))
    b.param("enc.0.bias", (4,), data=np.arange(4, dtype=np.float32), grad=False, configured_grad=True)
    b.param("base", (4, 4), grad=False, init=Init("zeros"))
    b.param("lora_a", (4, 2), init=Init("normal"))
    b.param("lora_b", (2, 4), init=Init("normal"))
    adapted = b.reparam("adapted", "lora", "base", "lora_a", "lora_b", scale=0.5)
    train = b.flag("train", True, configured=True)
    b.flag("bn", False)
    x = b.input("x", ((None, 4), "f32"))
    h = b.add(b.matmul(x, w), b.sym("enc.0.bias"))
    h2 = b.add(b.matmul(x, w), b.sym("enc.0.bias"))  # a duplicate for cse
    two = b.add(b.constant(np.float32(1.0)), b.constant(np.float32(1.0)))  # foldable
    y = b.mul(b.relu(b.add(h, h2)), two)
    y = b.mul(y, 1.0)
    y = b.neg(b.neg(b.transpose(b.transpose(y))))
    y = b.matmul(b.dropout(y, train, p=0.1), adapted)
    b.exp(x)  # dead
    b.ret(y, b.sum(y, axes=[1]))
    b.begin("score")
    z = b.input("z", ((3,), "f32"))
    b.ret(b.mul(z, 2.0), b.sub(b.add(z, 0.5), b.constant(np.zeros(3, np.float32))))
    return verify(b.build())


def snapshot(graph: Graph) -> tuple:
    """Everything a pass could mutate in place: object identities, names, types, owners, attrs, nodes."""
    fns = []
    for fn in graph.functions.values():
        ops = [(id(op), op.kind, tuple(map(id, op.operands)), repr(op.attrs),
                tuple((id(r), r.name, r.type, id(r.owner)) for r in op.results)) for op in fn.ops]
        fns.append((fn.name, tuple((id(a), a.name, a.type, a.owner) for a in fn.args), tuple(ops),
                    tuple(map(id, fn.results))))
    nodes = [(repr(n), None if getattr(n, "data", None) is None else n.data.tobytes()) for n in graph.nodes()]
    return print_graph(graph), tuple(fns), tuple(nodes), tuple(graph.params), tuple(graph.functions)


@pytest.mark.parametrize("name", [n for n in pass_names() if not n.startswith("test-")])
def test_passes_never_mutate_their_input(name: str) -> None:
    for graph in (rich_graph(), parse(SIMPLE)):
        before = snapshot(graph)
        try:
            after = get_pass(name)().apply(graph)
        except PassError:  # a pass whose defaults select nothing may refuse; it still must not touch its input
            after = graph
        assert snapshot(graph) == before
        verify(graph)
        verify(after)


def test_a_pipeline_never_mutates_its_input() -> None:
    graph = rich_graph()
    before = snapshot(graph)
    out = PassManager.parse("canonicalize,fold-constants,cse,dce,canonicalize,dce", verify_each=True,
                            check_equivalence=True).run(graph)
    assert snapshot(graph) == before
    assert len(out.functions["forward"].ops) < len(graph.functions["forward"].ops)


# ---------------------------------------------------------------------------------------------------------------
# PassManager instrumentation
# ---------------------------------------------------------------------------------------------------------------

def run(pipeline: str, graph: Graph | None = None, **options) -> tuple[Graph, str, PassManager]:
    out = io.StringIO()
    manager = PassManager.parse(pipeline, out=out, **options)
    result = manager.run(graph if graph is not None else parse(SIMPLE))
    return result, out.getvalue(), manager


def dumps(text: str) -> list[str]:
    return re.findall(r"^// ----- IR dump (.*) ----- //$", text, re.M)


def test_no_instrumentation_writes_nothing() -> None:
    result, out, manager = run("canonicalize,cse,dce")
    assert out == ""
    assert [name for name, _ in manager.timings] == ["canonicalize", "cse", "dce"]


def test_print_before_all() -> None:
    graph = parse(SIMPLE)
    _, out, _ = run("cse,dce", graph, print_before_all=True)
    assert dumps(out) == ["Before cse", "Before dce"]
    first = out.split("// ----- IR dump Before dce ----- //")[0]
    assert print_graph(graph, elide_data=True) in first
    assert "data = elided" in out and "dense<tensor<4x4xf32>" not in out


def test_print_after_all() -> None:
    result, out, _ = run("canonicalize,cse,dce", print_after_all=True)
    assert dumps(out) == ["After canonicalize", "After cse", "After dce"]
    assert out.rstrip().endswith(print_graph(result, elide_data=True).rstrip())


def test_print_after_change_skips_passes_that_change_nothing() -> None:
    _, out, _ = run("dce,dce,cse,cse,fold-constants", print_after_change=True)
    assert dumps(out) == ["After dce", "After cse"]
    _, out, _ = run("test-typed{count=2}", print_after_change=True)
    assert out == ""


def test_print_options_combine() -> None:
    _, out, _ = run("cse,dce", print_before_all=True, print_after_all=True, timing=True)
    assert dumps(out) == ["Before cse", "After cse", "Before dce", "After dce"]
    assert out.index("pass timing") > out.index("IR dump After dce")


def test_timing_table_lists_each_pass() -> None:
    _, out, manager = run("canonicalize,cse,fold-constants{max-elements=8},dce", timing=True)
    lines = out.splitlines()
    assert lines[0] == "// ----- pass timing ----- //"
    labels = ["canonicalize", "cse", "fold-constants{max-elements=8}", "dce"]
    assert [line.split()[0] for line in lines[1:-1]] == labels
    for line in lines[1:-1]:
        assert re.fullmatch(r"\S+ +\d+\.\d{3} ms +\d+\.\d%", line), line
    assert re.fullmatch(r"total +\d+\.\d{3} ms", lines[-1])
    assert [name for name, _ in manager.timings] == labels
    assert all(t >= 0 for _, t in manager.timings)
    shares = [float(line.split()[-1].rstrip("%")) for line in lines[1:-1]]
    assert abs(sum(shares) - 100) < 1


def test_verify_each_catches_a_broken_pass() -> None:
    broken, _, _ = run("test-break-types")  # without verification the broken graph goes through
    with pytest.raises(VerifyError):
        verify(broken)
    with pytest.raises(VerifyError) as info:
        run("cse,test-break-types,dce", verify_each=True)
    message = str(info.value)
    assert message.startswith("after pass test-break-types: @forward op #0 (%one = constant)")
    assert "results are typed (tensor<f64>) but the op infers (tensor<f32>)" in message


def test_check_equivalence_names_the_wrong_pass_and_first_difference() -> None:
    graph = parse(SIMPLE)
    with pytest.raises(PassError) as info:
        run("canonicalize,test-add-to-sub,dce", graph, check_equivalence=True)
    message = str(info.value)
    assert message.startswith("pass test-add-to-sub changed behaviour: @forward result 0 at index [")
    # the same first difference, computed here: inputs drawn as the checker draws them, seed 0
    rng = np.random.default_rng(0)
    x = random_input(graph.functions["forward"].args[0].type, rng)
    canonical = PassManager.parse("canonicalize").run(graph)
    (want,) = interpret(canonical, [x], seed=0)
    (got,) = interpret(AddToSub().apply(canonical), [x], seed=0)
    index = tuple(int(i) for i in np.argwhere(~np.isclose(want, got, rtol=1e-4, atol=1e-5))[0])
    assert f"at index {list(index)}: {want[index]!r} before, {got[index]!r} after" in message


def test_check_equivalence_names_the_function_and_result() -> None:
    graph = rich_graph()
    with pytest.raises(PassError, match=r"^pass test-add-to-sub\{only=score\} changed behaviour: @score result 1 at "
                       r"index \[0\]: "):
        PassManager.parse("test-add-to-sub{only=score}", check_equivalence=True).run(graph)


def test_check_equivalence_accepts_correct_passes_and_skips_state_passes() -> None:
    run("canonicalize,fold-constants,cse,dce", rich_graph(), check_equivalence=True, verify_each=True)
    result, _, _ = run("test-add-to-sub-on-purpose", check_equivalence=True)
    assert "sub" in print_graph(result)
    with pytest.raises(PassError, match="removed function @forward"):
        run("test-drop-functions", check_equivalence=True)


def test_errors_inside_a_pass_name_it() -> None:
    with pytest.raises(ShapeError, match=r"^in pass test-explode: boom$"):
        run("cse,test-explode")


def test_pass_manager_from_pass_objects() -> None:
    out = io.StringIO()
    manager = PassManager([get_pass("cse")(), get_pass("dce")()], print_after_all=True, out=out)
    result = manager.run(parse(SIMPLE))
    assert "%b = matmul" not in print_graph(result) and "%dead" not in print_graph(result)
    assert dumps(out.getvalue()) == ["After cse", "After dce"]


# ---------------------------------------------------------------------------------------------------------------
# kiln opt
# ---------------------------------------------------------------------------------------------------------------

def kiln(*args: str, stdin: str | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kiln", *args], input=stdin, capture_output=True, text=True,
                          timeout=120, cwd=cwd)


def expected_output(pipeline: str) -> str:
    return print_graph(PassManager.parse(pipeline).run(parse(SIMPLE)))


def test_kiln_opt_reads_stdin() -> None:
    proc = kiln("opt", "-", "-p", "canonicalize,cse,dce", stdin=SIMPLE)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == expected_output("canonicalize,cse,dce")
    assert proc.stderr == ""


def test_kiln_opt_writes_the_output_file(tmp_path: Path) -> None:
    src, dst = tmp_path / "in.kir", tmp_path / "out.kir"
    src.write_text(SIMPLE)
    proc = kiln("opt", str(src), "-p", "cse,dce", "-o", str(dst), "--verify-each", "--timing")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""
    assert dst.read_text() == expected_output("cse,dce")
    assert "pass timing" in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.kir", "out.kir"]  # no temporary left behind


def test_kiln_opt_without_a_pipeline_prints_canonical_text() -> None:
    messy = SIMPLE.replace("  ", " ").replace('"0x10"', '"0x0010"')
    proc = kiln("opt", "-", stdin=messy)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == print_graph(parse(SIMPLE))


PARAMS = 'module @M {\n  param @enc.w : tensor<2xf32> {id = "0x1"}\n  flag @drop.training = true {id = "0x2"}\n}\n'


@pytest.mark.parametrize("args, stdin, code, message", [
    (["opt", "-"], "module @M {\n  func @f() -> () {\n    %y = neg %q : tensor<f32>\n", 1,
     "kiln opt: error: <stdin>:3:14: %q is used before it is defined at '%q'"),
    (["opt", "-", "-p", "cse,nosuchpass"], SIMPLE, 1, "kiln opt: error: pipeline column 5: unknown pass 'nosuchpass'"),
    (["opt", "-", "-p", "fold-constants{max-elements=x}"], SIMPLE, 1, "pipeline column 16: pass 'fold-constants'"),
    (["opt", "-"], "module @M {\n  param @w : tensor<?xf32> {id = \"0x1\"}\n}\n", 0, ""),
    (["opt", "-", "--verify-each", "-p", "cse"], "module @M {\n  param @w : tensor<?xf32> {id = \"0x1\"}\n}\n", 1,
     "kiln opt: error: after pass cse: param @w: parameters need a static type"),
    (["opt", "-", "-p", "freeze-group{group=x}"], PARAMS, 1, "kiln opt: error: pipeline column 14: pass "
     "'freeze-group' option group has no text form; use paths=… / exclude=…"),
    (["opt", "-", "--strict", "-p", "freeze-group{paths=nosuch.*}"], PARAMS, 1,
     "kiln opt: error: pass 'freeze-group': paths=nosuch.* matches no parameter or flag"),
    (["opt"], "", 2, "the following arguments are required: input"),
    (["opt", "-", "--no-such-flag"], "", 2, "unrecognized arguments: --no-such-flag"),
    (["frobnicate"], "", 2, "invalid choice: 'frobnicate'"),
    ([], "", 2, "the following arguments are required: command"),
])
def test_kiln_opt_exit_codes(args: list[str], stdin: str, code: int, message: str) -> None:
    proc = kiln(*args, stdin=stdin)
    assert proc.returncode == code, proc.stderr
    assert message in proc.stderr
    if code == 1:
        assert proc.stdout == "" and len(proc.stderr.strip().splitlines()) == 1  # one line, no traceback


def test_kiln_opt_file_errors_exit_3(tmp_path: Path) -> None:
    proc = kiln("opt", str(tmp_path / "missing.kir"))
    assert proc.returncode == 3
    assert proc.stderr.startswith("kiln opt: error: ") and "missing.kir" in proc.stderr
    src = tmp_path / "in.kir"
    src.write_text(SIMPLE)
    proc = kiln("opt", str(src), "-o", str(tmp_path / "no" / "such" / "dir" / "out.kir"))
    assert proc.returncode == 3
    assert proc.stderr.startswith("kiln opt: error: ")
    proc = kiln("opt", str(tmp_path))  # a directory, not a file
    assert proc.returncode == 3


def test_kiln_opt_error_in_a_file_names_it(tmp_path: Path) -> None:
    src = tmp_path / "bad.kir"
    src.write_text(SIMPLE.replace("%c = add %a, %b", "%c = add %a, %zz"))
    proc = kiln("opt", str(src), "-p", "cse")
    assert proc.returncode == 1
    assert proc.stderr == f"kiln opt: error: {src}:8:18: %zz is used before it is defined at '%zz'\n"



def test_kiln_opt_non_utf8_file_is_bad_input(tmp_path: Path) -> None:
    src = tmp_path / "latin1.kir"
    src.write_bytes(b"module @M {\n  // caf\xe9\n}\n")
    proc = kiln("opt", str(src))
    assert proc.returncode == 1
    assert proc.stderr == f"kiln opt: error: {src}:2:9: not UTF-8 text (invalid continuation byte) at '0xe9'\n"


# ---------------------------------------------------------------------------------------------------------------
# group options: no text form for Python objects; a selection matching nothing warns, or fails when strict
# ---------------------------------------------------------------------------------------------------------------

def test_options_without_a_text_form_are_refused_when_parsed() -> None:
    """Only the Python-object `group` options lack a text form, and each names the text options to use."""
    refused = set()
    for name in pass_names():
        for field in dataclasses.fields(get_pass(name)):
            try:
                get_pass(name).option(field.name, "x")
            except PassError as e:
                if "no text form" in str(e):
                    assert str(e) == f"pass {name!r} option {field.name} has no text form; use paths=… / exclude=…"
                    refused.add((name, field.name))
    assert refused == {(n, "group") for n in ("freeze-group", "unfreeze-group", "set-require-grad-group",
                                               "reparameterize", "quantize-weights")}


def test_a_group_term_matching_nothing_warns_naming_the_pass_and_term() -> None:
    graph = parse(PARAMS)
    with pytest.warns(ParamGroupWarning) as caught:
        out = PassManager.parse("freeze-group{paths=enc.*,nosuch.*}").run(graph)
    assert [str(w.message) for w in caught] == ["pass 'freeze-group': paths=nosuch.* matches no parameter or flag"]
    assert not out.params["enc.w"].configured_grad  # the terms that match still apply
    with warnings.catch_warnings():
        warnings.simplefilter("error", ParamGroupWarning)
        PassManager.parse("unfreeze-group{paths=drop.*},set-require-grad-group{paths=id:0x1}").run(graph)


def test_a_term_whose_matches_are_all_excluded_warns() -> None:
    with pytest.warns(ParamGroupWarning, match=r"pass 'unfreeze-group': paths=enc\.\* matches no parameter"):
        PassManager.parse("unfreeze-group{paths=enc.* exclude=*.w}").run(parse(PARAMS))


def test_strict_pass_manager_makes_an_unmatched_group_an_error() -> None:
    manager = PassManager.parse("cse,set-require-grad-group{paths=nosuch value=false}", strict=True)
    with pytest.raises(PassError, match=r"^pass 'set-require-grad-group': paths=nosuch matches no parameter or flag$"):
        manager.run(parse(PARAMS))


def test_kiln_opt_warns_on_one_line_and_succeeds() -> None:
    proc = kiln("opt", "-", "-p", "freeze-group{paths=nosuch.*}", stdin=PARAMS)
    assert proc.returncode == 0
    assert proc.stderr == "kiln opt: warning: pass 'freeze-group': paths=nosuch.* matches no parameter or flag\n"
    assert proc.stdout == print_graph(parse(PARAMS))


@pytest.mark.parametrize("name", ["to-device", "fork"])
def test_device_passes_apply_the_device_rule(name: str) -> None:
    """issue 15: `to-device{device=tpu}` was accepted while Device("tpu") is refused; one rule (kiln.ir.devices,
    which Device applies too) now decides, and `cuda` is `cuda:0`."""
    with pytest.raises(PassError, match=f"pass '{name}': unknown device 'tpu'"):
        PassManager.parse(f"{name}{{device=tpu}}")
    (moved,) = PassManager.parse(f"{name}{{device=cuda}}").passes
    assert moved.device == "cuda:0"


def test_passes_run_with_the_cyclic_collector_paused_and_restore_it() -> None:
    """issue 15: passes slowed per op as graphs grew (full collections walking every op); the manager pauses the
    collector around each pass, as the parser and the rewriter do, and leaves it as it found it."""
    import gc

    seen: list[bool] = []

    class Probe(Pass):
        name = "test-probe-gc"

        def apply(self, graph: Graph) -> Graph:
            seen.append(gc.isenabled())
            return graph

    b = Builder("M")
    b.ret(b.input("x", ((2,), "f32")))
    assert gc.isenabled()
    PassManager([Probe(), Probe()]).run(b.build())
    assert seen == [False, False] and gc.isenabled()
