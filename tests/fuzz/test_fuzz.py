"""The readers under seeded mutation fuzzing (issue 15): `.kir` parse + verify + passes, burnpack records, ONNX
initializers, compiled-artifact sidecars (byte noise, and structural edits re-signed with the unkeyed digest,
beside an intact library), safetensors and `torch.save` files (issue 16: "truncated and mutated files give only
RecordErrors"), and `kiln.import_onnx` of mutated and structurally edited models, interpreted (issue 15: "ONNX
import"). Each target runs for FUZZ_SECONDS (KILN_FUZZ_SECONDS; the checkpoint readers half of it) or
KILN_FUZZ_ITERATIONS inputs
in its own process with a capped address space; only kiln's error types may escape, and no input may run over
10 s."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

FUZZ = Path(__file__).with_name("fuzz.py")
SECONDS = float(os.environ.get("KILN_FUZZ_SECONDS", "4"))  # per target in CI: the same seeds, a shorter run
ITERATIONS = int(os.environ.get("KILN_FUZZ_ITERATIONS", "1000000000"))
SEED = int(os.environ.get("KILN_FUZZ_SEED", "1"))
SHARE = {"safetensors": 0.5, "pytorch": 0.5}  # small readers: half the time each keeps the suite in CI's budget


@pytest.mark.parametrize("target", ["kir", "burnpack", "onnx", "onnx_import", "sidecar", "safetensors", "pytorch"])
def test_only_kiln_errors_escape_a_reader(target: str) -> None:
    seconds = SECONDS * SHARE.get(target, 1.0)
    done = subprocess.run([sys.executable, str(FUZZ), target, str(SEED), str(seconds), str(ITERATIONS)],
                          capture_output=True, text=True, timeout=SECONDS + 300)
    lines = done.stdout.strip().splitlines()
    assert lines, done.stderr[-3000:]
    summary = json.loads(lines[-1])
    assert done.returncode == 0 and "escaped" not in summary, summary
    assert summary["inputs"] >= 20 and summary["kiln_errors"] > 0, summary  # it exercised the error paths
    assert not Path(summary["folder"]).exists(), "a run without a finding leaves no scratch folder behind"
