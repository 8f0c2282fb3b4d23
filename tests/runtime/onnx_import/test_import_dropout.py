"""ONNX Dropout in training mode onto kiln's dropout op.

ONNX (Dropout-13): "output = scale * data * mask, where scale = 1. / (1. - ratio)"; "If this input [training_mode]
was set to true, then the output is generated randomly"; the mask output is boolean. ONNX's node tests store masks
drawn with numpy's legacy generator, which the spec does not prescribe (their reason `rng`), so these check the
distribution, the scale, the seed and the mask's pattern, with numpy as the oracle.
"""

from __future__ import annotations

import numpy as np
import onnx_cases
import pytest
from onnx import helper

from kiln.ir import interpret
from kiln.runtime.onnx.importer.driver import UnsupportedModel, import_graph

RATIO = 0.3
X = np.random.default_rng(5).uniform(0.5, 2.0, (200, 100)).astype(np.float32)
X[:, ::2] = 0.0  # zeros the mask still covers: it is the drawn pattern, not y != 0


def dropout_model(training: np.ndarray | None, ratio: float = RATIO, mask: bool = True, **attrs: int):
    inputs = {"x": (np.float32, list(X.shape))}
    inits = {"r": np.float32(ratio)}
    if training is None:
        inputs["t"] = (np.bool_, [])
    else:
        inits["t"] = training
    outs = ["y", "mask"] if mask else ["y"]
    node = helper.make_node("Dropout", ["x", "r", "t"], outs, name="drop", **attrs)
    return onnx_cases.model([node], inputs, outs, opset=13, initializers=inits)


def test_training_dropout_keeps_one_minus_ratio_scaled_and_the_mask_is_the_pattern() -> None:
    """About (1 - ratio) of the elements kept (20,000 draws: 5 sigma is 0.016), each kept one x / (1 - ratio),
    the others 0; the mask is True exactly where kept (y != 0 wherever x != 0)."""
    y, mask = interpret(import_graph(dropout_model(np.asarray(True), seed=3)), [X])
    assert mask.dtype == np.bool_ and mask.shape == X.shape
    assert abs(mask.mean() - (1 - RATIO)) < 0.016, mask.mean()
    np.testing.assert_allclose(y[mask], X[mask] / (1 - RATIO), rtol=1e-6)
    assert not y[~mask].any()
    nonzero = X != 0
    assert np.array_equal(mask[nonzero], y[nonzero] != 0)
    assert abs(mask[~nonzero].mean() - (1 - RATIO)) < 0.03  # the mask is drawn where x is 0 too


def test_training_dropout_is_reproducible_for_a_seed_and_its_output_alone_draws_the_same_mask() -> None:
    """A fixed seed attribute gives the same mask on every run and import (and with the mask output omitted);
    another seed another mask; no seed attribute is still reproducible across imports."""
    first = interpret(import_graph(dropout_model(np.asarray(True), seed=3)), [X])
    again = interpret(import_graph(dropout_model(np.asarray(True), seed=3)), [X])
    alone = interpret(import_graph(dropout_model(np.asarray(True), mask=False, seed=3)), [X])
    other = interpret(import_graph(dropout_model(np.asarray(True), seed=4)), [X])
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    assert np.array_equal(alone[0], first[0])
    assert not np.array_equal(other[1], first[1])
    unseeded = [interpret(import_graph(dropout_model(np.asarray(True))), [X]) for _ in range(2)]
    assert np.array_equal(unseeded[0][1], unseeded[1][1])
    negative = [interpret(import_graph(dropout_model(np.asarray(True), seed=-5)), [X]) for _ in range(2)]
    assert np.array_equal(negative[0][1], negative[1][1])  # ONNX's seed is an int64; negative ones work too


def test_training_mode_known_at_run_time_switches_dropout() -> None:
    """training_mode as a graph input: false gives y = x and an all-true mask ("If training_mode is false ...
    the output is the input"), true drops as above."""
    graph = import_graph(dropout_model(None, seed=3))
    x_args = [a.name for a in graph.functions["forward"].args]
    feeds = {"x": X}
    y, mask = interpret(graph, [feeds.get(n, np.asarray(False)) for n in x_args])
    assert np.array_equal(y, X) and mask.all()
    y, mask = interpret(graph, [feeds.get(n, np.asarray(True)) for n in x_args])
    assert abs(mask.mean() - (1 - RATIO)) < 0.016 and np.array_equal(y[~mask], np.zeros((~mask).sum(), np.float32))


def test_zero_ratio_training_is_the_identity_with_an_all_true_mask() -> None:
    y, mask = interpret(import_graph(dropout_model(np.asarray(True), ratio=0.0)), [X])
    assert np.array_equal(y, X) and mask.all()


def test_a_ratio_of_one_is_refused_naming_the_node() -> None:
    """ONNX: "The ratio of random dropout, with value in [0, 1)"."""
    with pytest.raises(UnsupportedModel, match=r"drop \(Dropout, opset 13\): Dropout ratio 1.0 is outside \[0, 1\)"):
        import_graph(dropout_model(np.asarray(True), ratio=1.0))


def test_run_time_training_mode_that_is_not_a_bool_scalar_is_refused() -> None:
    node = helper.make_node("Dropout", ["x", "r", "t"], ["y"], name="drop")
    m = onnx_cases.model([node], {"x": (np.float32, [2, 3]), "t": (np.bool_, [1])}, ["y"], opset=13,
                         initializers={"r": np.float32(RATIO)})
    refusal = r"drop \(Dropout, opset 13\): Dropout's training_mode tensor<1xbool> known at run time"
    with pytest.raises(UnsupportedModel, match=refusal):
        import_graph(m)
