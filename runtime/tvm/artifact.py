"""Compiled programs on disk: a shared library plus a JSON sidecar (`<lib>.kiln.json`) holding the signatures and
the library's SHA-256, and, for `params="inputs"` builds that carry weights, a burnpack `<lib>.bpk` of them (named as
the signatures name them, in TVM storage dtypes; `kiln inspect` and Rust Burn read it) with its SHA-256.

Every file is written atomically (`kiln.runtime.atomic`), the sidecar last, so a reader sees either a complete
artifact or none. Reading verifies the sidecar's own digest and format and the other files' checksums
before anything is loaded: a truncated, altered or older-format artifact raises `CorruptArtifact` and is never
handed to the dynamic loader.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import tvm

from kiln.ir import DType, KilnError, RecordError, TensorType
from kiln.runtime.atomic import atomic_file, atomic_path
from kiln.runtime.records.burnpack import BurnDType, PackTensor
from kiln.runtime.records.burnpack_io import BurnpackFile, write_burnpack
from kiln.runtime.records.record import burn_dtype

from .dtypes import storage_numpy
from .op_map import OpMap, read_map
from .signature import FunctionSignature

FORMAT = "kiln-executable/2"  # /2: weights in a burnpack (/1 used .params.npz)
SIDECAR, PARAMS = ".kiln.json", ".bpk"
MAX_SIDECAR_BYTES = 16 << 20  # signatures of thousands of functions fit; a sidecar beyond it is not kiln's
# what a sidecar must hold (beyond its digest) for load_program to use it, with each field's JSON type
_SIDECAR_FIELDS = {"format": str, "target": str, "device": str, "params": str, "functions": list,
                   "library_sha256": str}


class CorruptArtifact(KilnError):
    """A library or sidecar that is missing, truncated, or does not match its checksum."""


class UntrustedArtifact(KilnError):
    """A library another user could have replaced: loading it would run their code (the checksums are unkeyed)."""


def check_trusted(path: str) -> None:
    """Refuse a library (or its sidecar) that others can write, or that sits in a folder others can write unless
    the folder is sticky (as /tmp is) and the file is this user's, so nobody else can swap it."""
    for file in (path, path + SIDECAR):
        info = os.stat(file)
        if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise UntrustedArtifact(f"{file} is writable by other users; refusing to load it (chmod go-w it)")
        folder = os.stat(os.path.dirname(os.path.abspath(file)))
        shared = folder.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
        if shared and not (folder.st_mode & stat.S_ISVTX and info.st_uid == os.geteuid()):
            raise UntrustedArtifact(f"{os.path.dirname(os.path.abspath(file))} is writable by other users, who "
                                    f"could replace {os.path.basename(file)}; refusing to load it")


@dataclass(frozen=True)
class Program:
    """A compiled (or loaded) library and what is needed to call it."""

    library: tvm.runtime.Module | tvm.relax.VMExecutable
    signatures: dict[str, FunctionSignature]
    target: str
    device: str  # "cpu" or "cuda"
    params: str  # "bound" or "inputs"
    op_map: OpMap  # what run-time errors name -> kiln op indices (`op_map.py`)

    def meta(self) -> dict[str, Any]:
        return {"format": FORMAT, "target": self.target, "device": self.device, "params": self.params,
                "functions": [s.to_json() for s in self.signatures.values()], "op_map": self.op_map}


def file_digest(path: str | os.PathLike[str]) -> str:
    """The SHA-256 of a regular file's bytes, in hex (a device or pipe, which may never end, is an OSError)."""
    with open(path, "rb") as f:
        _regular(f, path)
        return hashlib.file_digest(f, "sha256").hexdigest()


def _regular(f: Any, path: str | os.PathLike[str]) -> int:
    """The size of an open regular file; anything else (a link to /dev/zero, a FIFO) is an OSError naming it."""
    info = os.fstat(f.fileno())
    if not stat.S_ISREG(info.st_mode):
        raise OSError(f"{path} is not a regular file")
    return info.st_size


def _payload_digest(payload: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def _param_types(signatures: Mapping[str, FunctionSignature]) -> dict[str, TensorType]:
    """Every stored parameter the functions take, by name."""
    return {n: t for s in signatures.values() for n, t in s.params}


def _pack_dtype(name: str, t: TensorType) -> BurnDType:
    """The burnpack dtype of parameter `name`'s TVM storage (i4 codes are I8, u4/nf4 U8), or a KilnError naming
    both when burnpack has none (never a reinterpretation)."""
    storage = storage_numpy(t.dtype)
    try:
        return burn_dtype(DType.from_numpy(storage))
    except (ValueError, RecordError):
        raise KilnError(f"param @{name}: storage dtype {storage} (of {t.dtype.value}) has no burnpack dtype") from None


def write_artifact(path: str, program: Program, export: Callable[[str], None],
                   param_values: Mapping[str, np.ndarray] | None = None, **extra: Any) -> None:
    """Write the library (through `export(tmp_path)`), the optional weights (arrays in TVM storage dtypes) as a
    burnpack, then the sidecar holding their checksums. The folder must exist (a mistyped `-o` is an error, not
    a new folder)."""
    with atomic_path(path, ".so") as tmp:  # export_library picks the library format by extension
        export(str(tmp))
        library_sha = file_digest(tmp)
    payload = {**program.meta(), **extra, "library_sha256": library_sha}
    if param_values is not None:
        types = _param_types(program.signatures)
        tensors = [PackTensor(n, _pack_dtype(n, types[n]), a.shape, None, a) for n, a in param_values.items()]
        with atomic_path(path + PARAMS) as tmp:  # digested before it replaces the old weights
            write_burnpack(tmp, tensors)
            payload["params_sha256"] = file_digest(tmp)
    with atomic_file(path + SIDECAR) as f:
        f.write(json.dumps({**payload, "sidecar_sha256": _payload_digest(payload)}).encode("utf-8"))


def read_sidecar(path: str) -> dict[str, Any]:
    """The verified sidecar of the library at `path` (its digest and the library's checksum both match)."""
    try:
        with open(path + SIDECAR, "rb") as f:
            if _regular(f, path + SIDECAR) > MAX_SIDECAR_BYTES:
                raise ValueError(f"larger than {MAX_SIDECAR_BYTES:,} bytes")
            payload = json.loads(f.read())
        if not isinstance(payload, dict):
            raise ValueError(f"a JSON {type(payload).__name__}, not an object")
        digest = payload.pop("sidecar_sha256")
    except (OSError, ValueError, KeyError, RecursionError) as e:
        raise CorruptArtifact(f"{path}{SIDECAR}: unreadable sidecar ({type(e).__name__}: {e})") from None
    if digest != _payload_digest(payload):
        raise CorruptArtifact(f"{path}{SIDECAR}: sidecar does not match its digest")
    wrong = [k for k, kind in _SIDECAR_FIELDS.items() if not isinstance(payload.get(k), kind)]
    if wrong:
        raise CorruptArtifact(f"{path}{SIDECAR}: sidecar field {wrong[0]!r} is missing or not a JSON "
                              f"{_SIDECAR_FIELDS[wrong[0]].__name__}")
    if payload.get("format") != FORMAT:
        raise CorruptArtifact(f"{path}{SIDECAR}: artifact format {payload.get('format')!r}, but this kiln reads "
                              f"{FORMAT!r}; rebuild or re-export it")
    try:
        library_sha = file_digest(path)
    except OSError as e:
        raise CorruptArtifact(f"{path}: unreadable library ({e})") from None
    if library_sha != payload["library_sha256"]:
        raise CorruptArtifact(f"{path}: library checksum mismatch (truncated or altered)")
    return payload


def read_params(path: str, payload: Mapping[str, Any], signatures: Mapping[str, FunctionSignature]
                ) -> dict[str, np.ndarray] | None:
    """The weights stored beside a `params="inputs"` library, in TVM storage dtypes: the burnpack is read into
    memory once and checksummed, and the read-only arrays view those bytes (no file stays open or mapped)."""
    if "params_sha256" not in payload:
        return None
    source = path + PARAMS
    try:
        with open(source, "rb") as f:
            _regular(f, source)
            data = f.read()
    except OSError as e:
        raise CorruptArtifact(f"{source}: unreadable weights ({e.strerror or e})") from None
    if hashlib.sha256(data).hexdigest() != payload["params_sha256"]:
        raise CorruptArtifact(f"{source}: checksum mismatch (truncated or altered)")
    types = _param_types(signatures)
    try:
        with BurnpackFile.from_bytes(data, source) as pack:
            values = {name: pack.array(name) for name in pack.entries}
    except RecordError as e:
        raise CorruptArtifact(str(e)) from None
    for name, value in values.items():
        t = types.get(name)
        if t is None or value.dtype != storage_numpy(t.dtype) or not t.matches(value.shape):
            raise CorruptArtifact(f"{source}: tensor {name!r} ({value.dtype} {list(value.shape)}) is not a "
                                  "parameter of the library's signatures")
    return values


def load_program(path: str) -> tuple[Program, dict[str, Any]]:
    """Load a verified library with its sidecar payload."""
    payload = read_sidecar(path)
    try:
        signatures = {d["name"]: FunctionSignature.from_json(d) for d in payload["functions"]}
    except (KeyError, TypeError, ValueError, KilnError) as e:
        raise CorruptArtifact(f"{path}{SIDECAR}: malformed function signature ({type(e).__name__}: {e})") from None
    try:
        op_map = read_map(payload.get("op_map", {}))
    except ValueError as e:
        raise CorruptArtifact(f"{path}{SIDECAR}: malformed op map ({e})") from None
    check_trusted(path)
    try:
        library = tvm.runtime.load_module(path)
    except RuntimeError as e:  # e.g. a CUDA library on a host whose TVM runtime has no CUDA loader
        raise KilnError(f"{path}: TVM cannot load this library here: {str(e).strip().splitlines()[-1]}") from e
    return Program(library, signatures, payload["target"], payload["device"], payload["params"], op_map), payload
