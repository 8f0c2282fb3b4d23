"""Liveness over the op order: a value lives from its op to its last use (to the end when returned), and at each
op its operands and results are alive together; arguments and parameters are not counted."""

from __future__ import annotations

import pytest

from kiln.ir import Builder, ShapeError
from kiln.ir.liveness import live_bytes, peak_live_bytes, value_bytes


def chain(batch: int | None):
    b = Builder("M")
    x = b.input("x", ((batch, 4), "f32"))
    a = b.relu(x)  # 16 bytes per row
    c = b.tanh(a)
    d = b.add(a, c)  # a's last use
    b.sum(d)  # unused: freed by its own op
    b.ret(b.mul(d, d))
    return b.build().functions["forward"]


def test_live_bytes_follow_last_uses() -> None:
    fn = chain(2)  # every [2, 4] f32 value is 32 bytes, the unused sum 4
    assert live_bytes(fn) == [32, 64, 96, 32 + 4, 64]
    assert peak_live_bytes(fn) == 96


def test_dynamic_dims_take_the_batch_size() -> None:
    fn = chain(None)
    assert peak_live_bytes(fn, batch=8) == 3 * 8 * 16
    assert value_bytes(fn.args[0].type, batch=3) == 48
    with pytest.raises(ShapeError, match="batch size"):
        peak_live_bytes(fn)
