"""Fixtures shared by the runtime tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.runtime import compile_cache


@pytest.fixture
def cache_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty compile-cache directory and an empty in-memory cache for one test."""
    root = tmp_path / "cache"
    monkeypatch.setenv(compile_cache.CACHE_ENV, str(root))
    compile_cache.clear_memory()
    yield root
    compile_cache.clear_memory()
