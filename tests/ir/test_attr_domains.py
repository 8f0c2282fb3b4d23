"""Numeric attributes outside their op's domain are refused where the op is built, as one-line errors.

Issue 15: "numeric attributes out of domain ... all become one-line errors with file:line:col". A NaN slope, a
negative epsilon or a momentum above 1 would otherwise make every result NaN (or a running statistic diverge)
with no error at all.
"""

from __future__ import annotations

import pytest

from kiln.ir import Builder, DType, IRParseError, ShapeError, TensorType, parse

_TEXT = """module @M {{
  func @forward(%x: tensor<2x3xf32>, %g: tensor<3xf32>) -> (tensor<2x3xf32>) {{
    %y = {op} : tensor<2x3xf32>
    return %y
  }}
}}
"""

REFUSED = [
    ("leaky_relu %x {alpha = nan}", "leaky_relu: attribute 'alpha' = nan: expected a finite number"),
    ("leaky_relu %x {alpha = inf}", "leaky_relu: attribute 'alpha' = inf: expected a finite number"),
    ("layer_norm %x, %g {eps = -1.0}", "layer_norm: attribute 'eps' = -1.0: expected 0 <= value"),
    ("layer_norm %x, %g {eps = nan}", "layer_norm: attribute 'eps' = nan: expected a finite number"),
    ("rms_norm %x, %g {eps = -0.5}", "rms_norm: attribute 'eps' = -0.5: expected 0 <= value"),
]


@pytest.mark.parametrize(("op", "message"), REFUSED, ids=[m.split(":")[0] + "-" + op.split("= ")[1][:-1]
                                                          for op, m in REFUSED])
def test_out_of_domain_attribute_is_a_parse_error_at_its_op(op: str, message: str) -> None:
    with pytest.raises(IRParseError) as caught:
        parse(_TEXT.format(op=op), "m.kir")
    assert str(caught.value).startswith(f"m.kir:3:10: {message}")
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("op", ["layer_norm %x, %g {eps = 0.0}", "leaky_relu %x {alpha = -3.0}"])
def test_domain_boundaries_are_accepted(op: str) -> None:
    parse(_TEXT.format(op=op), "m.kir")


@pytest.mark.parametrize(("attrs", "message"), [
    ({"momentum": 1.5}, "attribute 'momentum' = 1.5: expected 0 <= value <= 1"),
    ({"momentum": -0.1}, "attribute 'momentum' = -0.1: expected 0 <= value <= 1"),
    ({"eps": float("nan")}, "attribute 'eps' = nan: expected a finite number"),
])
def test_batch_norm_momentum_and_eps_domains(attrs: dict, message: str) -> None:
    b = Builder("M")
    x = b.input("x", TensorType((2, 3), DType.f32))
    vec = [b.param(f"p{i}", (3,)) for i in range(4)]
    with pytest.raises(ShapeError, match=message.replace("(", r"\(")):
        b.op("batch_norm", x, *vec, b.flag("training", False), **attrs)


@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_adapter_scale_must_be_finite(kind: str) -> None:
    b = Builder("M")
    operands = [b.param("w", (4, 3)), b.param("a", (4, 2)), b.param("b", (2, 3))]
    if kind == "dora":
        operands.append(b.param("m", (3,)))
    with pytest.raises(ShapeError, match=f"{kind}: attribute 'scale' = nan: expected a finite number"):
        b.op(kind, *operands, scale=float("nan"))
