"""Run-time errors of a compiled executable name the kiln ops behind them (issue 17, "Locations": every location
is "named in every error a pass, the verifier, shape inference, lowering or an executable raises, so an error
points at the user's line and layer")."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from tvm import relax

import kiln
from kiln import nn
from kiln.ir import KilnError, ShapeError
from kiln.runtime import load_executable
from kiln.runtime.tvm import artifact, compile_cache
from kiln.runtime.tvm.op_map import OpSources, ops_named

HERE = __file__


def line_of(marker: str) -> int:
    with open(HERE) as f:
        return next(i for i, text in enumerate(f, 1) if marker in text and "line_of" not in text)


class Residual(kiln.Module):
    def __init__(self, moved: bool = False):
        self.moved = moved  # a plain constant: the same graph, traced at another line

    def forward(self, x, skip):
        if self.moved:
            return nn.functional.relu(x + skip)  # @moved-add
        return nn.functional.relu(x + skip)  # @residual-add


class Model(kiln.Module):
    def __init__(self, moved: bool = False):
        self.fc = nn.Linear(4, 4)
        self.res = Residual(moved)

    def forward(self, x, skip):
        return self.res(self.fc(x), skip)  # @model-forward


def build(moved: bool = False):
    kiln.seed(5)  # the same weights, so the same cache key
    return kiln.compile(Model(moved).valid(), ((None, 4), "f32"), ((None, 4), "f32"))


@pytest.fixture(scope="module")
def exe():
    return build()


def _where(marker: str, path: str) -> str:
    return f"{path} ({HERE}:{line_of(marker)})"


def test_a_shared_dim_disagreeing_at_run_time_names_the_broadcast_that_joined_it(exe):
    """The add joins the batch dims of `x` (through the Linear) and `skip` into one symbolic var; TVM's check
    that `skip` matches it names that var, which maps back to the add at the user's line in module `res`."""
    x, skip = np.ones((2, 4), np.float32), np.ones((3, 4), np.float32)
    with pytest.raises(KilnError, match="failed at run time") as info:
        exe(x, skip)
    message = str(info.value)
    assert message.startswith(f"add at {_where('@residual-add', 'res')}"), message
    assert "\n" not in message
    assert exe(x, x).shape == (2, 4)  # the executable still runs after the error


def test_a_cached_build_names_the_lines_of_the_graph_compiled(exe):
    """Locations are not in cache keys: a build cached for one graph, reused for an equal one traced at other
    lines, names the new lines."""
    moved = build(moved=True)
    assert moved.program is exe.program  # the one build, from the in-memory cache
    with pytest.raises(KilnError, match=f"^add at {re.escape(_where('@moved-add', 'res'))}: "):
        moved(np.ones((2, 4), np.float32), np.ones((3, 4), np.float32))


def test_a_wrong_input_names_the_ops_reading_it(exe):
    with pytest.raises(ShapeError, match="input %x1 expects") as info:
        exe(np.ones((2, 4), np.float32), np.ones((2, 4), np.float64))
    assert str(info.value).startswith(f"add at {_where('@residual-add', 'res')}: @forward input %x1")
    with pytest.raises(ShapeError) as info:
        exe(np.ones((2, 5), np.float32), np.ones((2, 4), np.float32))
    assert str(info.value).startswith(f"linear at {_where('@model-forward', 'fc')}: @forward input %x")


def test_an_exported_library_keeps_the_map(exe, tmp_path):
    """A loaded `.so` has no graph: the map and the op descriptions come from its sidecar."""
    exe.export_library(str(tmp_path / "m.so"))
    compile_cache.clear_memory()
    loaded = load_executable(str(tmp_path / "m.so"))
    with pytest.raises(KilnError, match=f"^add at {re.escape(_where('@residual-add', 'res'))}.*failed at run time"):
        loaded(np.ones((2, 4), np.float32), np.ones((3, 4), np.float32))


@pytest.mark.parametrize(("field", "value", "error"), [("op_map", {"forward": {"x": "0"}}, "malformed op map"),
                                                      ("ops", {"forward": [3]}, "malformed op descriptions")])
def test_a_malformed_map_in_a_sidecar_is_refused(exe, tmp_path, field, value, error):
    path = str(tmp_path / "m.so")
    exe.export_library(path)
    payload = json.loads(Path(path + artifact.SIDECAR).read_text())
    payload.pop("sidecar_sha256")
    payload[field] = value
    payload["sidecar_sha256"] = artifact._payload_digest(payload)  # well signed, badly formed
    Path(path + artifact.SIDECAR).write_text(json.dumps(payload))
    with pytest.raises(artifact.CorruptArtifact, match=error):
        load_executable(path)


def test_the_kernels_tvm_fused_name_their_ops(exe):
    """The build's fused PrimFuncs (LegalizeOps' names joined by FuseTIR) map back to the Linear, add and relu."""
    lib = exe.program.library
    text = lib.as_text() if isinstance(lib, relax.VMExecutable) else relax.VMExecutable(lib).as_text()
    kernels = set(re.findall(r"fused_\w+", text))
    assert kernels and {i for k in kernels for i in ops_named(k, exe.program.op_map["forward"])} == {0, 1, 2}


def test_a_fused_kernel_name_splits_into_its_parts():
    """FuseTIR names a fused PrimFunc by concatenating its parts (`fused_add1_relu`): each part's op is named."""
    src = OpSources()
    src.add("add1", [3])
    src.add("relu", [4])
    src.add("layer_norm", [1])
    assert ops_named("Assert fail: fused_add1_relu.A has an unsatisfied constraint", src.names) == [3, 4]
    assert ops_named("in fused_layer_norm_add1", src.names) == [1, 3]
    assert ops_named("in fused_unknown_relu", src.names) == [4]
