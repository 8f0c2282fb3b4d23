"""Seeded mutation fuzzing of kiln's readers (issue 15), run as `python fuzz.py TARGET SEED SECONDS ITERATIONS`.

Targets: `kir`, `burnpack`, `onnx` (initializers), `onnx_import` (`kiln.import_onnx` of mutated and structurally
edited models, then the interpreter), `sidecar` (a compiled library's sidecar, loaded with `load_program`),
`safetensors` (byte noise and re-encoded header edits) and `pytorch` (`torch.save` files; noise on the archive or on
its pickle inside an intact zip).
Each target builds a small corpus of valid inputs, then mutates them (bit flips, byte overwrites, truncation,
insertion, chunk duplication, and for text also token edits) and feeds each mutant to the reader. Only kiln's
error types may escape; anything else, or one input running longer than PER_INPUT_SECONDS, stops the run with a
reproducer written beside the corpus and exit status 1. The process's address space is capped, so a reader
that allocates without bound fails as a MemoryError (a finding) instead of exhausting the machine. The last
line printed is a JSON summary.
"""

from __future__ import annotations

import json
import math
import random
import resource
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

PER_INPUT_SECONDS = 10
HEADROOM = 3 << 30  # address space allowed beyond what the process has mapped at start


def mutate(data: bytes, rng: random.Random) -> bytes:
    """One to four random edits of `data`."""
    out = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        kind = rng.randrange(6)
        at = rng.randrange(len(out) + 1)
        if kind == 0 and out:  # flip a bit
            i = min(at, len(out) - 1)
            out[i] ^= 1 << rng.randrange(8)
        elif kind == 1 and out:  # overwrite a byte with an interesting value
            out[min(at, len(out) - 1)] = rng.choice([0, 1, 0x7F, 0x80, 0xFF, rng.randrange(256)])
        elif kind == 2:  # truncate
            del out[at:]
        elif kind == 3:  # insert random bytes
            out[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
        elif kind == 4 and out:  # duplicate a chunk
            j = rng.randrange(len(out))
            out[at:at] = out[j:j + rng.randint(1, 64)]
        elif out:  # overwrite 8 bytes with an extreme little-endian integer (lengths, offsets, counts)
            value = rng.choice([0, 2**31 - 1, 2**32 - 1, 2**63 - 1, 2**64 - 1, rng.getrandbits(64)])
            out[at:at + 8] = value.to_bytes(8, "little")
    return bytes(out)


TEXT_EDITS = ["-1", "0", "1e309", "nan", "-inf", "?", "x", "{", "}", "[", "]", ",", "=", "%", "@", '"', "tensor<",
              "9" * 30, "2147483648", "dense<", "f16", "i4", "param", "func", "return", "uniform(lo = 2.0, hi = 1.0)",
              "normal(std = -1.0)", "gain = nan", "tensor<99999999x99999999xf32>"]


def mutate_text(text: str, rng: random.Random) -> bytes:
    """Token-level edits of IR text (more of them reach the parser's later stages than byte noise does)."""
    words = text.split(" ")
    for _ in range(rng.randint(1, 3)):
        i = rng.randrange(len(words))
        if rng.random() < 0.5:
            words[i] = rng.choice(TEXT_EDITS)
        else:
            words.insert(i, rng.choice(TEXT_EDITS))
    return " ".join(words).encode()


# --- targets: (corpus builder, mutator, reader); the reader raises kiln's errors or returns ----------------------


def kir_corpus(folder: Path) -> list[bytes]:
    from kiln.ir import parse_file, print_graph

    root = Path(__file__).resolve().parents[1] / "filecheck"
    texts = []
    for path in sorted(root.rglob("*.kir")):
        try:
            texts.append(print_graph(parse_file(str(path))).encode())
        except Exception:  # files of error cases do not parse: the others are the corpus
            continue
    return texts


def kir_read(data: bytes, folder: Path) -> None:
    from kiln.ir import parse, verify
    from kiln.passes import PassManager

    graph = verify(parse(data.decode("utf-8", errors="replace"), "fuzz.kir"))
    PassManager.parse("canonicalize,cse,dce").run(graph)


def burnpack_corpus(folder: Path) -> list[bytes]:
    import kiln
    from kiln import Quantizer, nn
    kiln.seed(0)
    models = [nn.Linear(6, 4), nn.Sequential(nn.Conv2d(1, 2, 3), nn.LayerNorm(2)),
              nn.Linear(8, 4, bias=False).quantize_weights(Quantizer())]
    blobs = []
    for i, model in enumerate(models):
        path = folder / f"m{i}.bpk"
        model.save_file(str(path))
        blobs.append(path.read_bytes())
    fixture = Path(__file__).resolve().parents[3] / "shared" / "fixtures" / "burn" / "mnist-model.bpk"
    if fixture.is_file():
        blobs.append(fixture.read_bytes()[:1 << 20] if fixture.stat().st_size > 1 << 20 else fixture.read_bytes())
    return blobs


def burnpack_read(data: bytes, folder: Path) -> None:
    from kiln.runtime.records.record import ModuleRecord

    record = ModuleRecord.from_bytes(data)
    for _, entry in record.items():
        np.asarray(entry.array())


def onnx_corpus(folder: Path) -> list[bytes]:
    from onnx import helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((3, 4)).astype(np.float32), "w"),
             numpy_helper.from_array(np.arange(4, dtype=np.int64), "b")]
    inits[0].metadata_props.add(key="kiln.param_id", value="12345")
    graph = helper.make_graph([], "g", [], [], initializer=inits)
    return [helper.make_model(graph).SerializeToString()]


def onnx_read(data: bytes, folder: Path) -> None:
    from kiln.runtime.onnx.tensors import read_record

    path = folder / "fuzz.onnx"
    path.write_bytes(data)
    for _, entry in read_record(path).items():
        np.asarray(entry.array())


def onnx_import_corpus(folder: Path) -> list[bytes]:
    """Small models covering the importer's paths: weights as initializers, a shape computation the importer
    folds, spatial attributes, a dynamic batch dim."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    f32 = TensorProto.FLOAT
    mlp = helper.make_graph(
        [helper.make_node("Gemm", ["x", "w", "b"], ["h"], transB=1), helper.make_node("Relu", ["h"], ["r"]),
         helper.make_node("Softmax", ["r"], ["y"], axis=-1)], "mlp",
        [helper.make_tensor_value_info("x", f32, ["batch", 4])], [helper.make_tensor_value_info("y", f32, None)],
        initializer=[numpy_helper.from_array(rng.standard_normal((3, 4)).astype(np.float32), "w"),
                     numpy_helper.from_array(np.zeros(3, np.float32), "b")])
    cnn = helper.make_graph(
        [helper.make_node("Conv", ["x", "k"], ["c"], pads=[1, 1, 1, 1], strides=[1, 1]),
         helper.make_node("MaxPool", ["c"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
         helper.make_node("Shape", ["p"], ["s"]),
         helper.make_node("Gather", ["s", "zero"], ["n"], axis=0),
         helper.make_node("Unsqueeze", ["n", "axes"], ["n1"]),
         helper.make_node("Concat", ["n1", "minus1"], ["shape"], axis=0),
         helper.make_node("Reshape", ["p", "shape"], ["flat"]),
         helper.make_node("ReduceMean", ["flat"], ["y"], axes=[1], keepdims=0)], "cnn",
        [helper.make_tensor_value_info("x", f32, [1, 2, 6, 6])], [helper.make_tensor_value_info("y", f32, None)],
        initializer=[numpy_helper.from_array(rng.standard_normal((3, 2, 3, 3)).astype(np.float32), "k"),
                     numpy_helper.from_array(np.array(0, np.int64), "zero"),
                     numpy_helper.from_array(np.array([0], np.int64), "axes"),
                     numpy_helper.from_array(np.array([-1], np.int64), "minus1")])
    return [helper.make_model(mlp, opset_imports=[helper.make_opsetid("", 13)]).SerializeToString(),
            helper.make_model(cnn, opset_imports=[helper.make_opsetid("", 13)]).SerializeToString()]


def onnx_import_mutate(data: bytes, rng: random.Random) -> bytes:
    """Byte noise, or a structural edit a careless exporter or a hostile file would make, re-serialized."""
    from onnx import AttributeProto, ModelProto, helper

    if rng.random() < 0.3:
        return mutate(data, rng)
    model = ModelProto.FromString(data)
    graph = model.graph
    nodes = list(graph.node)
    node = rng.choice(nodes)
    kind = rng.randrange(9)
    if kind == 0 and node.attribute:  # an attribute of the wrong type
        attr = rng.choice(list(node.attribute))
        attr.type = rng.choice([AttributeProto.FLOAT, AttributeProto.STRING, AttributeProto.INTS,
                                AttributeProto.TENSOR, AttributeProto.GRAPH])
        if rng.random() < 0.5:
            attr.ClearField(rng.choice(["i", "f", "ints", "s"]))
    elif kind == 1 and node.input:  # a missing or dangling input
        del node.input[rng.randrange(len(node.input))]
        if rng.random() < 0.5:
            node.input.append(rng.choice(["", "nowhere"]))
    elif kind == 2:  # an opset outside the importer's range, or another domain
        model.opset_import[0].version = rng.choice([0, 1, 6, 29, 10**6, -1])
        if rng.random() < 0.3:
            model.opset_import[0].domain = rng.choice(["ai.onnx.ml", "com.example"])
    elif kind == 3:  # a cycle: a node reading its own output or a later one's
        later = nodes[rng.randrange(nodes.index(node), len(nodes))]
        node.input.append(later.output[0]) if not node.input else node.input.__setitem__(0, later.output[0])
    elif kind == 4:  # huge, zero or negative input dims
        dims = graph.input[0].type.tensor_type.shape.dim
        dim = dims[rng.randrange(len(dims))]
        dim.dim_value = rng.choice([0, -1, 2**31, 2**62, 10**12])
    elif kind == 5 and graph.initializer:  # initializer values that break shape inference (reshape targets, axes)
        init = rng.choice(list(graph.initializer))
        if init.data_type == 7:  # int64
            init.ClearField("raw_data")
            init.ClearField("int64_data")
            count = max(1, int(np.prod(init.dims)) if init.dims else 1)
            init.int64_data.extend(rng.choice([0, -1, -2, 5, 2**40, -(2**63)]) for _ in range(count))
        else:
            init.dims[:] = [rng.choice([0, 1, 7, 2**33]) for _ in init.dims]
    elif kind == 6:  # an unknown op type, or a known one with another's attributes
        node.op_type = rng.choice(["NoSuchOp", "Loop", "Einsum", "Conv", "Gemm", "If", "Scan"])
    elif kind == 7:  # duplicate or empty output names
        node.output[0] = rng.choice(["", nodes[0].output[0], graph.input[0].name])
    else:  # a new attribute with an extreme value
        node.attribute.append(helper.make_attribute(rng.choice(["axis", "perm", "pads", "kernel_shape", "group"]),
                                                    rng.choice([2**62, -(2**62), [2**40], [-5, 3], 0])))
    return model.SerializeToString()


def onnx_import_read(data: bytes, folder: Path) -> None:
    """Import the model, then run it through the interpreter on inputs of its declared shapes (a `?` dim as 2)."""
    import kiln
    from kiln.ir import interpret

    path = folder / "fuzz.onnx"
    path.write_bytes(data)
    graph = kiln.import_onnx(path).graph
    args = graph.functions["forward"].args
    shapes = [tuple(d if isinstance(d, int) else 2 for d in arg.type.shape) for arg in args]
    if all(math.prod(shape) <= 1 << 20 for shape in shapes):  # inputs the importer accepts but no test could feed
        interpret(graph, [np.ones(shape, arg.type.dtype.numpy) for shape, arg in zip(shapes, args, strict=True)])


def sidecar_corpus(folder: Path) -> list[bytes]:
    from kiln.ir import parse
    from kiln.runtime.tvm.artifact import SIDECAR
    from kiln.runtime.tvm.compile import compile_graph

    graph = parse("module @M {\n  func @forward(%x: tensor<?x4xf32>) -> (tensor<?x4xf32>) {\n"
                  "    %0 = add %x, %x : tensor<?x4xf32>\n    return %0\n  }\n}\n")
    compile_graph(graph, cache=False).export_library(str(folder / "m.so"))
    return [(folder / f"m.so{SIDECAR}").read_bytes()]


def sidecar_mutate(data: bytes, rng: random.Random) -> bytes:
    """Byte noise, or (as someone who knows the digest is unkeyed would) a structural edit re-signed."""
    import json as _json

    from kiln.runtime.tvm import artifact

    if rng.random() < 0.5:
        return mutate(data, rng)
    payload = _json.loads(data)
    payload.pop("sidecar_sha256")
    key = rng.choice(sorted(payload))
    payload[key] = rng.choice([None, [], {}, 0, -1, "x", [{"name": 1}], {"functions": []}, payload.get("functions"),
                               [{"name": "forward", "args": "?", "results": [], "params": []}]])
    payload["sidecar_sha256"] = artifact._payload_digest(payload)
    return _json.dumps(payload).encode()


def sidecar_read(data: bytes, folder: Path) -> None:
    """Load the (intact) library beside a mutated sidecar."""
    from kiln.runtime.tvm.artifact import SIDECAR, load_program

    (folder / f"m.so{SIDECAR}").write_bytes(data)
    load_program(str(folder / "m.so"))


def safetensors_corpus(folder: Path) -> list[bytes]:
    import kiln
    from kiln import nn
    kiln.seed(0)
    blobs = []
    for i, model in enumerate([nn.Linear(6, 4), nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2))]):
        model.into_record().to_safetensors(folder / f"m{i}.safetensors")
        blobs.append((folder / f"m{i}.safetensors").read_bytes())
    return blobs


def safetensors_mutate(data: bytes, rng: random.Random) -> bytes:
    """Byte noise, or a header field edited and the header re-encoded with a correct length prefix."""
    if rng.random() < 0.5:
        return mutate(data, rng)
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + size])
    name = rng.choice(sorted(header))
    field = rng.choice(["dtype", "shape", "data_offsets", None])
    value = rng.choice([None, [], [0], [0, 2**64], [-1, 4], [3, 1], "F32", "BOOL", "I4", {}, 2**63, [2**40, 2**40]])
    if field is None or not isinstance(header[name], dict):
        header[name] = value
    else:
        header[name][field] = value
    text = json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text + data[8 + size :]


def safetensors_read(data: bytes, folder: Path) -> None:
    from kiln.runtime.records.record import ModuleRecord

    path = folder / "fuzz.safetensors"
    path.write_bytes(data)
    for _, entry in ModuleRecord.from_safetensors(path).items():
        np.asarray(entry.array())


def pytorch_corpus(folder: Path) -> list[bytes]:
    import torch

    torch.manual_seed(0)
    states = [torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3)).state_dict(),
              {"t": torch.arange(12.0).reshape(3, 4).t(), "h": torch.ones(2, dtype=torch.bfloat16)}]
    blobs = []
    for i, state in enumerate(states):
        torch.save(state, folder / f"m{i}.pt")
        blobs.append((folder / f"m{i}.pt").read_bytes())
    return blobs


def pytorch_mutate(data: bytes, rng: random.Random) -> bytes:
    """Byte noise on the archive, or on its pickle alone inside a re-written, intact zip (past the CRC checks)."""
    import io
    import zipfile

    if rng.random() < 0.4:
        return mutate(data, rng)
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        members = [(info.filename, archive.read(info)) for info in archive.infolist()]
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as archive:
        for name, content in members:
            archive.writestr(name, mutate(content, rng) if name.endswith("data.pkl") else content)
    return out.getvalue()


def pytorch_read(data: bytes, folder: Path) -> None:
    from kiln.runtime.records.record import ModuleRecord

    path = folder / "fuzz.pt"
    path.write_bytes(data)
    for _, entry in ModuleRecord.from_pytorch(path).items():
        np.asarray(entry.array())


TARGETS: dict[str, tuple[Callable[[Path], list[bytes]], Callable[[bytes, random.Random], bytes],
                         Callable[[bytes, Path], None]]] = {
    "kir": (kir_corpus, lambda d, rng: mutate_text(d.decode(), rng) if rng.random() < 0.7 else mutate(d, rng),
            kir_read),
    "burnpack": (burnpack_corpus, mutate, burnpack_read),
    "onnx": (onnx_corpus, mutate, onnx_read),
    "onnx_import": (onnx_import_corpus, onnx_import_mutate, onnx_import_read),
    "sidecar": (sidecar_corpus, sidecar_mutate, sidecar_read),
    "safetensors": (safetensors_corpus, safetensors_mutate, safetensors_read),
    "pytorch": (pytorch_corpus, pytorch_mutate, pytorch_read),
}


def _alarm(signum, frame):
    raise TimeoutError(f"one input ran longer than {PER_INPUT_SECONDS} s")


def _cap_memory() -> None:
    with open("/proc/self/statm") as f:
        mapped = int(f.read().split()[0]) * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_AS, (mapped + HEADROOM, resource.RLIM_INFINITY))


def main(target: str, seed: int, seconds: float, iterations: int) -> int:
    from kiln.ir import KilnError

    build, change, read = TARGETS[target]
    folder = Path(tempfile.mkdtemp(prefix=f"kiln-fuzz-{target}-"))
    corpus = build(folder)
    for sample in corpus:  # the unmutated corpus must read
        read(sample, folder)
    _cap_memory()
    signal.signal(signal.SIGALRM, _alarm)
    rng = random.Random(seed)
    counts = {"inputs": 0, "kiln_errors": 0, "accepted": 0}
    deadline = time.monotonic() + seconds
    while counts["inputs"] < iterations and time.monotonic() < deadline:
        data = change(rng.choice(corpus), rng)
        counts["inputs"] += 1
        signal.alarm(PER_INPUT_SECONDS)
        try:
            read(data, folder)
            counts["accepted"] += 1
        except KilnError:
            counts["kiln_errors"] += 1
        except BaseException as error:  # noqa: BLE001 - any other escape is the finding
            signal.alarm(0)
            repro = folder / f"repro-{seed}-{counts['inputs']}.bin"
            repro.write_bytes(data)
            print(json.dumps({**counts, "target": target, "escaped": f"{type(error).__name__}: {error}"[:500],
                              "repro": str(repro)}))
            return 1
        finally:
            signal.alarm(0)
    shutil.rmtree(folder)  # a finding keeps its folder: the repro is in it
    print(json.dumps({**counts, "target": target, "seed": seed, "folder": str(folder)}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])))
