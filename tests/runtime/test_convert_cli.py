"""`kiln inspect` of safetensors and torch.save files and `kiln convert IN OUT` between burnpack, safetensors and
ONNX initializers (issue 16: "`kiln inspect` reads both formats; `kiln convert IN OUT` converts between burnpack,
safetensors and ONNX initializers"), checked against the tensors torch saved."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from kiln.cli import main
from kiln.runtime.records.record import ModuleRecord

STATE = {"fc.weight": torch.randn(3, 4, generator=torch.Generator().manual_seed(0)), "steps": torch.tensor(3)}


@pytest.fixture
def checkpoint(tmp_path):
    torch.save(STATE, tmp_path / "m.pt")
    return tmp_path / "m.pt"


def test_inspect_lists_a_torch_and_a_safetensors_file(checkpoint, tmp_path, capsys):
    assert main(["inspect", "--json", str(checkpoint)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [(t["name"], t["dtype"], t["shape"], t["bytes"]) for t in report["tensors"]] == [
        ("fc.weight", "f32", [3, 4], 48), ("steps", "i64", [], 8)]
    assert main(["convert", str(checkpoint), str(tmp_path / "m.safetensors")]) == 0
    assert main(["inspect", str(tmp_path / "m.safetensors")]) == 0
    assert "fc.weight" in capsys.readouterr().out


def test_convert_goes_through_every_format_and_keeps_values_and_ids(checkpoint, tmp_path):
    chain = [checkpoint, tmp_path / "a.bpk", tmp_path / "b.onnx", tmp_path / "c.bpk", tmp_path / "d.safetensors"]
    for source, target in zip(chain, chain[1:]):
        assert main(["convert", str(source), str(target)]) == 0
    ids = {k: e.param_id for k, e in ModuleRecord.load(chain[1]).items()}
    assert {k: e.param_id for k, e in ModuleRecord.load(chain[3]).items()} == ids  # burnpack -> ONNX -> burnpack
    final = ModuleRecord.from_safetensors(chain[-1])
    for name, tensor in STATE.items():
        np.testing.assert_array_equal(final[name].array(), tensor.numpy())


def test_convert_refuses_what_it_cannot_write_or_read(checkpoint, tmp_path, capsys):
    assert main(["convert", str(checkpoint), str(tmp_path / "x.pt")]) == 1
    assert main(["convert", str(checkpoint), str(tmp_path / "x.npz")]) == 1
    assert "unknown record extension '.npz'" in capsys.readouterr().err
    assert main(["convert", str(tmp_path / "missing.pt"), str(tmp_path / "x.bpk")]) == 3
    assert not (tmp_path / "x.pt").exists() and not (tmp_path / "x.npz").exists()
