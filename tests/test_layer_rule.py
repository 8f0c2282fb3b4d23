"""The layer rule, from the module import graph of kiln's source (every import in a file, deferred ones included).

ir imports no other layer (nor TVM/onnx/torch); passes only ir; runtime not frontend; inside runtime, records
import neither TVM nor onnx and onnx does not import TVM; and no module takes part in an import cycle.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = {"kiln": "kiln", "kiln.ir": "ir", "kiln.passes": "passes", "kiln.runtime": "runtime",
                "kiln.frontend": "frontend"}
FORBIDDEN = {
    "kiln.ir": ("kiln.passes", "kiln.runtime", "kiln.frontend", "kiln.cli", "tvm", "tvm_ffi", "onnx", "onnxruntime",
                "torch"),
    "kiln.passes": ("kiln.runtime", "kiln.frontend", "kiln.cli", "tvm", "tvm_ffi", "onnx", "onnxruntime", "torch"),
    "kiln.runtime": ("kiln.frontend", "kiln.cli", "torch"),
    "kiln.runtime.records": ("kiln.runtime.onnx", "kiln.runtime.tvm", "tvm", "tvm_ffi", "onnx", "onnxruntime"),
    "kiln.runtime.onnx": ("kiln.runtime.tvm", "tvm", "tvm_ffi"),
}
# the one exception: the data-parallel engine runs on torch.distributed (issue 14), imported when an engine is made
ALLOWED = {"kiln.runtime.distributed.engine": ("torch",)}


def source_modules(root: Path = ROOT) -> dict[str, Path]:
    """Every kiln module by dotted name, as the package-dir mapping in pyproject.toml installs it."""
    found = {}
    for package, folder in PACKAGE_DIRS.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = [p for p in path.relative_to(root / folder).with_suffix("").parts if p != "__init__"]
            found[".".join([package, *parts])] = path
    return found


class ImportGraph:
    """Which module imports which: `from pkg import name` points at the module that defines `name`."""

    def __init__(self, modules: dict[str, Path]):
        self.modules = modules
        self.trees = {name: ast.parse(path.read_text(), str(path)) for name, path in modules.items()}
        self.graph = nx.DiGraph()
        self.graph.add_nodes_from(modules)
        for name in modules:
            for line, target in self.imports(name):
                if target in modules and not _inside(name, target):  # a parent package runs before its children
                    self.graph.add_edge(name, target, line=line)

    def imports(self, name: str) -> Iterator[tuple[int, str]]:
        """(line, imported module) for every import statement in the module, at any depth."""
        for node in ast.walk(self.trees[name]):
            if isinstance(node, ast.Import):
                yield from ((node.lineno, a.name) for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                source = self._absolute(name, node)
                yield node.lineno, source
                yield from ((node.lineno, self._defining(source, a.name)) for a in node.names if a.name != "*")

    def _is_package(self, name: str) -> bool:
        return name in self.modules and self.modules[name].name == "__init__.py"

    def _absolute(self, name: str, node: ast.ImportFrom) -> str:
        if node.level == 0:
            return node.module or ""
        base = name.split(".") if self._is_package(name) else name.split(".")[:-1]
        base = base[:len(base) - node.level + 1]
        return ".".join([*base, *([node.module] if node.module else [])])

    def _defining(self, source: str, attr: str, seen: frozenset[str] = frozenset()) -> str:
        """The module `from source import attr` really reads: a submodule, or where a package re-exports it from."""
        if f"{source}.{attr}" in self.modules:
            return f"{source}.{attr}"
        if self._is_package(source) and source not in seen:
            for node in self.trees[source].body:
                if isinstance(node, ast.ImportFrom):
                    for alias in node.names:
                        if (alias.asname or alias.name) == attr:
                            return self._defining(self._absolute(source, node), alias.name, seen | {source})
        return source

    def cycles(self) -> list[list[str]]:
        return [sorted(c) for c in nx.strongly_connected_components(self.graph) if len(c) > 1]


@pytest.fixture(scope="module")
def graph() -> ImportGraph:
    return ImportGraph(source_modules())


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layer_imports_only_what_it_may(graph: ImportGraph, layer: str) -> None:
    bad = [f"{graph.modules[name].relative_to(ROOT)}:{line} imports {target}"
           for name in graph.modules if _inside(name, layer)
           for line, target in graph.imports(name)
           if any(_inside(target, f) for f in FORBIDDEN[layer])
           and not any(_inside(target, a) for a in ALLOWED.get(name, ()))]
    assert not bad, "\n".join(bad)


def test_import_kiln_does_not_import_torch() -> None:
    """torch stays out of kiln's core import: only making a data-parallel engine imports it (`kiln[distributed]`)."""
    code = "import sys, kiln, kiln.train, kiln.runtime.distributed; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "False"


def test_no_import_cycles(graph: ImportGraph) -> None:
    def describe(cycle: list[str]) -> str:
        loop = nx.find_cycle(graph.graph.subgraph(cycle))
        return " -> ".join(f"{a} (line {graph.graph.edges[a, b]['line']})" for a, b in loop) + f" -> {loop[0][0]}"

    cycles = graph.cycles()
    assert not cycles, "import cycles:\n" + "\n".join(describe(c) for c in cycles)


def _write(root: Path, files: dict[str, str]) -> dict[str, Path]:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return source_modules(root)


def test_the_rule_sees_deferred_and_re_exported_imports(tmp_path: Path) -> None:
    modules = _write(tmp_path, {
        "kiln/__init__.py": "", "ir/__init__.py": "from .a import A\n", "passes/__init__.py": "",
        "frontend/__init__.py": "",
        "ir/a.py": "A = 1\ndef f():\n    import torch\n    from kiln.ir import b\n",
        "ir/b.py": "from kiln.ir import A\n",
        "runtime/__init__.py": "", "runtime/records/__init__.py": "", "runtime/records/r.py": "from ..tvm import t\n",
        "runtime/tvm/__init__.py": "", "runtime/tvm/t.py": "",
    })
    g = ImportGraph(modules)
    assert ("kiln.ir.a", "kiln.ir.b") in g.graph.edges and ("kiln.ir.b", "kiln.ir.a") in g.graph.edges
    assert g.cycles() == [["kiln.ir.a", "kiln.ir.b"]]
    assert "torch" in {t for _, t in g.imports("kiln.ir.a")}
    assert ("kiln.runtime.records.r", "kiln.runtime.tvm.t") in g.graph.edges
