"""The compiler's version in cache keys follows its source: any edit, new file or rename changes it; a copy of the
same tree elsewhere does not."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import kiln
from kiln import nn
from kiln.runtime.tvm import compile as compile_module
from kiln.runtime.tvm.source_digest import compiler_roots, compiler_version, source_digest
from kiln.runtime.tvm.target import resolve_target


def _tree(root: Path) -> Path:
    (root / "tvm").mkdir(parents=True)
    (root / "lower.py").write_text("RULE = 1\n")
    (root / "tvm" / "conv.py").write_text("TILE = 4\n")
    (root / "tvm" / "notes.txt").write_text("not source\n")
    return root


def test_the_digest_changes_with_an_edit_a_new_file_and_a_rename(tmp_path: Path) -> None:
    root = _tree(tmp_path / "a")
    before = source_digest([("kiln.runtime", root)])
    (root / "tvm" / "conv.py").write_text("TILE = 8\n")
    edited = source_digest([("kiln.runtime", root)])
    (root / "tvm" / "pool.py").write_text("")
    added = source_digest([("kiln.runtime", root)])
    (root / "tvm" / "pool.py").rename(root / "tvm" / "pools.py")
    renamed = source_digest([("kiln.runtime", root)])
    assert len({before, edited, added, renamed}) == 4


def test_the_digest_ignores_where_the_tree_lives_and_files_that_are_not_source(tmp_path: Path) -> None:
    root = _tree(tmp_path / "a")
    copy = tmp_path / "elsewhere" / "b"
    shutil.copytree(root, copy)
    (copy / "tvm" / "notes.txt").write_text("edited notes\n")
    assert source_digest([("kiln.runtime", root)]) == source_digest([("kiln.runtime", copy)])
    assert source_digest([("kiln.runtime", root)]) != source_digest([("kiln.passes", root)])


def test_the_compile_cache_key_changes_with_the_digest_of_the_installed_layers(monkeypatch: pytest.MonkeyPatch
                                                                                 ) -> None:
    assert [name for name, _ in compiler_roots()] == ["kiln.ir", "kiln.passes", "kiln.runtime"]
    assert compiler_version() == source_digest(compiler_roots())
    graph = kiln.trace(nn.Linear(4, 3).valid(), ((2, 4), "f32"))

    def key() -> str:
        return compile_module.cache_key(graph, ("forward",), resolve_target("llvm"), "bound", True)

    before = key()
    monkeypatch.setattr(compile_module, "compiler_version", lambda: "an edited compiler")
    assert key() != before
