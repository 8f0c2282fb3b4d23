"""`Executable`: a compiled kiln program called like the function it came from, and `load_executable`."""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from typing import Any

import numpy as np
import tvm
from tvm import relax

from kiln.ir import KilnError, TensorType

from .artifact import Program, load_program, read_params, write_artifact
from .signature import FunctionSignature
from .tvm_dtypes import from_storage, to_storage
from .tvm_target import configure_threads


class Executable:
    """A compiled program: `exe(*arrays)` runs its `forward` (or only) function and returns numpy arrays.

    With `params="inputs"` builds, the stored parameters' values travel with the executable (taken from the
    graph it was compiled from) and `params={name: array}` overrides them per call.
    """

    def __init__(self, program: Program, param_values: Mapping[str, np.ndarray] | None = None,
                 library_path: str | None = None):
        self.program = program
        self._params = {name: np.asarray(v) for name, v in (param_values or {}).items()}
        self._library_path = library_path  # the file the library was loaded from, if any
        self._vm: relax.VirtualMachine | None = None
        self._device_params: dict[str, tvm.runtime.Tensor] = {}

    @property
    def signatures(self) -> dict[str, FunctionSignature]:
        return self.program.signatures

    @property
    def default_function(self) -> str:
        names = list(self.signatures)
        return "forward" if "forward" in names else names[0]

    def _device(self) -> tvm.runtime.Device:
        return tvm.cuda(0) if self.program.device == "cuda" else tvm.cpu(0)

    def _machine(self) -> relax.VirtualMachine:
        if self._vm is None:
            if self.program.device == "cpu":
                configure_threads()
            elif not self._device().exist:
                raise KilnError("this executable was compiled for CUDA but no CUDA device is available")
            self._vm = relax.VirtualMachine(self.program.library, self._device())
        return self._vm

    def __call__(self, *inputs: Any, params: Mapping[str, np.ndarray] | None = None, seed: int = 0
                 ) -> np.ndarray | tuple[np.ndarray, ...]:
        """Run the default function; one result comes back bare, several as a tuple."""
        outs = self.run(*inputs, function=self.default_function, params=params, seed=seed)
        return outs[0] if len(outs) == 1 else outs

    def run(self, *inputs: Any, function: str = "forward", params: Mapping[str, np.ndarray] | None = None,
            seed: int = 0) -> tuple[np.ndarray, ...]:
        """Run `function` on numpy inputs; `seed` drives stochastic ops (dropout) reproducibly."""
        sig = self.signatures.get(function)
        if sig is None:
            raise KilnError(f"this executable has no function @{function} (it has {', '.join(self.signatures)})")
        if len(inputs) != len(sig.inputs):
            raise KilnError(f"@{function} takes {len(sig.inputs)} inputs, got {len(inputs)}")
        machine, device = self._machine(), self._device()
        args = []
        for (name, t), x in zip(sig.inputs, inputs):
            x = np.asarray(x)
            if x.dtype != t.dtype.numpy or not t.matches(x.shape):
                raise KilnError(f"@{function} input %{name} expects {t}, got shape {list(x.shape)} dtype {x.dtype}")
            args.append(tvm.runtime.tensor(to_storage(x, t.dtype), device))
        args += [self._param(name, t, params) for name, t in sig.params]
        if sig.seeded:
            args.append(tvm.runtime.tensor(np.asarray(seed, dtype=np.int64), device))
        outs = machine[function](*args)
        return tuple(from_storage(o.numpy(), t.dtype) for o, t in zip(outs, sig.outputs))

    def _param(self, name: str, t: TensorType, overrides: Mapping[str, np.ndarray] | None) -> tvm.runtime.Tensor:
        """A stored parameter on the device: an override for this call, else the executable's own value."""
        if overrides is not None and name in overrides:
            value = np.asarray(overrides[name])
            if value.dtype != t.dtype.numpy or not t.matches(value.shape):
                raise KilnError(f"param @{name} expects {t}, got shape {list(value.shape)} dtype {value.dtype}")
            return tvm.runtime.tensor(to_storage(value, t.dtype), self._device())
        if name not in self._device_params:
            if name not in self._params:
                raise KilnError(f"param @{name} has no value; pass it with params={{{name!r}: array}}")
            self._device_params[name] = tvm.runtime.tensor(to_storage(self._params[name], t.dtype), self._device())
        return self._device_params[name]

    def export_library(self, path: str) -> None:
        """Write a shared library loadable by `load_executable` in a fresh process (no tracing, no graph), with
        its sidecar; a `params="inputs"` build also stores its current parameter values beside it."""
        def export(tmp: str) -> None:
            if self._library_path is not None:
                shutil.copyfile(self._library_path, tmp)
            else:
                self.program.library.export_library(tmp)

        types = {n: t for s in self.signatures.values() for n, t in s.params}
        values = {n: to_storage(self._params[n], t.dtype) for n, t in types.items() if n in self._params}
        write_artifact(path, self.program, export, values if self.program.params == "inputs" else None)


def load_executable(path: str) -> Executable:
    """Load a library written by `Executable.export_library` (checksums verified before loading)."""
    program, payload = load_program(path)
    values = read_params(path, payload, program.signatures)
    sig_types = {n: t for s in program.signatures.values() for n, t in s.params}
    params = {n: from_storage(v, sig_types[n].dtype) for n, v in (values or {}).items()}
    return Executable(program, params, library_path=path)
