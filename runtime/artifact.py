"""Compiled programs on disk: a shared library plus a JSON sidecar (`<lib>.kiln.json`) holding the signatures and
the library's SHA-256, and, for `params="inputs"` builds that carry weights, `<lib>.params.npz`.

Every file is written to a temporary sibling and renamed into place, the sidecar last, so a reader sees either a
complete artifact or none. Reading verifies the sidecar's own digest and the library's checksum before anything
is loaded: a truncated or altered artifact raises `CorruptArtifact` and is never handed to the dynamic loader.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import tvm

from kiln.ir import KilnError

from .signature import FunctionSignature
from .tvm_dtypes import storage_numpy

FORMAT = "kiln-executable/1"
SIDECAR, PARAMS = ".kiln.json", ".params.npz"


class CorruptArtifact(KilnError):
    """A library or sidecar that is missing, truncated, or does not match its checksum."""


@dataclass(frozen=True)
class Program:
    """A compiled (or loaded) library and what is needed to call it."""

    library: tvm.runtime.Module | tvm.relax.VMExecutable
    signatures: dict[str, FunctionSignature]
    target: str
    device: str  # "cpu" or "cuda"
    params: str  # "bound" or "inputs"

    def meta(self) -> dict[str, Any]:
        return {"format": FORMAT, "target": self.target, "device": self.device, "params": self.params,
                "functions": [s.to_json() for s in self.signatures.values()]}


@contextlib.contextmanager
def atomic_path(path: str, suffix: str = "") -> Iterator[str]:
    """A temporary sibling of `path` to write; renamed over `path` if the block succeeds, removed otherwise."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".kiln-tmp-", suffix=suffix, dir=directory)
    os.close(fd)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def file_digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _payload_digest(payload: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def write_artifact(path: str, program: Program, export: Callable[[str], None],
                   param_values: Mapping[str, np.ndarray] | None = None, **extra: Any) -> None:
    """Write the library (through `export(tmp_path)`), the optional weights (in TVM storage dtypes), then the
    sidecar naming them."""
    with atomic_path(path, ".so") as tmp:
        export(tmp)
        library_sha = file_digest(tmp)
    payload = {**program.meta(), **extra, "library_sha256": library_sha}
    if param_values is not None:
        with atomic_path(path + PARAMS, ".npz") as tmp:
            with open(tmp, "wb") as f:
                # raw unsigned views: numpy cannot describe bf16 in .npy headers; readers view them back
                np.savez(f, **{f"p{i}": a.view(f"u{a.dtype.itemsize}") for i, a in enumerate(param_values.values())})
            payload["param_names"] = list(param_values)
            payload["params_sha256"] = file_digest(tmp)
    with atomic_path(path + SIDECAR, ".json") as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({**payload, "sidecar_sha256": _payload_digest(payload)}, f)


def read_sidecar(path: str) -> dict[str, Any]:
    """The verified sidecar of the library at `path` (its digest and the library's checksum both match)."""
    try:
        with open(path + SIDECAR, encoding="utf-8") as f:
            payload = json.load(f)
        digest = payload.pop("sidecar_sha256")
    except (OSError, ValueError, KeyError, AttributeError) as e:
        raise CorruptArtifact(f"{path}{SIDECAR}: unreadable sidecar ({e})") from None
    if digest != _payload_digest(payload) or payload.get("format") != FORMAT:
        raise CorruptArtifact(f"{path}{SIDECAR}: sidecar does not match its digest or format")
    try:
        library_sha = file_digest(path)
    except OSError as e:
        raise CorruptArtifact(f"{path}: unreadable library ({e})") from None
    if library_sha != payload["library_sha256"]:
        raise CorruptArtifact(f"{path}: library checksum mismatch (truncated or altered)")
    return payload


def read_params(path: str, payload: Mapping[str, Any], signatures: Mapping[str, FunctionSignature]
                ) -> dict[str, np.ndarray] | None:
    """The weights stored beside a `params="inputs"` library, checksummed, in TVM storage dtypes."""
    if "param_names" not in payload:
        return None
    if file_digest(path + PARAMS) != payload["params_sha256"]:
        raise CorruptArtifact(f"{path}{PARAMS}: checksum mismatch")
    types = {n: t for s in signatures.values() for n, t in s.params}
    with np.load(path + PARAMS, allow_pickle=False) as data:
        return {n: data[f"p{i}"].view(storage_numpy(types[n].dtype)) for i, n in enumerate(payload["param_names"])}


def load_program(path: str) -> tuple[Program, dict[str, Any]]:
    """Load a verified library with its sidecar payload."""
    payload = read_sidecar(path)
    signatures = {d["name"]: FunctionSignature.from_json(d) for d in payload["functions"]}
    try:
        library = tvm.runtime.load_module(path)
    except RuntimeError as e:  # e.g. a CUDA library on a host whose TVM runtime has no CUDA loader
        raise KilnError(f"{path}: TVM cannot load this library here: {str(e).strip().splitlines()[-1]}") from e
    return Program(library, signatures, payload["target"], payload["device"], payload["params"]), payload
