"""Runs every `tests/filecheck/**/*.kir` file: each `// RUN:` line through bash with FileCheck, plus a
semantic check that the interpreter agrees before and after the pipeline the RUN line names.

RUN lines use lit's conventions: `%s` is the file, `not CMD` expects CMD to fail; `filecheck` is the Python
FileCheck of the running interpreter (`python -m filecheck`), so no console script needs to be on PATH. A file
holding `// NO-EQUIVALENCE` (an input that must be rejected) skips the semantic check.

Checks follow xDSL's and MLIR's style: every check prefix a RUN line uses anchors its blocks with
`<PREFIX>-LABEL:` (the function, module or error line being checked), then pins consecutive output with
`-NEXT:` and absences with `-NOT:`. `test_filecheck` enforces the label so new files keep the style.
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
PRELUDE = f'not() {{ ! "$@"; }}; filecheck() {{ {shlex.quote(sys.executable)} -m filecheck "$@"; }}; '


def run_lines(path: Path) -> list[str]:
    return [m.group(1).strip() for m in re.finditer(r"^// RUN:(.*)$", path.read_text(), re.M)]


def check_prefixes(line: str) -> list[str]:
    """The check prefixes the FileCheck invocation of a RUN line uses (`CHECK` unless it names others)."""
    if "filecheck" not in line:
        return []
    args = shlex.split(line.split("filecheck", 1)[1])
    prefixes: list[str] = []
    for i, arg in enumerate(args):
        for option in ("--check-prefix", "--check-prefixes"):
            if arg == option and i + 1 < len(args):
                prefixes.extend(args[i + 1].split(","))
            elif arg.startswith(option + "="):
                prefixes.extend(arg.split("=", 1)[1].split(","))
    return prefixes or ["CHECK"]


def missing_labels(path: Path) -> list[str]:
    """Prefixes used by the file's RUN lines that have no `// <PREFIX>-LABEL:` line in the file."""
    text = path.read_text()
    used = dict.fromkeys(p for line in run_lines(path) for p in check_prefixes(line))
    return [p for p in used if not re.search(rf"^// {re.escape(p)}-LABEL:", text, re.M)]


@pytest.mark.parametrize("path", FILES, ids=[str(f.relative_to(ROOT)) for f in FILES])
def test_filecheck(path: Path) -> None:
    lines = run_lines(path)
    assert lines, f"{path} has no RUN line"
    assert any(check_prefixes(line) for line in lines), f"{path}: no RUN line pipes into filecheck"
    missing = missing_labels(path)
    assert not missing, f"{path}: no {', '.join(p + '-LABEL' for p in missing)} line (anchor each block on a label)"
    env = {**os.environ, "PATH": BIN + os.pathsep + os.environ.get("PATH", "")}
    for line in lines:
        command = PRELUDE + line.replace("%s", shlex.quote(str(path)))
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
    """A CHECK-NEXT that does not hold (dce keeping the dead exp) fails the file."""
    text = (ROOT / "passes" / "dce.kir").read_text()
    live = "// CHECK-NEXT:    %live = tanh"
    wrong = text.replace(live, "// CHECK-NEXT:    %dead = exp %unused\n" + live)
    assert wrong != text
    bad = tmp_path / "bad.kir"
    bad.write_text(wrong)
    with pytest.raises(AssertionError, match="RUN:"):
        test_filecheck(bad)


def test_the_runner_fails_a_file_without_labels(tmp_path: Path) -> None:
    """Checks not anchored on a LABEL are refused, for every prefix the RUN lines use."""
    text = (ROOT / "passes" / "fold-constants.kir").read_text()
    bad = tmp_path / "unlabeled.kir"
    bad.write_text(text.replace("// SMALL-LABEL:", "// SMALL:"))
    with pytest.raises(AssertionError, match="no SMALL-LABEL line"):
        test_filecheck(bad)


@pytest.mark.parametrize(("line", "prefixes"), [
    ("kiln opt %s -p dce | filecheck %s", ["CHECK"]),
    ("kiln opt %s | filecheck %s --check-prefix=NONE", ["NONE"]),
    ("kiln opt %s | filecheck %s --check-prefix NONE", ["NONE"]),
    ("kiln opt %s | filecheck %s --check-prefixes=A,B", ["A", "B"]),
    ("kiln opt %s -o out.kir", []),
])
def test_check_prefixes(line: str, prefixes: list[str]) -> None:
    assert check_prefixes(line) == prefixes
