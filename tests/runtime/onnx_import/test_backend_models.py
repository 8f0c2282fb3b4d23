"""The model suites shipped with the onnx package (`simple`, `pytorch-converted`, `pytorch-operator`) through kiln's
backend.

Issue 12: "The ONNX project's own backend tests, run through the backend interface with `onnx.backend.test.BackendTest`
(... plus its `pytorch-converted`, `pytorch-operator`, `simple` and `light` model data). Keep an explicit list of
expected failures with a reason each; no blanket skips." Each case imports a stored model and compares kiln's
outputs with the reference outputs stored beside it, on the reference interpreter (a few seconds in all). The
tests of `model_expected_failures.txt` are expected failures, keyed by the reasons of `test_backend_nodes.py`;
`KILN_ONNX_NODE_TESTS_UPDATE=1` drops the lines of those that pass. The `light` models: `test_backend_light.py`.
"""

from __future__ import annotations

from pathlib import Path

from backend_suites import check_groups
from test_backend_nodes import REASONS

from kiln.frontend.onnx_backend import KilnReferenceBackend

_LIST = Path(__file__).with_name("model_expected_failures.txt")


_SUITES = {"OnnxBackendSimpleModelTest": "simple models",
           "OnnxBackendPyTorchConvertedModelTest": "pytorch-converted models",
           "OnnxBackendPyTorchOperatorModelTest": "pytorch-operator models"}


def test_onnx_model_suites_pass_except_the_listed_ones():
    """Every model of the three suites matches its stored outputs except the listed ones, which fail."""
    check_groups(_SUITES, KilnReferenceBackend, (_LIST,), REASONS)
