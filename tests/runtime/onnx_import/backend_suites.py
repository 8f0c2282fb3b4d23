"""One group of the ONNX project's backend tests (`onnx.backend.test.BackendTest`) run through a kiln backend and
checked against a file of expected failures, one test and reason key a line: shared by the node and model harnesses;
and the `light` models as the light-model test and bench/onnx_models.py find and feed them.

Building a `BackendTest` generates every node case's data (~10 s of CPU), so one is built per backend and shared.
"""

from __future__ import annotations

import functools
import os
import re
import unittest
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx
import onnx.backend.test
from onnx.backend.base import Backend
from onnx.backend.test.loader import load_model_tests
from onnx.backend.test.runner import Runner

LIGHT_MODELS = {case.model_name: case for case in load_model_tests(kind="real")}  # the nine `light` models


def light_model(name: str) -> tuple[Path, dict[str, np.ndarray]]:
    """A `light` model's file inside the onnx package (its url names it) and, by graph input, the dummy inputs
    onnx's own runner feeds it (`OnnxBackendRealModelTest`); the tolerances are `LIGHT_MODELS[name]`'s."""
    path = Path(onnx.__file__).parent.parent / LIGHT_MODELS[name].url
    graph = onnx.load(path, load_external_data=False).graph
    initializers = {t.name for t in graph.initializer}
    return path, {i.name: Runner.generate_dummy_data(i, name=name) for i in graph.input if i.name not in initializers}


@functools.cache
def backend_test(backend: type[Backend]) -> onnx.backend.test.BackendTest:
    """The ONNX backend tests over `backend`, built once per process."""
    with warnings.catch_warnings():  # the onnx cases warn as they build their data (overflowing casts...)
        warnings.simplefilter("ignore")
        return onnx.backend.test.BackendTest(backend, __name__)


def read_listed(listing: Path, reasons: Mapping[str, str]) -> dict[str, str]:
    """Test name (without `_cpu`) -> reason key, as `listing` lists them; a key not in `reasons` is refused."""
    out = {}
    for line in listing.read_text().splitlines():
        if line and not line.startswith("#"):
            name, key, *_ = line.split()
            assert key in reasons, f"{listing.name}: {name} has unknown reason {key!r}"
            out[name] = key
    return out


def drop_listed(listing: Path, names: list[str]) -> None:
    """Rewrite `listing` without the lines of `names` (tests that pass now), comments and order kept."""
    gone = set(names)
    lines = listing.read_text().splitlines(keepends=True)
    listing.write_text("".join(line for line in lines if not line.split() or line.split()[0] not in gone))


def selected(name: str) -> bool:
    """Whether test `name` (without `_cpu`) is in the run: $KILN_ONNX_NODE_TESTS_ONLY, a regular expression
    searched in the name, picks a subset (one op family of a minutes-long TVM run); unset, every test runs."""
    only = os.environ.get("KILN_ONNX_NODE_TESTS_ONLY")
    return not only or re.search(only, name) is not None


def check_groups(groups: Mapping[str, str], backend: type[Backend], listings: Sequence[Path],
                 reasons: Mapping[str, str]) -> None:
    """Run every selected CPU case of the `groups` (group -> what it holds, for the printed counts), in one
    unittest pass each (a pytest item per case would cost more than the cases), and assert that exactly the ones
    the `listings` list fail (a test in two of them is refused); `KILN_ONNX_NODE_TESTS_UPDATE=1` drops the listed
    ones that pass from their file."""
    failed: dict[str, str] = {}
    for group, what in groups.items():
        result = unittest.TestResult()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            suite = unittest.defaultTestLoader.loadTestsFromTestCase(backend_test(backend).test_cases[group])
            suite = unittest.TestSuite(case for case in suite if selected(_name(case)))
            suite.run(result)
        bad = {_name(case): why for case, why in result.failures + result.errors}
        run = result.testsRun - len(result.skipped)  # the CUDA twins are skipped: the backend runs on CPU
        print(f"ONNX {what}: {run - len(bad)} of {run} pass, {len(bad)} fail")
        failed |= bad
    by_file = {listing: {n: k for n, k in read_listed(listing, reasons).items() if selected(n)}
               for listing in listings}
    expected: dict[str, str] = {}
    for listing, names in by_file.items():
        twice = sorted(set(names) & set(expected))
        assert not twice, f"{listing.name} lists tests another list holds: {twice}"
        expected |= names
    unexpected = sorted(set(failed) - set(expected))
    now_passing = sorted(set(expected) - set(failed))
    assert not unexpected, "unexpected failures:\n" + "\n".join(f"{n}: {failed[n].splitlines()[-1]}"
                                                                  for n in unexpected)
    if now_passing and os.environ.get("KILN_ONNX_NODE_TESTS_UPDATE") == "1":
        for listing, names in by_file.items():
            drop_listed(listing, [n for n in now_passing if n in names])
        now_passing = []
    assert not now_passing, f"listed in {[p.name for p in listings]} but passing now (remove them): {now_passing}"


def _name(case: unittest.TestCase) -> str:
    return case.id().rsplit(".", 1)[-1].removesuffix("_cpu")
