"""Exported artifacts of `params="inputs"` builds: weights in a checksummed burnpack `<lib>.bpk`, every dtype kept
(on LLVM and, with a GPU, CUDA builds), damage and older formats refused, and the file readable by kiln's burnpack
reader and `kiln inspect`."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from kiln.cli import main as cli_main
from kiln.ir import Builder, DType, Graph, KilnError, interpret
from kiln.runtime.records.burnpack_io import BurnpackFile
from kiln.runtime.tvm import artifact
from kiln.runtime.tvm.artifact import PARAMS, SIDECAR, CorruptArtifact
from kiln.runtime.tvm.compile import compile_graph
from kiln.runtime.tvm.dtypes import to_storage
from kiln.runtime.tvm.executable import load_executable

pytestmark = pytest.mark.usefixtures("cache_root")

# parameter -> (kiln dtype, burnpack dtype of its TVM storage, shape)
STORED = {"w32": ("f32", "F32", (4, 3)), "w16": ("f16", "F16", (4, 3)), "wbf": ("bf16", "BF16", (4, 3)),
          "codes": ("i4", "I8", (4, 3)), "scale": ("f32", "F32", (1,)), "mask": ("bool", "Bool(Native)", (3,))}


def mixed_graph() -> Graph:
    """A function whose weights are f32, f16, bf16, i4 quantization codes and a bool mask."""
    rng = np.random.default_rng(0)
    b = Builder("Mixed")
    x = b.input("x", ((None, 4), "f32"))
    w32 = b.param("w32", (4, 3), data=rng.standard_normal((4, 3)).astype(np.float32))
    w16 = b.param("w16", (4, 3), "f16", data=rng.standard_normal((4, 3)).astype(np.float16))
    wbf = b.param("wbf", (4, 3), "bf16", data=rng.standard_normal((4, 3)).astype(ml_dtypes.bfloat16))
    codes = b.param("codes", (4, 3), "i4", data=rng.integers(-8, 8, (4, 3)).astype(ml_dtypes.int4))
    scale = b.param("scale", (1,), data=np.array([0.05], np.float32))
    mask = b.param("mask", (3,), "bool", data=np.array([True, False, True]))
    y = b.add(b.linear(x, w32), b.cast(b.linear(b.cast(x, dtype=DType.f16), w16), dtype=DType.f32))
    y = b.add(y, b.cast(b.linear(b.cast(x, dtype=DType.bf16), wbf), dtype=DType.f32))
    y = b.add(y, b.linear(x, b.dequantize(codes, scale, value="q4f")))
    b.ret(b.where(mask, y, b.neg(y)))
    return b.build()


def export_mixed(directory: Path, target: str = "llvm") -> Path:
    """The mixed graph built for `target` with `params="inputs"`, exported as `<directory>/out/m.so`."""
    path = directory / "out" / "m.so"
    path.parent.mkdir(exist_ok=True)
    compile_graph(mixed_graph(), target=target, params="inputs").export_library(str(path))
    return path


@pytest.fixture
def exported(tmp_path: Path) -> tuple[Graph, Path]:
    """The mixed graph and its LLVM build's artifact."""
    return mixed_graph(), export_mixed(tmp_path)


def test_weights_of_every_dtype_round_trip_through_the_burnpack(tmp_path: Path, target: str) -> None:
    graph, path = mixed_graph(), export_mixed(tmp_path, target)
    assert sorted(p.name for p in path.parent.iterdir()) == ["m.so", f"m.so{PARAMS}", f"m.so{SIDECAR}"]  # no temps
    x = np.random.default_rng(1).standard_normal((5, 4)).astype(np.float32)
    loaded = load_executable(str(path))
    for name, param in graph.params.items():
        assert loaded._params[name].dtype == param.type.dtype.numpy
        np.testing.assert_array_equal(loaded._params[name].view(np.uint8), param.data.view(np.uint8), err_msg=name)
    want = interpret(graph, [x])[0]
    np.testing.assert_array_equal(loaded(x), compile_graph(graph, target=target, params="inputs")(x))
    np.testing.assert_allclose(loaded(x), want, rtol=2e-2, atol=2e-2 * float(np.abs(want).max()))  # f16/bf16 matmuls
    loaded.export_library(str(path.parent / "again.so"))  # its weights are read-only views of the bytes read
    assert Path(f"{path.parent}/again.so{PARAMS}").read_bytes() == Path(f"{path}{PARAMS}").read_bytes()


def test_the_weights_file_is_a_burnpack_with_the_signature_names(exported: tuple[Graph, Path]) -> None:
    graph, path = exported
    with BurnpackFile.open(f"{path}{PARAMS}") as pack:
        assert {n: (str(e.dtype), e.shape) for n, e in pack.entries.items()} == {
            n: (burn, shape) for n, (_, burn, shape) in STORED.items()}
        for name, param in graph.params.items():
            np.testing.assert_array_equal(pack.array(name), to_storage(param.data, param.type.dtype), err_msg=name)


def test_kiln_inspect_lists_the_weights(exported: tuple[Graph, Path], capsys: pytest.CaptureFixture[str]) -> None:
    _, path = exported
    assert cli_main(["inspect", f"{path}{PARAMS}", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {t["name"]: (t["dtype"], tuple(t["shape"])) for t in report["tensors"]} == {
        n: (burn, shape) for n, (_, burn, shape) in STORED.items()}


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # inside the last tensor's bytes: still a well-formed burnpack, so only the checksum can tell
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.mark.parametrize(("damage", "reason"), [(_flip_a_byte, "checksum mismatch"), (_truncate, "checksum mismatch"),
                                                (Path.unlink, "unreadable weights")],
                         ids=["altered", "truncated", "deleted"])
def test_a_damaged_weights_file_is_refused_naming_it(exported: tuple[Graph, Path], damage: Callable[[Path], None],
                                                    reason: str) -> None:
    _, path = exported
    damage(Path(f"{path}{PARAMS}"))
    with pytest.raises(CorruptArtifact, match=re.escape(f"{path}{PARAMS}: {reason}")):
        load_executable(str(path))


def test_an_artifact_of_the_older_format_is_refused(exported: tuple[Graph, Path],
                                                    restamp_sidecar: Callable[[Path, str], None]) -> None:
    _, path = exported
    restamp_sidecar(path, "kiln-executable/1")
    with pytest.raises(CorruptArtifact, match="format 'kiln-executable/1'.*rebuild or re-export"):
        load_executable(str(path))


def test_a_storage_dtype_burnpack_cannot_hold_is_refused_before_writing(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    exe = compile_graph(mixed_graph(), params="inputs")
    monkeypatch.setattr(artifact, "storage_numpy", lambda dtype: np.dtype(np.complex64))
    with pytest.raises(KilnError, match="param @w32: storage dtype complex64 .of f32. has no burnpack dtype"):
        exe.export_library(str(tmp_path / "m.so"))
    assert not Path(f"{tmp_path}/m.so{PARAMS}").exists() and not Path(f"{tmp_path}/m.so{SIDECAR}").exists()


def test_a_failing_rewrite_leaves_the_artifact_whole(exported: tuple[Graph, Path]) -> None:
    _, path = exported
    before = {p.name: p.read_bytes() for p in path.parent.iterdir()}
    program, _ = artifact.load_program(str(path))

    def export(tmp: str) -> None:
        Path(tmp).write_bytes(b"half a library")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        artifact.write_artifact(str(path), program, export)
    assert {p.name: p.read_bytes() for p in path.parent.iterdir()} == before


def test_an_artifact_that_cannot_be_made_durable_is_not_written(tmp_path: Path,
                                                                request: pytest.FixtureRequest) -> None:
    exe = compile_graph(mixed_graph(), params="inputs")
    (tmp_path / "out").mkdir()
    request.getfixturevalue("failing_fsync")
    with pytest.raises(OSError, match="Input/output error"):
        exe.export_library(str(tmp_path / "out" / "m.so"))
    assert list((tmp_path / "out").iterdir()) == []


@pytest.fixture(scope="module")
def small_library(tmp_path_factory: pytest.TempPathFactory) -> tuple[bytes, bytes]:
    """The bytes of a small exported library and its sidecar, built once."""
    b = Builder("Tiny")
    x = b.input("x", ((2,), "f32"))
    b.ret(b.add(x, x))
    folder = tmp_path_factory.mktemp("tiny")
    compile_graph(b.build(), cache=False).export_library(str(folder / "m.so"))
    return (folder / "m.so").read_bytes(), (folder / f"m.so{SIDECAR}").read_bytes()


@pytest.mark.parametrize("folder_mode, file_mode, trusted", [
    (0o755, 0o644, True), (0o777, 0o644, False), (0o1777, 0o644, True), (0o775, 0o644, False),
    (0o755, 0o666, False), (0o755, 0o664, False)],
    ids=["private", "world-writable-folder", "sticky-folder", "group-writable-folder", "world-writable-file",
         "group-writable-file"])
def test_a_library_others_could_replace_is_not_loaded(tmp_path: Path, small_library, folder_mode: int,
                                                      file_mode: int, trusted: bool) -> None:
    """issue 15: loading a .so runs native code and the checksums are unkeyed, so a library (or sidecar) that
    another user can write, or swap through its folder, is refused; a sticky folder (as /tmp) protects our files."""
    library, sidecar = small_library
    folder = tmp_path / "shared"
    folder.mkdir()
    (folder / "m.so").write_bytes(library)
    (folder / f"m.so{SIDECAR}").write_bytes(sidecar)
    for f in folder.iterdir():
        f.chmod(file_mode)
    folder.chmod(folder_mode)
    try:
        if trusted:
            np.testing.assert_array_equal(load_executable(str(folder / "m.so"))(np.ones(2, np.float32)), [2, 2])
        else:
            with pytest.raises(artifact.UntrustedArtifact, match="writable by other users"):
                load_executable(str(folder / "m.so"))
    finally:
        folder.chmod(0o755)


QUIET_SCRIPT = """
import sys
import numpy as np
from kiln.ir import Builder
from kiln.runtime.tvm.compile import compile_graph
from kiln.runtime.tvm.executable import load_executable
b = Builder("Quiet")
x = b.input("x", ((3,), "f32"))
b.ret(b.add(x, b.param("w", (3,), data=np.ones(3, np.float32))))
compile_graph(b.build(), params="inputs").export_library(sys.argv[1])
print(load_executable(sys.argv[1])(np.ones(3, np.float32)).sum())
"""


def test_export_and_load_print_nothing_but_the_result(tmp_path: Path) -> None:
    """issue 15: "TVM's "Scope Saving/Loaded" warnings print on every export/load (silence them)": a fresh process
    that builds, exports and loads a library writes nothing to stderr, and only its own line to stdout."""
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-c", QUIET_SCRIPT, str(tmp_path / "q.so")], capture_output=True,
                          text=True, timeout=300)  # the cache goes to `cache_root`'s folder through the environment
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stderr == ""
    assert done.stdout.split() == ["6.0"]
