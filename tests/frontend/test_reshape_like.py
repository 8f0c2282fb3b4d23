"""`Tensor.reshape(..., like=h, copy=...)`: a target that keeps several run-time dims (issue 12: "Dynamic dims stay
symbolic"), eager against numpy and traced with two `?` dims."""

from __future__ import annotations

import numpy as np

import kiln


class SplitHeads(kiln.Module):
    def forward(self, x):
        return x.reshape(-1, -1, 2, 3, like=x, copy=(0, 1, -1, -1))


def test_eager_reshape_copies_dims_from_like():
    x = np.arange(30, dtype=np.float32).reshape(1, 5, 6)
    np.testing.assert_array_equal(SplitHeads()(kiln.tensor(x)).numpy(), x.reshape(1, 5, 2, 3))


def test_traced_reshape_keeps_two_dynamic_dims():
    graph = kiln.trace(SplitHeads(), ((None, None, 6), "f32"))
    assert str(graph.functions["forward"].results[0].type) == "tensor<?x?x2x3xf32>"
