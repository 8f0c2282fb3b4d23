"""`kiln.seed(n)` makes ParamIds, and so lazy initial weights (seeded by the ParamId: burn-notes §2.2, "Lazy
creation"), reproducible across runs; without it ids are "random u64s" as Burn makes them (burn-notes §1.6).
And the frontend's ids are `kiln.ParamId`s, shown in Burn's form."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import kiln
from kiln import Flag, Module, ModuleRecord, Param, nn

SCRIPT = """
import json, sys
import kiln
from kiln import nn
if len(sys.argv) > 1:
    kiln.seed(int(sys.argv[1]))
model = nn.Linear(3, 2)
print(json.dumps({"ids": [str(p.id) for _, p in model.leaves()],
                  "weights": [p.val().numpy().tolist() for _, p in model.leaves()]}))
"""


def run(*args: str) -> dict:
    done = subprocess.run([sys.executable, "-c", SCRIPT, *args], capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def test_seeded_runs_make_the_same_ids_and_weights():
    first, second = run("7"), run("7")
    assert first == second and len(first["ids"]) == 2
    assert run("8")["ids"] != first["ids"]


def test_unseeded_runs_make_different_ids_and_weights():
    first, second = run(), run()
    assert first["ids"] != second["ids"] and first["weights"] != second["weights"]


class Net(Module):
    def __init__(self):
        self.fc = nn.Linear(3, 2)


def test_frontend_ids_are_param_ids():
    assert kiln.ParamId is kiln.ir.ParamId and kiln.seed is kiln.ir.seed_param_ids
    assert type(Param.lazy((2,), kiln.ir.Init("zeros")).id) is kiln.ParamId
    assert type(Param.from_data(np.zeros(2), id=5).id) is kiln.ParamId and type(Flag().id) is kiln.ParamId


def test_param_repr_shows_the_id_in_burns_form():
    """burn-notes §1.6: "`Display` is ... e.g. 123456 → `83h0200000000`"."""
    assert repr(Param.from_data(np.zeros(2, np.float32), id=123456)).startswith("Param(83h0200000000, ")


@pytest.mark.parametrize("bad", [-1, 2**64], ids=repr)
def test_a_param_refuses_a_non_u64_id_naming_it(bad):
    with pytest.raises(ValueError, match=f"ParamId {bad} is not a u64"):
        Param.from_data(np.zeros(2), id=bad)
    with pytest.raises(ValueError, match=f"ParamId {bad} is not a u64"):
        Param.lazy((2,), kiln.ir.Init("zeros"), id=bad)


def test_records_read_ids_as_param_ids():
    """Loading takes "the **record's** ParamId" (burn-notes §2.2), a ParamId whether stored or freshly made."""
    net = Net()
    record = ModuleRecord.from_bytes(net.into_record().to_bytes())
    assert all(type(e.param_id) is kiln.ParamId for e in record.values())
    assert {path: str(e.param_id) for path, e in record.items()} == {
        path: str(p.id) for path, p in net.leaves()}
