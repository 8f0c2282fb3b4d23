"""Pass debugging (issue 17): the instruments as PassManager.run options, pass statistics from Python, crash
reproducers (a planted crashing pass) and `--bisect` (a planted miscompiling pass), both registered here only."""

from __future__ import annotations

import io
import re
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from same_output import expected, inputs

from kiln.cli import EXIT_CRASH, EXIT_INPUT, EXIT_OK, main
from kiln.ir import Graph, Op, Operand, PassError, Rewriter, interpret, parse, parse_file, rewrite
from kiln.passes import Pass, PassCrash, PassManager, register_pass

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Crash(Pass):
    """Planted bug: divides by zero on any function holding an exp."""

    name = "test-crash"

    def apply(self, graph: Graph) -> Graph:
        if any(op.kind == "exp" for fn in graph.functions.values() for op in fn.ops):
            return graph if 1 / 0 else graph
        return graph


@dataclass(frozen=True)
class BadInput(Pass):
    """Reports a kiln input error, which is not a crash."""

    name = "test-bad-input"

    def apply(self, graph: Graph) -> Graph:
        raise PassError("this input is refused")


class _Swap:
    """Swaps the two operands of add, mul and sub: right for the commutative two, a miscompile for sub."""

    def __init__(self) -> None:
        self.emitting = False

    def __call__(self, rw: Rewriter, op: Op) -> Sequence[Operand] | None:
        if self.emitting or op.kind not in ("add", "mul", "sub"):
            return None
        self.emitting = True
        try:
            return (rw.emit(op.kind, op.operands[1], op.operands[0]),)
        finally:
            self.emitting = False


@dataclass(frozen=True)
class SwapOperands(Pass):
    """Planted miscompile: a rewrite pass swapping the operands of add, mul and sub."""

    name = "test-swap-operands"

    def apply(self, graph: Graph) -> Graph:
        return rewrite(graph, lambda: [_Swap()])


for _cls in (Crash, BadInput, SwapOperands):
    register_pass(_cls.name, f"{__name__}:{_cls.__name__}")

MODULE = """module @M {
  func @forward(%x: tensor<4xf32>, %y: tensor<4xf32>) -> (tensor<4xf32>) {
    %one = constant {value = dense<tensor<f32>, 1.0>} : tensor<f32>
    %s = add %x, %y : tensor<4xf32>
    %p = mul %s, %x : tensor<4xf32>
    %q = mul %p, %one : tensor<4xf32>
    %a = sub %x, %y : tensor<4xf32>
    %b = sub %y, %x : tensor<4xf32>
    %e = exp %a : tensor<4xf32>
    %m = mul %e, %b : tensor<4xf32>
    %t = add %m, %a : tensor<4xf32>
    %r = add %t, %q : tensor<4xf32>
    return %r
  }
}
"""


def test_run_takes_the_instruments_as_options_and_keeps_the_statistics() -> None:
    """Issue 17: "the same instruments on `PassManager` (`pm.run(graph, print_after_change="diff",
    statistics=True, bisect_limit=...)`)", the statistics "available from Python on the PassManager result"."""
    out = io.StringIO()
    pm = PassManager.parse("canonicalize,cse,dce", out=out)
    result = pm.run(parse(MODULE), print_after_change="diff", statistics=True, bisect_limit=2)
    text = out.getvalue()
    assert "// ----- IR diff After canonicalize ----- //\n--- before canonicalize\n+++ after canonicalize" in text
    assert "-    %q = mul %p, %one : tensor<4xf32>" in text
    assert "pass statistics" in text and "skipped (3) pass cse\nskipped (4) pass dce\n" in text
    assert [(s.label, s.counters) for s in pm.pass_statistics] == [
        ("canonicalize", {"rewrote-mul": 1, "ops-removed": 1})]
    assert pm.applied == ["(1) pass canonicalize"] and pm.events == 4
    assert not pm.print_after_change and pm.bisect_limit is None  # the options held for that run only
    assert len(result.functions["forward"].ops) == 9
    with pytest.raises(PassError, match="PassManager.run has no option 'print_after_changes'"):
        pm.run(parse(MODULE), print_after_changes=True)


def test_a_crashing_pass_leaves_a_reproducer_that_crashes_the_same_way(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture) -> None:
    """Issue 17: "when a pass raises anything but a kiln input error, `kiln opt` ... writes the IR before the
    failing pass and the pipeline that reproduces it as one `.kir` file with a `// RUN:` line, and says where"."""
    src = tmp_path / "in.kir"
    src.write_text(MODULE)
    assert main(["opt", str(src), "-p", "canonicalize,test-crash", "--reproducer-dir", str(tmp_path / "r")]) \
        == EXIT_CRASH
    err = capsys.readouterr().err.strip()
    m = re.fullmatch(r"kiln opt: error: (pass test-crash crashed: ZeroDivisionError: division by zero); "
                     r"reproducer written to (\S+)", err)
    assert m, err
    reproducer = Path(m.group(2))
    assert reproducer.parent == tmp_path / "r"
    text = reproducer.read_text()
    (run,) = re.findall(r"^// RUN: (.*)$", text, re.M)
    assert run == "kiln opt %s -p test-crash"
    assert "%q" not in parse_file(str(reproducer)).functions["forward"].ops.__repr__()  # after canonicalize
    argv = [str(reproducer) if a == "%s" else a for a in shlex.split(run)][1:]
    assert main([*argv, "--reproducer-dir", str(tmp_path / "again")]) == EXIT_CRASH
    assert m.group(1) in capsys.readouterr().err


def test_a_kiln_input_error_is_not_a_crash(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    src = tmp_path / "in.kir"
    src.write_text(MODULE)
    assert main(["opt", str(src), "-p", "test-bad-input", "--reproducer-dir", str(tmp_path)]) == EXIT_INPUT
    assert capsys.readouterr().err.strip() == "kiln opt: error: in pass test-bad-input: this input is refused"
    assert list(tmp_path.glob("kiln-crash-*")) == []


def test_kiln_compile_leaves_a_reproducer_when_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 17: "`kiln.compile` from Python, on request via `KILN_REPRODUCER_DIR`"; the pass it runs is made to
    crash here."""
    from kiln.passes.factor_lora import FactorLora
    from kiln.runtime.tvm.compile import compile_graph

    def broken(self: FactorLora, graph: Graph) -> Graph:
        raise RuntimeError("planted")

    monkeypatch.setattr(FactorLora, "apply", broken)
    monkeypatch.setenv("KILN_REPRODUCER_DIR", str(tmp_path))
    with pytest.raises(PassCrash, match=r"pass factor-lora crashed: RuntimeError: planted; reproducer written to"):
        compile_graph(parse(MODULE), cache=False)
    (path,) = tmp_path.glob("kiln-crash-factor-lora-*.kir")
    assert path.read_text().startswith("// RUN: kiln opt %s -p factor-lora\n")
    monkeypatch.delenv("KILN_REPRODUCER_DIR")
    with pytest.raises(PassCrash, match=r"RuntimeError: planted$"):  # not asked: nothing written
        compile_graph(parse(MODULE), cache=False)


def test_the_oracle_holds_on_the_module_and_the_planted_pass_breaks_it() -> None:
    x, y = inputs()
    np.testing.assert_allclose(interpret(parse(MODULE), [x, y])[0], expected(x, y), rtol=1e-5)
    broken = PassManager.parse("test-swap-operands").run(parse(MODULE))
    assert not np.allclose(interpret(broken, [x, y])[0], expected(x, y))


def test_bisect_finds_the_first_bad_pass_and_rewrite(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Issue 17: "`kiln opt --bisect CHECK_CMD` finds the first pass application (and, inside a rewrite pass, the
    first rewrite) after which an interestingness command fails". Numbering: (1) canonicalize, (2) its rewrite of
    %q, (3) test-swap-operands, (4) %s and (5) %p swapped rightly, (6) %a, a sub: the miscompile."""
    src, out = tmp_path / "in.kir", tmp_path / "bad.kir"
    src.write_text(MODULE)
    check = f"{shlex.quote(sys.executable)} {shlex.quote(str(HERE / 'same_output.py'))}"
    assert main(["opt", str(src), "-p", "canonicalize,test-swap-operands,cse", "--bisect", check,
                 "-o", str(out)]) == EXIT_OK
    err = capsys.readouterr().err
    assert "kiln opt: first failing pass application: (3) pass test-swap-operands\n" in err
    assert "kiln opt: first failing rewrite: (6) rewrite of %a (sub) in pass test-swap-operands\n" in err
    assert "kiln opt: reproduce with --bisect-limit 6\n" in err
    ops = [op.kind for op in parse_file(str(out)).functions["forward"].ops]
    assert ops.count("sub") == 2 and len(ops) == 9  # the swap of %a applied, cse not run


def test_bisect_refuses_a_check_that_never_fails(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    src = tmp_path / "in.kir"
    src.write_text(MODULE)
    assert main(["opt", str(src), "-p", "canonicalize,cse", "--bisect", "true"]) == EXIT_INPUT
    assert "the check passes after the whole pipeline (3 pass applications and rewrites): nothing to bisect" \
        in capsys.readouterr().err


def test_reduce_shrinks_the_planted_miscompile_to_a_handful_of_ops(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture) -> None:
    """Issue 17: "`kiln reduce IN.kir --test CMD -o small.kir` shrinks a module while the test keeps failing ...
    deterministic, with a progress line and a final size report", with `--test equivalence:PIPELINE` "reduce to
    the smallest module on which PIPELINE changes a value"."""
    src = tmp_path / "in.kir"
    src.write_text(MODULE.replace("module @M {\n", 'module @M {\n  param @unused : tensor<4xf32> {id = "0x7", '
                                  'init = zeros, grad = true}\n  flag @drop.training = true {id = "0x8"}\n'))
    outputs = []
    for run in range(2):
        out = tmp_path / f"small{run}.kir"
        assert main(["reduce", str(src), "--test", "equivalence:test-swap-operands", "-o", str(out)]) == EXIT_OK
        outputs.append(out.read_text())
    err = capsys.readouterr().err
    assert outputs[0] == outputs[1]  # deterministic
    small = parse(outputs[0])
    ops = [op.kind for op in small.functions["forward"].ops]
    assert "sub" in ops and len(ops) <= 2, outputs[0]
    assert not small.params and not small.flags
    assert [a.type.shape for a in small.functions["forward"].args] == [(1,), (1,)]  # shapes shrunk
    assert re.search(r"^kiln reduce: round 1: 1 functions, \d+ ops", err, re.M), err
    assert re.search(r"^kiln reduce: 1 functions, 10 ops, 2 nodes, \d+ bytes -> 1 functions, [12] ops, 0 nodes",
                     err, re.M), err
    interesting = PassManager.parse("test-swap-operands").run(small)  # still a miscompile
    x, y = (v[:1] for v in inputs())
    assert not np.allclose(interpret(small, [x, y])[0], interpret(interesting, [x, y])[0])


def test_reduce_keeps_a_crash_the_same_crash(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """"`--test crash:PIPELINE`": the reduced module still crashes test-crash (it needs an exp)."""
    src, out = tmp_path / "in.kir", tmp_path / "small.kir"
    src.write_text(MODULE)
    assert main(["reduce", str(src), "--test", "crash:canonicalize,test-crash", "-o", str(out)]) == EXIT_OK
    ops = [op.kind for op in parse_file(str(out)).functions["forward"].ops]
    assert ops == ["exp"] or ops == ["constant", "exp"], ops
    with pytest.raises(PassCrash, match="ZeroDivisionError"):
        PassManager.parse("test-crash").run(parse_file(str(out)))
