"""Writers killed at random points (issue 15): after `kill -9` the destination is the previous or the new
complete file, and the next write leaves no temporary beside it. Each writer runs in a child process that writes
in a loop until it is killed; the parent checks what is left, then writes once itself."""

from __future__ import annotations

import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import kiln
from kiln import ModuleRecord

SAVE_LOOP = """
import sys
import numpy as np
import kiln
from kiln import nn
model = nn.Linear(512, 1024)
model.weight = kiln.Param.from_data(np.full((512, 1024), 2.0, np.float32))
print("ready", flush=True)
while True:
    model.save_file(sys.argv[1])
"""

EXPORT_LOOP = """
import sys
from kiln.runtime.tvm.executable import load_executable
exe = load_executable(sys.argv[1])  # re-exporting what it loaded: the library's bytes, rewritten whole each time
print("ready", flush=True)
while True:
    exe.export_library(sys.argv[1])
"""

KIR = """module @M {
  func @forward(%x: tensor<4xf32>) -> (tensor<4xf32>) {
    %0 = add %x, %x : tensor<4xf32>
    return %0
  }
}
"""


def kill_during(loop: str, *args: str, rng: random.Random) -> None:
    """Run `loop` until it says it is ready, let it write for a random while, then SIGKILL it."""
    child = subprocess.Popen([sys.executable, "-c", loop, *args], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdout.readline() == "ready\n"
    time.sleep(rng.uniform(0.0, 0.4))
    child.kill()
    child.wait()


def temporaries(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_a_killed_save_file_leaves_the_old_or_the_new_record(tmp_path: Path) -> None:
    rng = random.Random(0)
    path = tmp_path / "model.bpk"
    old = kiln.nn.Linear(512, 1024)
    old.weight = kiln.Param.from_data(np.ones((512, 1024), np.float32))
    old.save_file(path)
    for _ in range(3):
        kill_during(SAVE_LOOP, str(path), rng=rng)
        weight = ModuleRecord.load(path)["weight"].array()  # whole and readable: old (1) or new (2)
        assert weight.shape == (512, 1024) and float(weight[0, 0]) in (1.0, 2.0) and np.all(weight == weight[0, 0])
    old.save_file(path)
    assert temporaries(tmp_path) == []
    assert float(ModuleRecord.load(path)["weight"].array()[0, 0]) == 1.0


@pytest.mark.filterwarnings("ignore")
def test_a_killed_export_leaves_a_loadable_library(tmp_path: Path) -> None:
    from kiln.ir import parse
    from kiln.runtime.tvm.compile import compile_graph
    from kiln.runtime.tvm.executable import load_executable

    rng = random.Random(1)
    library = tmp_path / "m.so"
    exe = compile_graph(parse(KIR), cache=False)
    exe.export_library(str(library))
    for _ in range(2):  # each child imports TVM: seconds apiece
        kill_during(EXPORT_LOOP, str(library), rng=rng)
        np.testing.assert_array_equal(load_executable(str(library))(np.ones(4, np.float32)), np.full(4, 2.0))
    exe.export_library(str(library))
    assert temporaries(tmp_path) == []


STORE_LOOP = """
import sys
from kiln.ir import parse
from kiln.runtime.tvm import compile_cache
from kiln.runtime.tvm.compile import cache_key, compile_graph
from kiln.runtime.tvm.target import resolve_target
graph = parse(sys.argv[1])
exe = compile_graph(graph)  # builds and stores the entry once
key = cache_key(graph, ("forward",), resolve_target("llvm"), "bound", True)
print("ready", flush=True)
while True:  # then rewrites it (as a rebuild after damage does) until killed
    compile_cache.store(key, exe.program, exe.program.library.export_library)
"""


def test_a_killed_cache_store_leaves_a_usable_entry_or_none(cache_root: Path) -> None:
    """The compile cache's writer killed mid-store: the next build in a fresh process state loads a whole entry
    or rebuilds, and the next store leaves no temporary in the cache folder."""
    from kiln.ir import parse
    from kiln.runtime.tvm import compile_cache
    from kiln.runtime.tvm.compile import compile_graph

    rng = random.Random(2)
    kill_during(STORE_LOOP, KIR, rng=rng)
    compile_cache.clear_memory()
    exe = compile_graph(parse(KIR))
    np.testing.assert_array_equal(exe(np.ones(4, np.float32)), np.full(4, 2.0))
    (entry,) = compile_cache.disk_entries()
    built = compile_graph(parse(KIR), cache=False).program  # a build of this process (a loaded one cannot re-export)
    compile_cache.store(entry.key, built, built.library.export_library)
    assert temporaries(cache_root / "compile") == []
    assert compile_cache.disk_entries()[0].key == entry.key
