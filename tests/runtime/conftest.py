"""Fixtures shared by the runtime tests."""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kiln.runtime.tvm import artifact, compile_cache
from kiln.runtime.tvm.schedules.safe import DEBUG_ENV


@pytest.fixture
def cache_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty compile-cache directory and an empty in-memory cache for one test."""
    root = tmp_path / "cache"
    monkeypatch.setenv(compile_cache.CACHE_ENV, str(root))
    compile_cache.clear_memory()
    yield root
    compile_cache.clear_memory()


@pytest.fixture(scope="module")
def module_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Builds of one test module go to a scratch cache of its own, and a schedule rule that raises fails the test
    instead of falling back (`pytestmark = pytest.mark.usefixtures("module_cache")`)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(compile_cache.CACHE_ENV, str(tmp_path_factory.mktemp("cache")))
        mp.setenv(DEBUG_ENV, "1")
        compile_cache.clear_memory()
        yield
    compile_cache.clear_memory()


def _restamp(library: Path, fmt: str) -> None:
    """Rewrite `library`'s sidecar as another kiln version would have: format `fmt`, with a valid digest."""
    sidecar = Path(f"{library}{artifact.SIDECAR}")
    payload = json.loads(sidecar.read_text())
    del payload["sidecar_sha256"]
    payload["format"] = fmt
    sidecar.write_text(json.dumps({**payload, "sidecar_sha256": artifact._payload_digest(payload)}))


@pytest.fixture
def failing_fsync(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every fsync fails as a dying disk's would, so a write that goes through `kiln.runtime.atomic` fails before
    its rename."""

    def fail(descriptor: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fsync", fail)


@pytest.fixture
def restamp_sidecar() -> Callable[[Path, str], None]:
    """`restamp(library, format)`: make an intact artifact claim another artifact format."""
    return _restamp
