"""The default backend and `using_backend`, the one way tests and benches switch it for a block."""

from __future__ import annotations

import numpy as np
import pytest

import kiln
from kiln.runtime.backend import InterpreterBackend, default_backend, using_backend


class CountingBackend(InterpreterBackend):
    """The interpreter, counting the graphs it runs."""

    def __init__(self) -> None:
        self.runs = 0

    def run(self, *args, **kwargs):
        self.runs += 1
        return super().run(*args, **kwargs)


def test_a_block_realizes_tensors_on_its_backend_and_restores_the_previous_one() -> None:
    before = default_backend()
    counting = CountingBackend()
    with using_backend(counting) as active:
        assert active is counting and default_backend() is counting
        total = (kiln.tensor(np.ones((2, 3), np.float32)) * 2.0).sum().numpy()
    assert default_backend() is before
    assert counting.runs >= 1 and float(total) == 12.0


def test_the_previous_backend_comes_back_when_the_block_raises() -> None:
    before = default_backend()
    with pytest.raises(RuntimeError, match="inside"), using_backend(CountingBackend()):
        raise RuntimeError("inside")
    assert default_backend() is before


def test_none_keeps_the_current_backend() -> None:
    before = default_backend()
    with using_backend(None) as active:
        assert active is before and default_backend() is before
    assert default_backend() is before
