"""The layer rule: ir imports no other layer (nor TVM/onnx/torch); passes only ir; runtime not frontend."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = {
    "ir": ("kiln.passes", "kiln.runtime", "kiln.frontend", "kiln.cli", "tvm", "onnx", "onnxruntime", "torch"),
    "passes": ("kiln.runtime", "kiln.frontend", "kiln.cli", "tvm", "onnxruntime", "torch"),
    "runtime": ("kiln.frontend", "kiln.cli", "torch"),
}


def imported_modules(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
            if node.module == "kiln":
                found += [(node.lineno, f"kiln.{a.name}") for a in node.names]
    return found


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layer_imports_only_what_it_may(layer: str) -> None:
    bad = [f"{p.relative_to(ROOT)}:{line} imports {mod}"
           for p in sorted((ROOT / layer).rglob("*.py"))
           for line, mod in imported_modules(p)
           if any(mod == f or mod.startswith(f + ".") for f in FORBIDDEN[layer])]
    assert not bad, "\n".join(bad)


def test_the_rule_catches_a_violation(tmp_path: Path) -> None:
    f = tmp_path / "x.py"
    f.write_text("import torch\nfrom kiln import runtime\n")
    assert [m for _, m in imported_modules(f)] == ["torch", "kiln", "kiln.runtime"]
