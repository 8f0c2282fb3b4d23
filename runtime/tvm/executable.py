"""`Executable`: a compiled kiln program called like the function it came from, and `load_executable`."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import tvm
import tvm_ffi
from tvm import relax

from kiln.ir import KilnError, ShapeError, TensorType
from kiln.ir.types import check_named_dims
from kiln.runtime.progress import log

from .aligned import ALIGNMENT
from .amx import runs_tiles
from .artifact import SIDECAR, CorruptArtifact, Program, load_program, read_params, write_artifact
from .dtypes import from_storage, storage_numpy, to_storage
from .fresh_outputs import fresh_outputs
from .op_map import explain, read_ops
from .signature import FunctionSignature
from .target import configure_threads
from .tile_permission import request_tile_data

# Numpy dtypes whose DLPack export TVM reads as its own storage dtype: these inputs can be handed over zero-copy.
_DLPACK_DTYPES = frozenset(np.dtype(d) for d in ("float16", "float32", "float64", "int8", "int16", "int32", "int64",
                                                 "uint8"))
# TVM's allocator without `tvm.runtime.empty`'s per-call shape and dtype conversion (~17 us of its ~18).
_alloc = tvm.runtime._ffi_api.TVMTensorAllocWithScope
_SCALAR, _INT64 = tvm_ffi.Shape([]), tvm_ffi.dtype("int64")
_item = tvm_ffi._ffi_api.ArrayGetItem  # an Array's element without its Python index checks (~0.5 us of ~1.2)
_SHAPE_CACHE = 64  # dynamic-shape inputs: how many distinct shapes an input keeps converted


class _InputSpec:
    """One input's checks, precomputed: the exact dtype and static shape it takes, and its storage form."""

    __slots__ = ("name", "type", "dtype", "shape", "storage", "dlpack", "tvm_dtype", "_tvm_shapes")

    def __init__(self, name: str, t: TensorType):
        self.name, self.type, self.dtype = name, t, t.dtype.numpy
        self.shape = tuple(t.shape) if all(d is not None for d in t.shape) else None  # None: some dim is dynamic
        self.storage = storage_numpy(t.dtype)
        self.dlpack = self.storage == self.dtype and self.dtype in _DLPACK_DTYPES
        self.tvm_dtype = tvm_ffi.dtype(str(self.storage))
        self._tvm_shapes: dict[tuple[int, ...], tvm_ffi.Shape] = {}

    def tvm_shape(self, shape: tuple[int, ...]) -> tvm_ffi.Shape:
        """`shape` as TVM's Shape, converted once per distinct shape (a conversion costs ~7 us)."""
        found = self._tvm_shapes.get(shape)
        if found is None:
            if len(self._tvm_shapes) >= _SHAPE_CACHE:
                self._tvm_shapes.clear()
            found = self._tvm_shapes[shape] = tvm_ffi.Shape(shape)
        return found


class _Plan:
    """A function's per-call constants: VM entry point, device, inputs, params, seeding, output dtypes to restore,
    and how a copying call reads each output back (`_reader`)."""

    __slots__ = ("entry", "device", "cpu", "inputs", "params", "seeded", "outputs", "readers", "named", "handed",
                 "donated", "bounds")

    def __init__(self, entry: Any, device: tvm.runtime.Device, cpu: bool, inputs: tuple[_InputSpec, ...],
                 params: tuple[tuple[str, TensorType], ...], seeded: bool, outputs: tuple[Any, ...],
                 owned: tuple[bool, ...], donated: tuple[int, ...] = (), bounds: tuple[tuple[int, int, int], ...] = ()):
        self.entry, self.device, self.cpu, self.inputs, self.params = entry, device, cpu, inputs, params
        self.seeded, self.outputs, self.donated, self.bounds = seeded, outputs, donated, bounds
        self.readers = tuple(_reader(t, mine) for t, mine in zip(outputs, owned))
        self.named = any(spec.type.names for spec in inputs)  # some inputs name their dims: check they agree
        # the last `copy=False` call's views, by id, with the VM tensors they show: fed back (a training step's
        # parameters and optimizer state), a view goes in as its tensor, with no conversion. Holding the view keeps
        # its id from being reused.
        self.handed: dict[int, tuple[np.ndarray, Any]] = {}


def _copied(o: Any) -> np.ndarray:
    """A VM output as a numpy array of its own: `o.numpy()` without its Python overhead (~1 us instead of ~6)."""
    return np.from_dlpack(o).copy()


def _reader(restore: Any, owned: bool) -> Callable[[Any], np.ndarray]:
    """How a copying call hands back an output: as it is when the call allocated it for itself alone (`owned`,
    `fresh_outputs`: it is the caller's already, and copying a 800 KB map took ~45 us beside its ~45 us kernel),
    else a copy, since it can alias an input (a reshape view), a stored parameter or a constant the VM hands back
    on every call, and the caller owns (and may write) what it gets; `restore` (a dtype) goes back from storage."""
    if restore is not None:
        return lambda o: from_storage(o.numpy(), restore)
    return np.from_dlpack if owned else _copied


def _writeable_base(x: np.ndarray) -> np.ndarray | None:
    """For a read-only view (as `run(copy=False)` hands out), its writeable base over the same memory: DLPack
    cannot export read-only arrays, and the VM only reads its inputs. None when there is no such base."""
    base = x.base
    same = (isinstance(base, np.ndarray) and base.flags.writeable and base.ctypes.data == x.ctypes.data
            and base.shape == x.shape and base.strides == x.strides and base.dtype == x.dtype)
    return base if same else None


def _device_input(function: str, spec: _InputSpec, x: Any, plan: _Plan) -> Any:
    """`x` checked against `spec` and made a TVM tensor: zero-copy when it is a C-contiguous, 64-byte aligned CPU
    array of the storage dtype (the VM only reads its inputs; `kiln.aligned` makes one), else copied once into a
    fresh TVM buffer."""
    x = np.asarray(x)
    if x.dtype != spec.dtype or (x.shape != spec.shape if spec.shape is not None else not spec.type.matches(x.shape)):
        raise ShapeError(f"@{function} input %{spec.name} expects {spec.type}, got shape {list(x.shape)} "
                         f"dtype {x.dtype}")
    if not (spec.dlpack and plan.cpu):
        return _fresh_input(spec, x, plan)
    flags = x.flags  # one flags object: each `x.flags` makes a new one
    # (an empty array's strides need not be the compact ones TVM checks for: it gets a buffer of its own)
    exportable = (x if flags.writeable else _writeable_base(x)) if flags.c_contiguous and x.size else None
    if exportable is not None:
        view = tvm_ffi.from_dlpack(exportable)  # ~1 us; its data_ptr() is far cheaper to read than numpy's ctypes
        if view.data_ptr() % ALIGNMENT == 0:
            return view
    return _fresh_input(spec, x, plan)


def _fresh_input(spec: _InputSpec, x: np.ndarray, plan: _Plan) -> Any:
    """A checked input copied into a TVM buffer of its own."""
    if not (spec.dlpack and plan.cpu):
        return tvm.runtime.tensor(to_storage(x, spec.type.dtype), plan.device)
    buf = _alloc(spec.tvm_shape(x.shape), spec.tvm_dtype, plan.device, None)
    np.copyto(np.from_dlpack(buf), x)
    return buf


def _own_donated(inputs: tuple[Any, ...], args: list[Any], plan: _Plan) -> None:
    """Make each donated argument one the VM may overwrite: a view the last `copy=False` call handed out goes in as
    its VM tensor (the caller gives it up), anything else, or memory another argument uses too, as a fresh copy,
    so that a caller's own arrays are never written."""
    taken = {a.data_ptr() for i, a in enumerate(args) if i not in plan.donated}
    for i in plan.donated:
        found = plan.handed.get(id(inputs[i]))
        if found is None or found[1] is not args[i] or args[i].data_ptr() in taken:
            args[i] = _fresh_input(plan.inputs[i], np.asarray(inputs[i]), plan)
        taken.add(args[i].data_ptr())


def _input(function: str, spec: _InputSpec, x: Any, plan: _Plan) -> Any:
    """`x` as the VM takes it: the VM's own tensor for a view the last `copy=False` call handed out (when its
    dtype and static shape are this input's), else `_device_input`'s checked conversion."""
    found = plan.handed.get(id(x))
    if found is not None and found[0] is x and x.dtype == spec.dtype and x.shape == spec.shape:
        return found[1]
    return _device_input(function, spec, x, plan)


def _seed_input(seed: int, plan: _Plan) -> Any:
    """The run seed as a fresh int64 scalar on the device (fresh each call: no later call writes into it)."""
    if not plan.cpu:
        return tvm.runtime.tensor(np.asarray(seed, dtype=np.int64), plan.device)
    buf = _alloc(_SCALAR, _INT64, plan.device, None)
    np.from_dlpack(buf)[()] = seed
    return buf


def _read_only(array: np.ndarray) -> np.ndarray:
    view = array.view()
    view.flags.writeable = False
    return view


class Executable:
    """A compiled program: `exe(*arrays)` runs its `forward` (or only) function and returns numpy arrays.

    With `params="inputs"` builds, the stored parameters' values travel with the executable (taken from the
    graph it was compiled from) and `params={name: array}` overrides them per call. `ops` gives each function's
    op descriptions (`op_map.describe`), read only when a call fails, so its error names the ops at fault.
    A function whose memory plan covers a dynamic batch up to a bound (`FunctionSignature.bounds`) runs a larger
    batch through `unbounded()`'s executable, or refuses it with a `ShapeError` when there is none (a loaded file).
    """

    def __init__(self, program: Program, param_values: Mapping[str, np.ndarray] | None = None,
                 library_path: str | None = None, ops: Callable[[], Mapping[str, list[str]]] | None = None,
                 unbounded: Callable[[], Executable] | None = None):
        self.program = program
        self._unbounded, self._wide = unbounded, None  # the build for batches past the memory plan's, made on need
        self._ops = ops
        self._params = {name: np.asarray(v) for name, v in (param_values or {}).items()}
        self._library_path = library_path  # the file the library was loaded from, if any
        self._vm: relax.VirtualMachine | None = None
        self._device_params: dict[str, tvm.runtime.Tensor] = {}
        self._plans: dict[str, _Plan] = {}  # per function: VM entry point and input checks, built on first call
        names = list(program.signatures)
        self._default = "forward" if "forward" in names else next(iter(names), None)  # None: a module of no function

    @property
    def signatures(self) -> dict[str, FunctionSignature]:
        return self.program.signatures

    @property
    def default_function(self) -> str:
        if self._default is None:
            raise KilnError("this executable has no function to call")
        return self._default

    def _device(self) -> tvm.runtime.Device:
        return tvm.cuda(0) if self.program.device == "cuda" else tvm.cpu(0)

    def _machine(self) -> relax.VirtualMachine:
        if self._vm is None:
            if self.program.device == "cpu":
                configure_threads()
                if runs_tiles(self.program.target, self.program.op_map):
                    request_tile_data()
            elif not self._device().exist:
                raise KilnError("this executable was compiled for CUDA but no CUDA device is available")
            self._vm = relax.VirtualMachine(self.program.library, self._device())
        return self._vm

    def __call__(self, *inputs: Any, params: Mapping[str, np.ndarray] | None = None, seed: int = 0
                 ) -> np.ndarray | tuple[np.ndarray, ...]:
        """Run the default function; one result comes back bare, several as a tuple."""
        function = self.default_function
        outs = self._run(self._plans.get(function) or self._plan(function), function, inputs, params, seed, True)
        return outs[0] if len(outs) == 1 else outs

    def run(self, *inputs: Any, function: str = "forward", params: Mapping[str, np.ndarray] | None = None,
            seed: int = 0, copy: bool = True) -> tuple[np.ndarray, ...]:
        """Run `function` on numpy inputs; `seed` drives stochastic ops (dropout) reproducibly.

        `copy=False` returns CPU outputs as read-only views of the VM's own buffers instead of copies: a caller
        that feeds them back (a training step's parameters and optimizer state) then passes them in zero-copy and
        unconverted. The function keeps its last `copy=False` outputs alive until its next `copy=False` call.
        """
        return self._run(self._plans.get(function) or self._plan(function), function, inputs, params, seed, copy)

    def _run(self, plan: _Plan, function: str, inputs: tuple[Any, ...], params: Mapping[str, np.ndarray] | None,
             seed: int, copy: bool) -> tuple[np.ndarray, ...]:
        """`run` once the plan is found: what `__call__` and `run` share (a call of a small model is a few us of
        Python beside its kernels, so this path avoids every lookup and wrapper it can)."""
        if len(inputs) != len(plan.inputs):
            raise KilnError(f"@{function} takes {len(plan.inputs)} inputs, got {len(inputs)}")
        for i, axis, limit in plan.bounds:
            if np.shape(inputs[i])[axis] > limit:
                return self._beyond_plan(plan, function, inputs, i, axis, limit).run(
                    *inputs, function=function, params=params, seed=seed, copy=copy)
        convert = _input if plan.handed else _device_input  # no view of a `copy=False` call to recognize
        try:
            args = [convert(function, spec, x, plan) for spec, x in zip(plan.inputs, inputs)]
            if plan.donated:
                _own_donated(inputs, args, plan)
            if plan.named:  # inputs sharing a dim name agree on it (one TVM var)
                check_named_dims([s.type for s in plan.inputs], [a.shape for a in args],
                                 [f"@{function} input %{s.name}" for s in plan.inputs])
            if plan.params:
                args += [self._param(name, t, params) for name, t in plan.params]
            if plan.seeded:
                args.append(_seed_input(seed, plan))
            outs = plan.entry(*args)
        except (ShapeError, RuntimeError) as e:  # a TVM run-time check: name the kiln ops behind it
            raise explain(function, e, self.program.op_map, self._descriptions().get(function)) from e
        # Elements by index: the Array's own iterator costs ~4 us.
        if copy:
            return tuple([read(_item(outs, i)) for i, read in enumerate(plan.readers)])
        host = [_item(outs, i) for i in range(len(plan.outputs))]
        results = tuple(_read_only(np.from_dlpack(o)) if t is None else from_storage(o.numpy(), t)
                        for o, t in zip(host, plan.outputs))
        plan.handed = {id(r): (r, o) for r, o, t in zip(results, host, plan.outputs) if t is None}
        return results

    def _beyond_plan(self, plan: _Plan, function: str, inputs: tuple[Any, ...], i: int, axis: int, limit: int
                     ) -> Executable:
        """The executable that runs a batch past `limit`, the memory plan's bound: the unbounded build, with this
        one's stored parameters; a `ShapeError` where there is none."""
        if self._wide is None:
            size = np.shape(inputs[i])[axis]
            if self._unbounded is None:
                raise ShapeError(f"@{function} input %{plan.inputs[i].name} has {size} on axis {axis}, past the "
                                 f"{limit} this build planned its memory for: compile it with max_batch={size} or "
                                 "more (max_batch=None plans none)")
            log.info("@%s: a batch of %d is past the memory plan's %d; building without that bound", function,
                     size, limit)
            self._wide = self._unbounded()
            self._wide._params = self._params
        return self._wide

    def _plan(self, function: str) -> _Plan:
        """What every call of `function` needs, looked up once: its VM entry point and per-input checks."""
        sig = self.signatures.get(function)
        if sig is None:
            raise KilnError(f"this executable has no function @{function} (it has {', '.join(self.signatures)})")
        device = self._device()
        entry = self._machine()[function]
        inputs = tuple(_InputSpec(name, t) for name, t in sig.inputs)
        cpu = device.dlpack_device_type() == 1  # kDLCPU
        # None: read back through DLPack, already in the output's dtype; else `.numpy()` then `from_storage`
        outputs = tuple(None if cpu and storage_numpy(t.dtype) == t.dtype.numpy and t.dtype.numpy in _DLPACK_DTYPES
                        else t.dtype for t in sig.outputs)
        owned = fresh_outputs(self._bytecode(), function, len(outputs)) if cpu else (False,) * len(outputs)
        plan = self._plans[function] = _Plan(entry, device, cpu, inputs, tuple(sig.params), sig.seeded, outputs,
                                             owned, sig.donated, sig.bounds)
        return plan

    def _bytecode(self) -> str:
        """The VM's instructions as text (`fresh_outputs` reads them)."""
        library = self.program.library
        return (library if isinstance(library, relax.VMExecutable) else relax.VMExecutable(library)).as_text()

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

    def _descriptions(self) -> Mapping[str, list[str]]:
        return self._ops() if self._ops is not None else {}

    def export_library(self, path: str) -> None:
        """Write a shared library loadable by `load_executable` in a fresh process (no tracing, no graph), with
        its sidecar; a `params="inputs"` build also stores its current parameter values in the burnpack
        `<path>.bpk`."""
        def export(tmp: str) -> None:
            if self._library_path is not None:
                shutil.copyfile(self._library_path, tmp)
            else:
                self.program.library.export_library(tmp)

        types = {n: t for s in self.signatures.values() for n, t in s.params}
        values = {n: to_storage(self._params[n], t.dtype) for n, t in types.items() if n in self._params}
        write_artifact(path, self.program, export, values if self.program.params == "inputs" else None,
                       ops=dict(self._descriptions()))


def load_executable(path: str) -> Executable:
    """Load a library written by `Executable.export_library` (checksums verified before loading)."""
    program, payload = load_program(path)
    try:
        ops = read_ops(payload.get("ops"))
    except ValueError as e:
        raise CorruptArtifact(f"{path}{SIDECAR}: malformed op descriptions ({e})") from None
    values = read_params(path, payload, program.signatures)
    sig_types = {n: t for s in program.signatures.values() for n, t in s.params}
    params = {n: from_storage(v, sig_types[n].dtype) for n, v in (values or {}).items()}
    return Executable(program, params, library_path=path, ops=(lambda: ops) if ops is not None else None)
