"""Which outputs of a Relax VM function are buffers the call allocated for that output alone, read from the VM's
bytecode (`VMExecutable.as_text()`): the executable hands such an output to the caller as it is, with no copy,
since no input, constant, parameter, other output or later call sees its memory.

An output is fresh when its register holds a `vm.builtin.alloc_tensor` of a `vm.builtin.alloc_storage` made in
the same function that backs no other tensor, it appears once in the returned tuple, and it goes into no call
but kernels that write it in place (destination-passing: `dst: %void`), `vm.builtin.null_value` and the returned
`make_tuple` (a reshape view, another tuple or a packed function's result could alias it); an element taken back
out of a tuple (`tuple_getitem`, for a dynamic shape's check) is the same value. Bytecode with any other
instruction (branches) or that does not parse gives "not fresh" for every output: a copy is always correct.
"""

from __future__ import annotations

import itertools
import re

_CALL = re.compile(r"call\s+(\S+)\s+in:(.*?)\s+dst:\s*(\S+)$")
_RET = re.compile(r"ret\s+(%\d+)$")
_REGISTER = re.compile(r"%\d+$")  # %vm, %void, constants (c[3]) and immediates (i2) are not registers
_BUILTIN = "vm.builtin."
_HARMLESS = {"vm.builtin.null_value", "vm.builtin.check_tensor_info", "vm.builtin.match_shape", "vm.builtin.shape_of"}
_GETITEM = re.compile(r"(%\d+),\s*i(\d+)$")  # `vm.builtin.tuple_getitem in: %6, i0`: the tuple's element 0


def _function_lines(bytecode: str, function: str) -> list[str] | None:
    """The instruction lines of `function` in `as_text()`'s listing (its `@name:` header to the next header)."""
    lines = bytecode.splitlines()
    try:
        start = lines.index(f"@{function}:") + 1
    except ValueError:
        return None
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("@")), len(lines))
    return [line.strip() for line in lines[start:end] if line.strip()]


def fresh_outputs(bytecode: str, function: str, count: int) -> tuple[bool, ...]:
    """Per output of `function` (which returns a tuple of `count`), whether it is a buffer of its own (above)."""
    none = (False,) * count
    lines = _function_lines(bytecode, function)
    if lines is None:
        return none
    value_of: dict[str, int | None] = {}  # register -> the value it holds now (registers are reused)
    fresh_values = itertools.count()
    storage_of: dict[int, int] = {}  # tensor value -> the storage value it was made in
    storages: set[int] = set()
    backed: dict[int, int] = {}  # storage value -> tensors made in it
    shared: set[int] = set()  # values something other than a kernel or a tuple saw
    tuples: dict[int, list[int | None]] = {}
    for line in lines:
        ret = _RET.match(line)
        if ret:
            return _verdict(tuples, value_of.get(ret.group(1)), storage_of, backed, shared, count)
        call = _CALL.match(line)
        if call is None:
            return none
        name, dst = call.group(1), call.group(3)
        item = _GETITEM.match(call.group(2).strip()) if name == "vm.builtin.tuple_getitem" else None
        elements = tuples.get(value_of.get(item.group(1), -1)) if item else None
        if elements is not None and int(item.group(2)) < len(elements) and _REGISTER.match(dst):
            value_of[dst] = elements[int(item.group(2))]  # the same value under another register (dynamic shapes)
            continue
        values = [value_of.get(a) if _REGISTER.match(a) else None for a in call.group(2).replace(",", " ").split()]
        made_in = values[0] if name == "vm.builtin.alloc_tensor" and values and values[0] in storages else None
        kernel = not name.startswith(_BUILTIN) and dst == "%void"  # writes its destination: no alias
        if not (kernel or made_in is not None or name in _HARMLESS or name == "vm.builtin.make_tuple"):
            shared.update(v for v in values if v is not None)
        if not _REGISTER.match(dst):
            continue
        value = value_of[dst] = next(fresh_values)
        if name == "vm.builtin.alloc_storage":
            storages.add(value)
        elif made_in is not None:
            storage_of[value] = made_in
            backed[made_in] = backed.get(made_in, 0) + 1
        elif name == "vm.builtin.make_tuple":
            tuples[value] = values
    return none


def _verdict(tuples: dict[int, list[int | None]], returned_value: int | None, storage_of: dict[int, int],
             backed: dict[int, int], shared: set[int], count: int) -> tuple[bool, ...]:
    """Per element of the returned tuple, whether it is fresh (the module docstring's rule)."""
    returned = tuples.get(returned_value) if returned_value is not None else None
    if returned is None or len(returned) != count or returned_value in shared:
        return (False,) * count
    elsewhere = {v for key, t in tuples.items() if key != returned_value for v in t}
    return tuple(v is not None and v in storage_of and backed[storage_of[v]] == 1 and v not in shared
                 and v not in elsewhere and returned.count(v) == 1 for v in returned)
