"""Suite-wide test setup: the `target` fixture, and skipping `cuda` tests where TVM sees no CUDA device.

A test that takes `target` runs once for "llvm" and once, marked `cuda`, for "cuda"; `pytest -m cuda` selects the
CUDA runs (docs/gpu.md runs them on a lent GPU machine).
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module", params=["llvm", pytest.param("cuda", marks=pytest.mark.cuda)])
def target(request: pytest.FixtureRequest) -> str:
    """A compile target: "llvm", and "cuda" (marked `cuda`)."""
    return request.param


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip every `cuda` test, saying why, when TVM finds no CUDA device (checked once, only if there are any)."""
    cuda = [item for item in items if item.get_closest_marker("cuda")]
    if not cuda:
        return
    import tvm

    if tvm.cuda(0).exist:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: tvm.cuda(0).exist is false (docs/gpu.md runs these on one)")
    for item in cuda:
        item.add_marker(skip)
