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


def ir_import_graph(root: Path) -> dict[str, set[str]]:
    """Which modules of the package at `root` (kiln.ir) each imports, relative imports resolved, deferred and
    TYPE_CHECKING imports included (a package's own submodules do not import it back implicitly)."""
    def name(p: Path) -> str:
        parts = ["kiln", root.name, *p.relative_to(root).with_suffix("").parts]
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    modules = {name(p): p for p in root.rglob("*.py")}
    edges: dict[str, set[str]] = {}
    for mod, path in modules.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
                found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
        edges[mod] = (found & modules.keys()) - {mod}
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The modules on an import cycle, one list per cycle (strongly connected component of more than one)."""
    reach = {m: set() for m in edges}
    for m in edges:
        stack = list(edges[m])
        while stack:
            n = stack.pop()
            if n not in reach[m]:
                reach[m].add(n)
                stack.extend(edges[n])
    groups = {frozenset({m} | {n for n in reach[m] if m in reach[n]}) for m in edges if m in reach[m]}
    return sorted(sorted(g) for g in groups)


def test_kiln_ir_has_no_import_cycles() -> None:
    found = cycles(ir_import_graph(ROOT / "ir"))
    assert not found, "import cycles in kiln.ir: " + "; ".join(" <-> ".join(c) for c in found)


def test_the_cycle_check_sees_deferred_and_type_checking_imports(tmp_path: Path) -> None:
    pkg = tmp_path / "ir"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from . import sub\n")
    (pkg / "sub" / "__init__.py").write_text("import typing\nif typing.TYPE_CHECKING:\n    from ..a import f\n")
    (pkg / "b.py").write_text("from .a import f\n")
    assert cycles(ir_import_graph(pkg)) == [["kiln.ir.a", "kiln.ir.sub"]]
