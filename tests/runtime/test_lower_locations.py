"""A lowering error names the op's location (issue 17, "Locations": "named in every error a pass, the verifier,
shape inference, lowering or an executable raises, so an error points at the user's line and layer")."""

from __future__ import annotations

import pytest

from kiln.ir import KilnError, parse
from kiln.runtime.tvm.lower import lower

TEXT = """module @m {
  func @forward(%d: tensor<?x4xf32>, %i: tensor<2x1xi64>, %u: tensor<2x4xf32>) -> (tensor<?x4xf32>) {
    %y = scatter_nd %d, %i, %u : tensor<?x4xf32> loc("decoder.cache"("model.py":41))
    return %y
  }
}
"""


def test_a_relax_rule_error_names_the_location():
    """The Relax `scatter_nd` needs static indexed dims; refusing a `?` one, the driver names where the op is."""
    with pytest.raises(KilnError, match=r"^decoder\.cache \(model\.py:41\): scatter_nd: the indexed dims"):
        lower(parse(TEXT, "m.kir"))
    with pytest.raises(KilnError, match=r"^m\.kir:3:5: scatter_nd"):
        lower(parse(TEXT.replace(' loc("decoder.cache"("model.py":41))', ""), "m.kir"))
