"""kiln.ir.naming: the one place derived-parameter node names are made, and mapped back to user paths."""

from __future__ import annotations

import pytest

from kiln.ir import parse
from kiln.ir.naming import derived, lora_a, lora_b, lora_base, quant_codes, quant_scales, suffix_of, user_paths

QLORA = """module @M {
  param @w.codes : tensor<2x2xi8> {id = "0x1"}
  param @w.scales : tensor<1xf32> {id = "0x2"}
  param @w.lora.a : tensor<2x1xf32> {id = "0x3"}
  param @w.lora.b : tensor<1x2xf32> {id = "0x4"}
  param @base : tensor<2xf32> {id = "0x5"}
  reparam @w.base : tensor<2x2xf32> = dequantize(@w.codes, @w.scales) {value = "q8f"}
  reparam @w : tensor<2x2xf32> = lora(@w.base, @w.lora.a, @w.lora.b) {scale = 1.0}
}
"""


def test_names_follow_burns_record_paths():
    assert (lora_base("fc.weight"), lora_a("fc.weight"), lora_b("fc.weight")) == (
        "fc.weight.base", "fc.weight.lora.a", "fc.weight.lora.b")
    assert (quant_codes("w"), quant_scales("w")) == ("w.codes", "w.scales")
    assert suffix_of("fc.weight", derived("fc.weight", "lora.a")) == "lora.a"


def test_suffix_of_a_foreign_node_names_it():
    with pytest.raises(ValueError, match=r"@v\.lora\.a is not a node of the derived parameter 'w'"):
        suffix_of("w", "v.lora.a")


def test_user_paths_map_stored_bases_through_qlora():
    """QLoRA's codes stand for `w` (not for the inner `w.base`); factors and plain params keep their names."""
    assert user_paths(parse(QLORA)) == {"w.codes": "w"}


def test_user_paths_of_lora_and_quantized_weights():
    lines = QLORA.splitlines()
    lora = [line for line in lines if not any(s in line for s in ("@w.codes :", "@w.scales :", "dequantize"))]
    lora.insert(1, '  param @w.base : tensor<2x2xf32> {id = "0x1"}')
    assert user_paths(parse("\n".join(lora))) == {"w.base": "w"}
    quantized = [line for line in lines if "lora" not in line]
    assert user_paths(parse("\n".join(quantized).replace("@w.base :", "@w :"))) == {"w.codes": "w"}
