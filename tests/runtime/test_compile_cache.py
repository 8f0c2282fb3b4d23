"""The compile cache (memory and disk, atomic checksummed entries, damage detected and rebuilt) and exported
libraries loaded by a fresh process, including one written by `kiln compile`."""

from __future__ import annotations

import functools
import json
import logging
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import kiln
from kiln import nn
from kiln.cli import main as cli_main
from kiln.ir import Builder, Graph, Init, interpret, print_graph
from kiln.runtime.tvm import artifact, compile_cache
from kiln.runtime.tvm.artifact import PARAMS, SIDECAR, CorruptArtifact, file_digest, read_sidecar
from kiln.runtime.tvm.compile import cache_key, compile_graph
from kiln.runtime.tvm.executable import load_executable
from kiln.runtime.tvm.target import resolve_target

pytestmark = pytest.mark.usefixtures("cache_root")  # every test gets an empty compile cache


def transformer_graph() -> Graph:
    """A traced transformer block with fixed weights, so every process builds the same key."""
    graph = kiln.trace(nn.TransformerEncoderLayer(64, 4, 128).valid(), ((None, 16, 64), "f32"))
    rng = np.random.default_rng(0)
    params = {n: p.replace(data=rng.normal(0, 0.2, p.type.shape).astype(np.float32)) for n, p in graph.params.items()}
    return graph.replace(params=params)


def small_graph() -> Graph:
    b = Builder("Small")
    x = b.input("x", ((None, 8), "f32"))
    w = b.param("w", (8, 4), id=7, data=np.linspace(-1, 1, 32, dtype=np.float32).reshape(8, 4))
    b.ret(b.softmax(b.linear(x, w)))
    return b.build()


def run_python(code: str, cache: Path) -> dict:
    """Run `code` in a fresh interpreter with this cache; it prints one JSON object last."""
    env = {**os.environ, compile_cache.CACHE_ENV: str(cache)}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def entry_files(cache: Path) -> list[str]:
    return sorted(os.listdir(cache / "compile"))


def test_a_second_process_loads_the_cached_build_in_well_under_a_second(tmp_path: Path, cache_root: Path) -> None:
    graph = transformer_graph()
    (tmp_path / "block.kir").write_text(print_graph(graph))
    x = np.random.default_rng(1).standard_normal((2, 16, 64)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    start = time.perf_counter()
    compile_graph(graph)
    cold = time.perf_counter() - start
    report = run_python(f"""
        import json, time
        import numpy as np
        import kiln.runtime.tvm.compile as compile_module
        from kiln.ir import parse_file

        def no_build(*args, **kwargs):
            raise AssertionError("the cache missed: a build was attempted")

        compile_module.build = no_build
        graph = parse_file({str(tmp_path / "block.kir")!r})
        start = time.perf_counter()
        exe = compile_module.compile_graph(graph)
        seconds = time.perf_counter() - start
        np.save({str(tmp_path / "y.npy")!r}, exe(np.load({str(tmp_path / "x.npy")!r})))
        print(json.dumps({{"seconds": seconds}}))
    """, cache_root)
    assert report["seconds"] < 0.5, (report, cold)
    assert report["seconds"] < cold / 2
    want = interpret(graph, [x])[0]
    np.testing.assert_allclose(np.load(tmp_path / "y.npy"), want, rtol=3e-3, atol=3e-3 * float(np.abs(want).max()))


def test_entries_are_written_atomically_with_checksums(cache_root: Path) -> None:
    graph = small_graph()
    compile_graph(graph)
    key = cache_key(graph, ("forward",), resolve_target("llvm"), "bound", True)
    assert entry_files(cache_root) == [f"{key}.so", f"{key}.so{SIDECAR}"]  # no temporary files left behind
    sidecar = read_sidecar(str(cache_root / "compile" / f"{key}.so"))
    assert sidecar["key"] == key
    assert sidecar["library_sha256"] == file_digest(str(cache_root / "compile" / f"{key}.so"))
    # issue 15: the cache folder is created 0700 (loading a library from it runs native code)
    assert (cache_root / "compile").stat().st_mode & 0o777 == 0o700


def test_a_failing_store_keeps_the_old_entry_and_leaves_no_temporary(cache_root: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    graph = small_graph()
    compile_graph(graph)
    key = cache_key(graph, ("forward",), resolve_target("llvm"), "bound", True)
    before = {name: (cache_root / "compile" / name).read_bytes() for name in entry_files(cache_root)}
    program, _ = compile_cache.lookup(key)

    def export(tmp: str) -> None:
        Path(tmp).write_bytes(b"half a library")
        raise RuntimeError("the linker died")

    compile_cache.store(key, program, export)
    assert "could not write entry" in caplog.text and "the linker died" in caplog.text
    assert {name: (cache_root / "compile" / name).read_bytes() for name in entry_files(cache_root)} == before


def _replace(path: Path, data: bytes) -> None:
    """Put damaged bytes at `path` as a new file: rewriting a shared object this process has mapped in place
    would corrupt its running code (a crash at exit), which is not the damage under test."""
    tmp = path.with_suffix(path.suffix + ".damaged")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _truncate(path: Path) -> None:
    _replace(path, path.read_bytes()[: path.stat().st_size // 2])


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    _replace(path, bytes(data))


def _json_array(path: Path) -> None:
    _replace(path, b"[1, 2, 3]")


def _deeply_nested(path: Path) -> None:
    _replace(path, b"[" * 100_000 + b"]" * 100_000)


def _digest_ok_but_no_functions(path: Path) -> None:
    """A sidecar whose (unkeyed) digest matches but that lacks a field the loader reads."""
    payload = json.loads(path.read_bytes())
    payload.pop("sidecar_sha256")
    payload.pop("functions")
    payload["sidecar_sha256"] = artifact._payload_digest(payload)
    _replace(path, json.dumps(payload).encode())


def _link_to_dev_zero(path: Path) -> None:
    """A link that would make a reader hash an endless file (a hang before)."""
    path.unlink()
    path.symlink_to("/dev/zero")


DAMAGES = [("library", _truncate), ("library", _flip_a_byte), ("sidecar", _truncate), ("sidecar", _flip_a_byte),
           ("sidecar", _json_array), ("sidecar", _deeply_nested), ("sidecar", _digest_ok_but_no_functions),
           ("library", _link_to_dev_zero), ("sidecar", _link_to_dev_zero)]


@pytest.mark.parametrize(("victim", "damage"), DAMAGES,
                         ids=["truncated-library", "altered-library", "truncated-sidecar", "altered-sidecar",
                              "array-sidecar", "nested-sidecar", "incomplete-sidecar", "library-link",
                              "sidecar-link"])
def test_a_damaged_entry_is_detected_rebuilt_and_replaced(cache_root: Path, victim: str, damage,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    graph = small_graph()
    x = np.random.default_rng(2).standard_normal((3, 8)).astype(np.float32)
    compile_graph(graph)
    (library,) = (cache_root / "compile").glob("*.so")
    before = library.read_bytes()
    damage(library if victim == "library" else Path(str(library) + SIDECAR))
    compile_cache.clear_memory()  # as a new process would: only the disk entry is left
    with caplog.at_level(logging.WARNING, logger=compile_cache.__name__):
        exe = compile_graph(graph)
    assert "not using entry" in caplog.text
    np.testing.assert_allclose(exe(x), interpret(graph, [x])[0], rtol=1e-5, atol=1e-6)
    assert read_sidecar(str(library))["library_sha256"] == file_digest(str(library))  # replaced by a good entry
    assert library.stat().st_size == len(before)
    compile_cache.clear_memory()
    with caplog.at_level(logging.WARNING, logger=compile_cache.__name__):
        caplog.clear()
        compile_graph(graph)
    assert not caplog.text  # the replacement is used as it is


def test_an_entry_of_an_older_artifact_format_is_rebuilt_not_trusted(
        cache_root: Path, caplog: pytest.LogCaptureFixture, restamp_sidecar: Callable[[Path, str], None]) -> None:
    """An entry whose sidecar is intact but names an older format (same key: the lowering did not change)."""
    graph = small_graph()
    compile_graph(graph)
    (library,) = (cache_root / "compile").glob("*.so")
    restamp_sidecar(library, "kiln-executable/1")
    compile_cache.clear_memory()
    with caplog.at_level(logging.WARNING, logger=compile_cache.__name__):
        exe = compile_graph(graph)
    assert "format 'kiln-executable/1'" in caplog.text
    x = np.random.default_rng(4).standard_normal((2, 8)).astype(np.float32)
    np.testing.assert_allclose(exe(x), interpret(graph, [x])[0], rtol=1e-5, atol=1e-6)
    assert read_sidecar(str(library))["format"] == artifact.FORMAT  # replaced by an entry of the current format


def test_bound_builds_key_on_weights_and_input_builds_do_not() -> None:
    graph = small_graph()
    other = graph.replace(params={"w": graph.params["w"].replace(data=graph.params["w"].data * 2)})
    lazy = graph.replace(params={"w": graph.params["w"].replace(data=None, init=Init("zeros"))})
    relabeled = graph.replace(params={"w": lazy.params["w"].replace(id=8)})
    target = resolve_target("llvm")

    def key(g: Graph, params: str) -> str:
        return cache_key(g, ("forward",), target, params, True)

    assert key(graph, "bound") != key(other, "bound")
    assert key(lazy, "bound") != key(relabeled, "bound")  # a lazy weight is seeded by its ParamId
    assert key(graph, "inputs") == key(other, "inputs")
    assert key(graph, "bound") != key(graph, "inputs")


def test_exported_libraries_load_and_run_in_a_fresh_process(tmp_path: Path, cache_root: Path) -> None:
    """A bound build, an inputs build (weights stored beside it) and one from `kiln compile` on a .kir file."""
    rng = np.random.default_rng(3)
    small = small_graph()
    block = transformer_graph()
    kir = tmp_path / "small.kir"
    kir.write_text(print_graph(small))
    compile_graph(small).export_library(str(tmp_path / "bound.so"))
    compile_graph(block, params="inputs").export_library(str(tmp_path / "inputs.so"))
    assert cli_main(["compile", str(kir), "--target", "llvm", "-o", str(tmp_path / "cli.so")]) == 0
    cases = {"bound": (small, (5, 8)), "inputs": (block, (2, 16, 64)), "cli": (small, (1, 8))}
    for name, (_, shape) in cases.items():
        np.save(tmp_path / f"{name}-x.npy", rng.standard_normal(shape).astype(np.float32))
    run_python(f"""
        import json
        import numpy as np
        import kiln.runtime

        for name in {list(cases)!r}:
            exe = kiln.runtime.load_executable(f"{tmp_path}/{{name}}.so")
            np.save(f"{tmp_path}/{{name}}-y.npy", exe(np.load(f"{tmp_path}/{{name}}-x.npy")))
        print(json.dumps({{}}))
    """, tmp_path / "unused-cache")
    for name, (graph, _) in cases.items():
        x = np.load(tmp_path / f"{name}-x.npy")
        want = interpret(graph, [x])[0]
        np.testing.assert_allclose(np.load(tmp_path / f"{name}-y.npy"), want, rtol=3e-3,
                                   atol=3e-3 * float(np.abs(want).max()), err_msg=name)
    assert (tmp_path / f"inputs.so{PARAMS}").exists() and not (tmp_path / f"bound.so{PARAMS}").exists()


def test_loading_a_library_that_does_not_match_its_sidecar_fails_cleanly(tmp_path: Path) -> None:
    path = tmp_path / "m.so"
    compile_graph(small_graph()).export_library(str(path))
    reloaded = load_executable(str(path))
    reloaded.export_library(str(tmp_path / "copy.so"))  # a loaded library re-exports by copying its file
    assert file_digest(str(tmp_path / "copy.so")) == file_digest(str(path))
    _flip_a_byte(path)
    with pytest.raises(CorruptArtifact, match="checksum mismatch"):
        load_executable(str(path))


def test_a_lazy_parameters_id_keys_by_value_whatever_its_python_type() -> None:
    """A lazy parameter is bound by its ParamId (its init's seed): an id equal as an int gives the same key."""
    b = Builder("M")
    w = b.param("w", (2,), id=5, init=Init("normal"))
    b.ret(b.op("add", b.input("x", ((2,), "f32")), w))
    graph = b.build()
    key = functools.partial(cache_key, functions=("forward",), target=resolve_target("llvm"), params="bound",
                            fast_math=True)
    as_int = graph.replace(params={"w": graph.params["w"].replace(id=5)})
    assert type(graph.params["w"].id) is kiln.ParamId and type(as_int.params["w"].id) is int
    assert key(as_int) == key(graph) != key(graph.replace(params={"w": graph.params["w"].replace(id=6)}))


def scaled_graph(scale: float) -> Graph:
    """small_graph with its weights scaled: another bound build, so another entry."""
    graph = small_graph()
    w = graph.params["w"]
    return graph.replace(params={"w": w.replace(data=(w.data * np.float32(scale)).astype(np.float32))})


def test_the_disk_cache_evicts_the_least_recently_used_entries_beyond_its_bound(
        cache_root: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """issue 15: the cache grew without bound. A bound of two entries keeps the two most recently used: a hit
    counts as a use, so after A, B, a hit on A and a build of C, B is the one that left."""
    a, b, c = (scaled_graph(s) for s in (1.0, 2.0, 3.0))
    compile_graph(a)
    size = sum(e.bytes for e in compile_cache.disk_entries())
    monkeypatch.setenv(compile_cache.MAX_BYTES_ENV, str(2 * size + size // 2))
    compile_graph(b)
    keys = {name: e.key for name, e in zip("ab", compile_cache.disk_entries())}
    compile_cache.clear_memory()  # as a new process: the next build of A is a disk hit
    time.sleep(0.01)
    compile_graph(a)
    with caplog.at_level(logging.INFO, logger=compile_cache.__name__):
        compile_graph(c)
    left = {e.key for e in compile_cache.disk_entries()}
    assert keys["a"] in left and keys["b"] not in left and len(left) == 2
    assert f"evicted {keys['b']}" in caplog.text
    assert not any(name.startswith(keys["b"]) for name in entry_files(cache_root))  # library and sidecar both


def test_a_malformed_bound_is_reported_and_the_build_still_stands(
        cache_root: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv(compile_cache.MAX_BYTES_ENV, "4GB")
    x = np.ones((2, 8), np.float32)
    with caplog.at_level(logging.WARNING, logger=compile_cache.__name__):
        exe = compile_graph(small_graph())
    assert "KILN_CACHE_MAX_BYTES='4GB' is not a byte count" in caplog.text
    np.testing.assert_allclose(exe(x), interpret(small_graph(), [x])[0], rtol=1e-5, atol=1e-6)


def test_kiln_cache_reports_prunes_and_clears(cache_root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for scale in (1.0, 2.0):
        compile_graph(scaled_graph(scale))
    total = sum(e.bytes for e in compile_cache.disk_entries())
    assert cli_main(["cache", "info"]) == 0
    assert f": 2 entries, {total:,} bytes" in capsys.readouterr().out
    assert cli_main(["cache", "prune", "--max-bytes", str(total - 1)]) == 0
    assert "removed 1 entries" in capsys.readouterr().out and len(compile_cache.disk_entries()) == 1
    assert cli_main(["cache", "clear"]) == 0
    assert ": 0 entries, 0 bytes" in capsys.readouterr().out and entry_files(cache_root) == []


def test_a_cold_compile_runs_the_library_it_stored(cache_root: Path) -> None:
    """The executable of a cold compile calls the library written to the cache, loaded back (a built LLVM module
    generates its machine code again at its first call: 8 s for ResNet-50, issue 13), and computes the same."""
    graph = small_graph()
    exe = compile_graph(graph)
    key = cache_key(graph, ("forward",), resolve_target("llvm"), "bound", True)
    program, path = compile_cache.lookup(key)
    assert path == str(cache_root / "compile" / f"{key}.so") and exe.program is program
    x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    np.testing.assert_allclose(exe(x), interpret(graph, [x])[0], rtol=1e-5, atol=1e-6)
