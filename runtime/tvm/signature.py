"""The calling convention of a compiled kiln function: its inputs, stored-parameter inputs, outputs and seed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kiln.ir import DType, TensorType


def type_to_json(t: TensorType) -> dict[str, Any]:
    return {"shape": list(t.shape), "dtype": t.dtype.value}


def type_from_json(d: dict[str, Any]) -> TensorType:
    return TensorType(tuple(d["shape"]), DType(d["dtype"]))


@dataclass(frozen=True)
class FunctionSignature:
    """One compiled function: `main(*inputs, *params, [seed])` returning a tuple of `outputs`.

    `params` lists the stored parameters the function takes as inputs (only when compiled with
    `params="inputs"`); `seeded` says a trailing int64 run seed follows (active dropout); `donated` gives the
    positions of the inputs its kernels may overwrite (`compile_graph(donate=...)`); `bounds` the (input, axis,
    largest size) of each dynamic batch dim its memory plan was sized for (`memory_plan.py`).
    """

    name: str
    inputs: tuple[tuple[str, TensorType], ...]
    params: tuple[tuple[str, TensorType], ...]
    outputs: tuple[TensorType, ...]
    seeded: bool
    donated: tuple[int, ...] = ()
    bounds: tuple[tuple[int, int, int], ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "inputs": [[n, type_to_json(t)] for n, t in self.inputs],
                "params": [[n, type_to_json(t)] for n, t in self.params],
                "outputs": [type_to_json(t) for t in self.outputs], "seeded": self.seeded,
                "donated": list(self.donated), "bounds": [list(b) for b in self.bounds]}

    @staticmethod
    def from_json(d: dict[str, Any]) -> FunctionSignature:
        return FunctionSignature(d["name"], tuple((n, type_from_json(t)) for n, t in d["inputs"]),
                                 tuple((n, type_from_json(t)) for n, t in d["params"]),
                                 tuple(type_from_json(t) for t in d["outputs"]), bool(d["seeded"]),
                                 tuple(int(i) for i in d.get("donated", ())),
                                 tuple((int(i), int(a), int(n)) for i, a, n in d.get("bounds", ())))
