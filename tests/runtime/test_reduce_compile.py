"""`kiln reduce --test compile:TARGET` (issue 17, "Reduction": "Built in: ... `--test compile:TARGET`"): a module
whose TVM build fails because of a lowering bug planted here (tanh's Relax rule transposes its operand, so its
shape disagrees with kiln's type) shrinks to the one op that still fails, the same way on every run."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from tvm import relax

import kiln.runtime.tvm.lower  # noqa: F401  (registers the Relax rules the test replaces one of)
from kiln.cli import EXIT_OK, main
from kiln.ir import KilnError, parse_file, registry
from kiln.runtime.tvm.compile import compile_graph

MODULE = """module @M {
  param @w : tensor<8xf32> {id = "0x7", init = zeros, grad = true}
  func @forward(%x: tensor<4x8xf32>) -> (tensor<4x8xf32>) {
    %a = exp %x : tensor<4x8xf32>
    %b = tanh %a : tensor<4x8xf32>
    %c = add %b, @w : tensor<4x8xf32>
    return %c
  }
}
"""


def test_reduce_shrinks_a_failing_build_to_the_op_at_fault(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture) -> None:
    src = tmp_path / "in.kir"
    src.write_text(MODULE)
    rules = registry.lookup("tanh").rules
    monkeypatch.setitem(rules, "relax", lambda call: relax.op.permute_dims(call.args[0]))  # the planted bug
    outputs = []
    for run in range(2):
        out = tmp_path / f"small{run}.kir"
        assert main(["reduce", str(src), "--test", "compile:llvm", "-o", str(out)]) == EXIT_OK
        outputs.append(out.read_text())
    assert outputs[0] == outputs[1]  # deterministic
    small = parse_file(str(tmp_path / "small0.kir"))
    assert [op.kind for op in small.functions["forward"].ops] == ["tanh"] and not small.params
    assert [a.type.shape for a in small.functions["forward"].args][-1] == (4, 1)  # 8 shrank; 4x1 still transposes
    assert re.search(r"^kiln reduce: 1 functions, 3 ops, 1 nodes, \d+ bytes -> 1 functions, 1 ops, 0 nodes",
                     capsys.readouterr().err, re.M)
    with pytest.raises(KilnError, match="tanh: lowered to shape"):
        compile_graph(small, cache=False)
    monkeypatch.undo()  # without the bug the reduced module builds
    assert compile_graph(small, cache=False) is not None
