"""Before/Expected tests for the program passes, in the style of TVM's Relax transform tests.

Each case is two `.kir` texts: `run_pipeline(parse(before))` must be structurally equal to `parse(expected)`
(`kiln.ir.assert_structurally_equal`: SSA value names ignored; symbols, types, attributes, parameter state and
data, and op order all count). Every Expected is written out by hand from the pass's rule, never printed by
the pass. Where a case has a numpy `oracle`, the interpreter runs the function before and after the pipeline
on random inputs and both must agree with the oracle, so an Expected that is structurally right but
numerically wrong (or a wrong hand-written constant) cannot pass either.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest

from kiln.ir import assert_structurally_equal, interpret, parse
from kiln.passes import PassManager

W33_VALUES = [0.5, -1.0, 0.25, 2.0, 0.0, -0.5, 1.5, 0.75, -2.0]  # a 3x3 weight, row-major
W33 = "[" + ", ".join(map(str, W33_VALUES)) + "]"
W33_NP = np.array(W33_VALUES, np.float32).reshape(3, 3)


@dataclass(frozen=True)
class Case:
    """One pass test: `pipeline` over `before` gives `expected`; `oracle` maps inputs to each function's results."""

    id: str
    pipeline: str
    before: str
    expected: str
    oracle: Callable[..., tuple[np.ndarray, ...]] | None = None
    function: str = "forward"


def run_pipeline(pipeline: str, text: str):
    return PassManager.parse(pipeline, verify_each=True).run(parse(text))


CASES = [
    # ---- canonicalize ----
    Case("canonicalize: x + 0 is x", "canonicalize,dce", """
module @M {
  func @forward(%x: tensor<3xf32>) -> (tensor<3xf32>) {
    %zero = constant {value = dense<tensor<f32>, 0.0>} : tensor<f32>
    %a = add %x, %zero : tensor<3xf32>
    %b = tanh %a : tensor<3xf32>
    return %b
  }
}""", """
module @M {
  func @forward(%x: tensor<3xf32>) -> (tensor<3xf32>) {
    %b = tanh %x : tensor<3xf32>
    return %b
  }
}""", lambda x: (np.tanh(x),)),
    Case("canonicalize: dropout with a false flag is the identity", "canonicalize,dce", """
module @M {
  flag @training = false {id = "0x7"}
  func @forward(%x: tensor<2x3xf32>) -> (tensor<2x3xf32>) {
    %d = dropout %x, @training {p = 0.4} : tensor<2x3xf32>
    %e = exp %d : tensor<2x3xf32>
    return %e
  }
}""", """
module @M {
  flag @training = false {id = "0x7"}
  func @forward(%x: tensor<2x3xf32>) -> (tensor<2x3xf32>) {
    %e = exp %x : tensor<2x3xf32>
    return %e
  }
}""", lambda x: (np.exp(x),)),
    Case("canonicalize: x * 1 and neg neg fold, a live dropout stays", "canonicalize,dce", """
module @M {
  flag @live = true {id = "0x2"}
  func @forward(%x: tensor<3xf32>) -> (tensor<3xf32>, tensor<3xf32>) {
    %one = constant {value = dense<tensor<f32>, 1.0>} : tensor<f32>
    %a = mul %x, %one : tensor<3xf32>
    %b = neg %a : tensor<3xf32>
    %c = neg %b : tensor<3xf32>
    %d = dropout %c, @live {p = 0.3} : tensor<3xf32>
    return %c, %d
  }
}""", """
module @M {
  flag @live = true {id = "0x2"}
  func @forward(%x: tensor<3xf32>) -> (tensor<3xf32>, tensor<3xf32>) {
    %d = dropout %x, @live {p = 0.3} : tensor<3xf32>
    return %x, %d
  }
}"""),
    Case("canonicalize: a broadcasting add of zero changes the shape and stays", "canonicalize,dce", """
module @M {
  func @forward(%x: tensor<3xf32>) -> (tensor<2x3xf32>) {
    %zero = constant {value = dense<tensor<2x1xf32>, 0.0>} : tensor<2x1xf32>
    %a = add %x, %zero : tensor<2x3xf32>
    return %a
  }
}""", """
module @M {
  func @forward(%x: tensor<3xf32>) -> (tensor<2x3xf32>) {
    %z = constant {value = dense<tensor<2x1xf32>, 0.0>} : tensor<2x1xf32>
    %r = add %x, %z : tensor<2x3xf32>
    return %r
  }
}""", lambda x: (np.broadcast_to(x, (2, 3)),)),
    # ---- cse ----
    Case("cse: two equal matmuls merge", "cse,dce", f"""
module @M {{
  param @w : tensor<3x3xf32> {{id = "0x10", data = dense<tensor<3x3xf32>, {W33}>, grad = true}}
  func @forward(%x: tensor<2x3xf32>) -> (tensor<2x3xf32>) {{
    %a = matmul %x, @w : tensor<2x3xf32>
    %b = matmul %x, @w : tensor<2x3xf32>
    %c = add %a, %b : tensor<2x3xf32>
    return %c
  }}
}}""", f"""
module @M {{
  param @w : tensor<3x3xf32> {{id = "0x10", data = dense<tensor<3x3xf32>, {W33}>, grad = true}}
  func @forward(%x: tensor<2x3xf32>) -> (tensor<2x3xf32>) {{
    %a = matmul %x, @w : tensor<2x3xf32>
    %c = add %a, %a : tensor<2x3xf32>
    return %c
  }}
}}""", lambda x: (2 * (x @ W33_NP),)),
    Case("cse: different attributes and stochastic ops are kept apart", "cse", """
module @M {
  flag @live = true {id = "0x2"}
  func @forward(%x: tensor<3x3xf32>) -> (tensor<3xf32>, tensor<3xf32>, tensor<3x3xf32>, tensor<3x3xf32>) {
    %s1 = sum %x {axes = [1]} : tensor<3xf32>
    %s2 = sum %x {axes = [0]} : tensor<3xf32>
    %d1 = dropout %x, @live : tensor<3x3xf32>
    %d2 = dropout %x, @live : tensor<3x3xf32>
    return %s1, %s2, %d1, %d2
  }
}""", """
module @M {
  flag @live = true {id = "0x2"}
  func @forward(%x: tensor<3x3xf32>) -> (tensor<3xf32>, tensor<3xf32>, tensor<3x3xf32>, tensor<3x3xf32>) {
    %0 = sum %x {axes = [1]} : tensor<3xf32>
    %1 = sum %x {axes = [0]} : tensor<3xf32>
    %2 = dropout %x, @live : tensor<3x3xf32>
    %3 = dropout %x, @live : tensor<3x3xf32>
    return %0, %1, %2, %3
  }
}"""),
    # ---- dce ----
    Case("dce: an unused chain is removed, used ops stay in order", "dce", """
module @M {
  func @forward(%x: tensor<3xf32>) -> (tensor<3xf32>) {
    %unused = constant {value = dense<tensor<3xf32>, [1.0, 2.0, 3.0]>} : tensor<3xf32>
    %a = exp %x : tensor<3xf32>
    %dead = mul %unused, %a : tensor<3xf32>
    %b = tanh %a : tensor<3xf32>
    return %b
  }
}""", """
module @M {
  func @forward(%x: tensor<3xf32>) -> (tensor<3xf32>) {
    %a = exp %x : tensor<3xf32>
    %b = tanh %a : tensor<3xf32>
    return %b
  }
}""", lambda x: (np.tanh(np.exp(x)),)),
    Case("dce: a function returning its argument keeps nothing", "dce", """
module @M {
  func @forward(%x: tensor<3xf32>) -> (tensor<3xf32>) {
    %a = exp %x : tensor<3xf32>
    return %x
  }
}""", """
module @M {
  func @forward(%x: tensor<3xf32>) -> (tensor<3xf32>) {
    return %x
  }
}""", lambda x: (x,)),
    # ---- fold-constants ----
    Case("fold-constants: constant arithmetic folds into one constant", "fold-constants,dce", """
module @M {
  func @forward(%x: tensor<3xf32>) -> (tensor<3xf32>) {
    %a = constant {value = dense<tensor<3xf32>, [1.0, 2.0, 3.0]>} : tensor<3xf32>
    %b = constant {value = dense<tensor<f32>, 2.0>} : tensor<f32>
    %c = mul %a, %b : tensor<3xf32>
    %d = sub %c, %b : tensor<3xf32>
    %e = add %x, %d : tensor<3xf32>
    return %e
  }
}""", """
module @M {
  func @forward(%x: tensor<3xf32>) -> (tensor<3xf32>) {
    %k = constant {value = dense<tensor<3xf32>, [0.0, 2.0, 4.0]>} : tensor<3xf32>
    %e = add %x, %k : tensor<3xf32>
    return %e
  }
}""", lambda x: (x + np.array([0.0, 2.0, 4.0], np.float32),)),
    Case("fold-constants: results over max-elements are left alone", "fold-constants{max-elements=2},dce", """
module @M {
  func @forward(%x: tensor<3xf32>) -> (tensor<3xf32>) {
    %a = constant {value = dense<tensor<3xf32>, [1.0, 2.0, 3.0]>} : tensor<3xf32>
    %b = constant {value = dense<tensor<f32>, 2.0>} : tensor<f32>
    %s = constant {value = dense<tensor<f32>, 3.0>} : tensor<f32>
    %t = mul %b, %s : tensor<f32>
    %c = mul %a, %t : tensor<3xf32>
    %e = add %x, %c : tensor<3xf32>
    return %e
  }
}""", """
module @M {
  func @forward(%x: tensor<3xf32>) -> (tensor<3xf32>) {
    %a = constant {value = dense<tensor<3xf32>, [1.0, 2.0, 3.0]>} : tensor<3xf32>
    %t = constant {value = dense<tensor<f32>, 6.0>} : tensor<f32>
    %c = mul %a, %t : tensor<3xf32>
    %e = add %x, %c : tensor<3xf32>
    return %e
  }
}""", lambda x: (x + np.array([6.0, 12.0, 18.0], np.float32),)),
    # ---- materialize ----
    Case("materialize: a LoRA weight becomes base + scale * a @ b, with the base's id and state", "materialize", """
module @M {
  param @w.base : tensor<2x2xf32> {id = "0x1", data = dense<tensor<2x2xf32>, [1.0, 2.0, 3.0, 4.0]>, grad = false}
  param @w.lora.a : tensor<2x1xf32> {id = "0x2", data = dense<tensor<2x1xf32>, [1.0, 2.0]>, grad = true}
  param @w.lora.b : tensor<1x2xf32> {id = "0x3", data = dense<tensor<1x2xf32>, [0.5, -1.0]>, grad = true}
  reparam @w : tensor<2x2xf32> = lora(@w.base, @w.lora.a, @w.lora.b) {scale = 2.0}
  func @forward(%x: tensor<3x2xf32>) -> (tensor<3x2xf32>) {
    %y = matmul %x, @w : tensor<3x2xf32>
    return %y
  }
}""", """
module @M {
  param @w : tensor<2x2xf32> {id = "0x1", data = dense<tensor<2x2xf32>, [2.0, 0.0, 5.0, 0.0]>, grad = false}
  func @forward(%x: tensor<3x2xf32>) -> (tensor<3x2xf32>) {
    %y = matmul %x, @w : tensor<3x2xf32>
    return %y
  }
}""", lambda x: (x @ (np.array([[1, 2], [3, 4]], np.float32)
                       + 2.0 * np.array([[1], [2]], np.float32) @ np.array([[0.5, -1.0]], np.float32)),)),
    Case("materialize: a plain dequantize stays quantized storage (only LoRA derivations fold)", "materialize", """
module @M {
  param @w.codes : tensor<4xi8> {id = "0x5", data = dense<tensor<4xi8>, [16, -8, 127, 0]>, grad = false}
  param @w.scales : tensor<1xf32> {id = "0x6", data = dense<tensor<1xf32>, 0.0625>, grad = false}
  reparam @w : tensor<4xf32> = dequantize(@w.codes, @w.scales) {value = "q8s"}
  func @forward(%x: tensor<4xf32>) -> (tensor<4xf32>) {
    %y = mul %x, @w : tensor<4xf32>
    return %y
  }
}""", """
module @M {
  param @w.codes : tensor<4xi8> {id = "0x5", data = dense<tensor<4xi8>, [16, -8, 127, 0]>, grad = false}
  param @w.scales : tensor<1xf32> {id = "0x6", data = dense<tensor<1xf32>, 0.0625>, grad = false}
  reparam @w : tensor<4xf32> = dequantize(@w.codes, @w.scales) {value = "q8s"}
  func @forward(%x: tensor<4xf32>) -> (tensor<4xf32>) {
    %y = mul %x, @w : tensor<4xf32>
    return %y
  }
}""", lambda x: (x * np.array([16, -8, 127, 0], np.float32) * np.float32(0.0625),)),
    # ---- autodiff ----
    Case("autodiff: d sum(x * w) / d w = broadcast(1) * x", "autodiff", """
module @M {
  param @w : tensor<3xf32> {id = "0x1", data = dense<tensor<3xf32>, [0.5, -2.0, 3.0]>, grad = true}
  func @forward(%x: tensor<3xf32>) -> (tensor<f32>) {
    %m = mul %x, @w : tensor<3xf32>
    %loss = sum %m : tensor<f32>
    return %loss
  }
}""", """
module @M {
  param @w : tensor<3xf32> {id = "0x1", data = dense<tensor<3xf32>, [0.5, -2.0, 3.0]>, grad = true}
  func @forward(%x: tensor<3xf32>) -> (tensor<f32>) {
    %m = mul %x, @w : tensor<3xf32>
    %loss = sum %m : tensor<f32>
    return %loss
  }
  func @forward_backward(%x: tensor<3xf32>) -> (tensor<f32>, tensor<3xf32>) {
    %m = mul %x, @w : tensor<3xf32>
    %loss = sum %m : tensor<f32>
    %seed = constant {value = dense<tensor<f32>, 1.0>} : tensor<f32>
    %dm = broadcast_to %seed {shape = [3]} : tensor<3xf32>
    %dw = mul %dm, %x : tensor<3xf32>
    return %loss, %dw
  }
}""", lambda x: (np.sum(x * np.array([0.5, -2.0, 3.0], np.float32)), x), function="forward_backward"),
    Case("autodiff: a frozen param gets no gradient and costs nothing", "autodiff,dce", """
module @M {
  param @w : tensor<3xf32> {id = "0x1", data = dense<tensor<3xf32>, [0.5, -2.0, 3.0]>, grad = false}
  param @v : tensor<3xf32> {id = "0x2", data = dense<tensor<3xf32>, [1.0, 1.0, -1.0]>, grad = true}
  func @forward(%x: tensor<3xf32>) -> (tensor<f32>) {
    %m = mul %x, @w : tensor<3xf32>
    %n = add %m, @v : tensor<3xf32>
    %loss = sum %n : tensor<f32>
    return %loss
  }
}""", """
module @M {
  param @w : tensor<3xf32> {id = "0x1", data = dense<tensor<3xf32>, [0.5, -2.0, 3.0]>, grad = false}
  param @v : tensor<3xf32> {id = "0x2", data = dense<tensor<3xf32>, [1.0, 1.0, -1.0]>, grad = true}
  func @forward(%x: tensor<3xf32>) -> (tensor<f32>) {
    %m = mul %x, @w : tensor<3xf32>
    %n = add %m, @v : tensor<3xf32>
    %loss = sum %n : tensor<f32>
    return %loss
  }
  func @forward_backward(%x: tensor<3xf32>) -> (tensor<f32>, tensor<3xf32>) {
    %m = mul %x, @w : tensor<3xf32>
    %n = add %m, @v : tensor<3xf32>
    %loss = sum %n : tensor<f32>
    %seed = constant {value = dense<tensor<f32>, 1.0>} : tensor<f32>
    %dn = broadcast_to %seed {shape = [3]} : tensor<3xf32>
    return %loss, %dn
  }
}""", lambda x: (np.sum(x * np.array([0.5, -2.0, 3.0], np.float32) + np.array([1, 1, -1], np.float32)),
                 np.ones(3, np.float32)), function="forward_backward"),
    # ---- checkpoint ----
    Case("checkpoint: balanced recomputes the tanh before its backward use, keeps the matmul",
         "autodiff,cse,checkpoint{strategy=balanced},dce", f"""
module @M {{
  param @w : tensor<3x3xf32> {{id = "0x1", data = dense<tensor<3x3xf32>, {W33}>, grad = true}}
  func @forward(%x: tensor<2x3xf32>) -> (tensor<f32>) {{
    %h = matmul %x, @w : tensor<2x3xf32>
    %a = tanh %h : tensor<2x3xf32>
    %loss = sum %a : tensor<f32>
    return %loss
  }}
}}""", f"""
module @M {{
  param @w : tensor<3x3xf32> {{id = "0x1", data = dense<tensor<3x3xf32>, {W33}>, grad = true}}
  func @forward(%x: tensor<2x3xf32>) -> (tensor<f32>) {{
    %h = matmul %x, @w : tensor<2x3xf32>
    %a = tanh %h : tensor<2x3xf32>
    %loss = sum %a : tensor<f32>
    return %loss
  }}
  func @forward_backward(%x: tensor<2x3xf32>) -> (tensor<f32>, tensor<3x3xf32>) {{
    %h = matmul %x, @w : tensor<2x3xf32>
    %a = tanh %h : tensor<2x3xf32>
    %loss = sum %a : tensor<f32>
    %one = constant {{value = dense<tensor<f32>, 1.0>}} : tensor<f32>
    %da = broadcast_to %one {{shape = [2, 3]}} : tensor<2x3xf32>
    %a2 = tanh %h : tensor<2x3xf32>
    %sq = mul %a2, %a2 : tensor<2x3xf32>
    %dtanh = sub %one, %sq : tensor<2x3xf32>
    %dh = mul %da, %dtanh : tensor<2x3xf32>
    %xt = transpose %x {{perm = [1, 0]}} : tensor<3x2xf32>
    %dw = matmul %xt, %dh : tensor<3x3xf32>
    return %loss, %dw
  }}
}}""", lambda x: (np.sum(np.tanh(x @ W33_NP)), x.T @ (1 - np.tanh(x @ W33_NP) ** 2)),
         function="forward_backward"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_before_expected(case: Case) -> None:
    assert_structurally_equal(run_pipeline(case.pipeline, case.before), parse(case.expected))


@pytest.mark.parametrize("case", [c for c in CASES if c.oracle], ids=[c.id for c in CASES if c.oracle])
def test_numerics_before_and_after(case: Case) -> None:
    """The function (or, for autodiff, forward_backward of the result) matches numpy on random inputs."""
    after = run_pipeline(case.pipeline, case.before)
    rng = np.random.default_rng(0)
    fn = after.functions[case.function]
    inputs = [rng.standard_normal(a.type.shape).astype(np.float32) for a in fn.args]
    want = case.oracle(*inputs)
    graphs = [after] if case.function not in parse(case.before).functions else [parse(case.before), after]
    for graph in graphs:
        got = interpret(graph, inputs, case.function)
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_a_wrong_expected_fails() -> None:
    """The comparison has teeth: the materialize case with one element of the folded weight changed."""
    case = next(c for c in CASES if c.id.startswith("materialize: a LoRA"))
    wrong = case.expected.replace("[2.0, 0.0, 5.0, 0.0]", "[2.0, 0.0, 5.0, 1.0]")
    assert wrong != case.expected
    with pytest.raises(AssertionError, match="graphs differ structurally"):
        assert_structurally_equal(run_pipeline(case.pipeline, case.before), parse(wrong))
