"""`kiln import-onnx model.onnx -o model.kir [--record model.bpk]` and `kiln run MODEL (.onnx | .kir | .so)
--input name=x.npy ... [-o out.npz] [--bench [--against onnxruntime]]` (issue 12, "Command line"); outputs are
checked against onnxruntime on the same file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from onnx_mlp import MLP

import kiln
from kiln.cli import main
from kiln.ir import interpret, parse_file
from kiln.runtime.records.record import ModuleRecord


@pytest.fixture
def model(tmp_path: Path) -> tuple[Path, Path, np.ndarray]:
    """An exported MLP, an input file, and onnxruntime's output on it."""
    kiln.seed(12)  # the model of test_onnx_import too, so the build cache compiles it once
    path = kiln.export_onnx(MLP(), ((None, 6), "f32"), path=tmp_path / "m.onnx")
    x = np.random.default_rng(3).standard_normal((4, 6)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    (want,) = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    return path, tmp_path / "x.npy", want


def test_import_onnx_writes_a_kir_module_and_a_record(model, tmp_path: Path):
    """"`kiln import-onnx model.onnx -o model.kir [--record model.bpk]`": the module computes the model; with
    --record the parameters (ids kept) are in the burnpack and elided in the text."""
    path, x_file, want = model
    assert main(["import-onnx", str(path), "-o", str(tmp_path / "m.kir")]) == 0
    graph = parse_file(str(tmp_path / "m.kir"))
    np.testing.assert_allclose(interpret(graph, [np.load(x_file)])[0], want, rtol=1e-5, atol=1e-6)
    assert main(["import-onnx", str(path), "-o", str(tmp_path / "e.kir"), "--record", str(tmp_path / "e.bpk")]) == 0
    assert "data = elided" in (tmp_path / "e.kir").read_text()
    record = ModuleRecord.load(tmp_path / "e.bpk")
    assert {p: e.param_id for p, e in record.items()} == {p: n.id for p, n in graph.params.items()}
    out = tmp_path / "out.npz"
    assert main(["run", str(tmp_path / "e.kir"), "--record", str(tmp_path / "e.bpk"), "--input", f"x={x_file}",
                 "-o", str(out)]) == 0
    np.testing.assert_allclose(np.load(out)["output"], want, rtol=1e-4, atol=1e-5)


def test_import_onnx_to_bpk_keeps_writing_the_initializers(model, tmp_path: Path):
    path, _, _ = model
    assert main(["import-onnx", str(path), "-o", str(tmp_path / "m.bpk")]) == 0
    assert list(ModuleRecord.load(tmp_path / "m.bpk")) == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]


def test_run_onnx_and_so_agree_with_onnxruntime_and_bench_prints_both(model, tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture):
    path, x_file, want = model
    out = tmp_path / "out.npz"
    assert main(["run", str(path), "--input", f"x={x_file}", "-o", str(out), "--bench", "--against", "onnxruntime",
                 "--rounds", "1"]) == 0
    np.testing.assert_allclose(np.load(out)["output"], want, rtol=1e-4, atol=1e-5)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("kiln ") and lines[0].endswith(" ms")
    assert lines[1].startswith("onnxruntime ") and "x kiln's time" in lines[1]
    kiln.compile(kiln.import_onnx(path).valid(), ((None, 6), "f32")).export_library(str(tmp_path / "m.so"))
    assert main(["run", str(tmp_path / "m.so"), "--input", f"x={x_file}", "-o", str(out)]) == 0
    np.testing.assert_allclose(np.load(out)["output"], want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("argv, message", [
    (["--input", "y=X"], "--input 'y': the model has no such input (inputs: x)"),
    ([], "missing --input for x (inputs: x)"),
    (["--input", "x"], "--input 'x': expected NAME=FILE.npy"),
    (["--input", "x=X", "--against", "onnxruntime"], "--against onnxruntime needs --bench"),
])
def test_run_refuses_bad_arguments_in_one_line(model, capsys: pytest.CaptureFixture, argv, message):
    path, x_file, _ = model
    argv = [a.replace("=X", f"={x_file}") for a in argv]
    assert main(["run", str(path), *argv]) == 1
    assert capsys.readouterr().err == f"kiln run: error: {message}\n"


def test_run_exit_codes_for_unknown_kinds_and_missing_files(tmp_path: Path, capsys: pytest.CaptureFixture):
    (tmp_path / "m.txt").write_text("")
    assert main(["run", str(tmp_path / "m.txt")]) == 1
    assert "kiln run takes an .onnx, .kir or .so model, not .txt" in capsys.readouterr().err
    assert main(["run", str(tmp_path / "missing.onnx")]) == 3
