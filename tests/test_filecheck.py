"""Runs every `tests/filecheck/**/*.kir` file: each `// RUN:` line through bash with FileCheck, plus a
semantic check that the interpreter agrees before and after the pipeline the RUN line names.

RUN lines use lit's conventions: `%s` is the file, `not CMD` expects CMD to fail. A file holding
`// NO-EQUIVALENCE` (an input that must be rejected) skips the semantic check.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.ir import parse_file
from kiln.passes import PassManager

ROOT = Path(__file__).resolve().parent / "filecheck"
FILES = sorted(ROOT.rglob("*.kir"))
BIN = str(Path(sys.executable).parent)


def run_lines(path: Path) -> list[str]:
    return [m.group(1).strip() for m in re.finditer(r"^// RUN:(.*)$", path.read_text(), re.M)]


@pytest.mark.parametrize("path", FILES, ids=[str(f.relative_to(ROOT)) for f in FILES])
def test_filecheck(path: Path) -> None:
    lines = run_lines(path)
    assert lines, f"{path} has no RUN line"
    env = {**os.environ, "PATH": BIN + os.pathsep + os.environ.get("PATH", "")}
    for line in lines:
        command = 'not() { ! "$@"; }; ' + line.replace("%s", shlex.quote(str(path)))
        proc = subprocess.run(["bash", "-o", "pipefail", "-c", command], capture_output=True, text=True, env=env,
                              timeout=120)
        assert proc.returncode == 0, f"RUN: {line}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    if "NO-EQUIVALENCE" not in path.read_text():
        for line in lines:
            args = shlex.split(line.split("|")[0])
            if args[:3] == ["kiln", "opt", "%s"] and "-p" in args:
                pipeline = args[args.index("-p") + 1]
                PassManager.parse(pipeline, verify_each=True, check_equivalence=True).run(parse_file(str(path)))


def test_the_runner_fails_a_wrong_check(tmp_path: Path) -> None:
    bad = tmp_path / "bad.kir"
    bad.write_text((ROOT / "passes" / "dce.kir").read_text().replace("CHECK-NOT: constant", "CHECK: constant"))
    with pytest.raises(AssertionError):
        test_filecheck(bad)
