"""`Loop` with a trip count and conditions known at import, and `Scan` over a sequence length (Scan-8: and batch) known
at import, unrolled: the body is converted once per iteration with the iteration number, condition (Loop) or scan
elements (Scan) and the carried values bound, and each scan output's per-iteration values are stacked along a new
axis. A loop whose carried values change shape, whose condition is computed at run time, or whose length is
unknown is refused, naming the node (a run-time Scan length also names the scan input whose dim to fix with
`input_shapes`: the IR has no loop op, and an unrolling masked up to a bound would need that bound from the user
too, with every iteration paid for at every length)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kiln.ir import Value

from .call import NodeCall, Output
from .convert_shape import reshape_to
from .registry import Unsupported, converts
from .symbolic import ShapeVector

MAX_UNROLL = 4096
"""The most iterations kiln unrolls: a longer loop would make a graph of that many copies of its body."""


def _shape(out: Output) -> tuple | None:
    """The shape of a carried value where it is known at import."""
    if isinstance(out, np.ndarray):
        return out.shape
    if isinstance(out, ShapeVector):
        return None
    return tuple(out.type.shape)  # a value or a parameter's symbol


def _flag(out: Output, what: str) -> bool:
    if not isinstance(out, np.ndarray):
        raise Unsupported(f"{what} is computed at run time; kiln unrolls loops whose conditions it knows at import")
    return bool(np.reshape(out, -1)[0])


@converts("Loop", since=1)
def _loop(call: NodeCall) -> Sequence[Output]:
    if call.inline is None:
        raise Unsupported("Loop inside a folded sub-graph")
    trips = call.value(0, "the trip count")
    if trips is None:
        raise Unsupported("a Loop without a trip count (M): kiln unrolls loops of a trip count known at import")
    trips = int(np.reshape(trips, -1)[0])
    if trips > MAX_UNROLL:
        raise Unsupported(f"trip count {trips} is more than the {MAX_UNROLL} iterations kiln unrolls")
    going = call.value(1, "the loop condition")
    going = True if going is None else bool(np.reshape(going, -1)[0])
    body = call.required("body")
    # as kiln values: a parameter stays one (a constant is still known to the body's nodes, which fold on it)
    carried: list[Output] = [call.input(i) for i in range(2, len(call.node.input))]
    scans: list[list[Output]] = [[] for _ in range(len(body.output) - 1 - len(carried))]
    for i in range(trips):
        if not going:
            break
        outs = call.inline(body, [np.array(i, np.int64), np.array(going), *carried])
        going = _flag(outs[0], f"the body's condition at iteration {i}")
        carried = _carry(carried, outs[1:1 + len(carried)], i)
        for scan, value in zip(scans, outs[1 + len(carried):]):
            scan.append(value)
    if scans and not scans[0]:
        raise Unsupported("a Loop of no iterations with scan outputs (their shape is unknown at import)")
    return (*carried, *(_stack(call, scan) for scan in scans))


def _carry(old: Sequence[Output], new: Sequence[Output], i: int) -> list[Output]:
    """The carried values after iteration i, which must keep their shapes."""
    for k, (before, after) in enumerate(zip(old, new)):
        if isinstance(after, ShapeVector) or _shape(before) != _shape(after):
            raise Unsupported(f"loop-carried value {k} changes from {_shape(before)} to {_shape(after)} at "
                              f"iteration {i}")
    return list(new)


@converts("Scan", since=9)
def _scan(call: NodeCall) -> Sequence[Output]:
    if call.inline is None:
        raise Unsupported("Scan inside a folded sub-graph")
    n, m, k = _counts(call, len(call.node.input))
    xs = [call.known[n + j] if call.known[n + j] is not None else call.input(n + j) for j in range(m)]
    return _unroll(call, [call.input(i) for i in range(n)], xs, _per(call, "scan_input_axes", m),
                   _per(call, "scan_input_directions", m), _per(call, "scan_output_axes", k),
                   _per(call, "scan_output_directions", k))


def _counts(call: NodeCall, inputs: int) -> tuple[int, int, int]:
    """Scan's state, scan-input and scan-output counts (of `inputs` state and scan inputs), checked against its
    body's inputs and outputs."""
    body, m = call.required("body"), int(call.required("num_scan_inputs"))
    if not 1 <= m <= inputs:
        raise Unsupported(f"num_scan_inputs = {m} for a Scan of {inputs} state and scan inputs")
    if len(body.input) != inputs:
        raise Unsupported(f"the body takes {len(body.input)} inputs, not the Scan's {inputs}")
    n = inputs - m
    if len(body.output) < n:
        raise Unsupported(f"the body gives {len(body.output)} outputs for {n} state variables")
    return n, m, len(body.output) - n


def _per(call: NodeCall, name: str, count: int) -> list[int]:
    """An attribute of one int per scan input or output (default all 0), checked to be that many."""
    values = [int(v) for v in call.attr(name, [0] * count)]
    if len(values) != count:
        raise Unsupported(f"{name} has {len(values)} entries for {count} scan inputs or outputs")
    return values


@converts("Scan", since=8, until=8)
def _scan8(call: NodeCall) -> Sequence[Output]:
    """Scan-8: every state and scan input has a leading batch axis (known at import), each batch row scanned
    along axis 1 as Scan-9 scans along axis 0; `sequence_lens` must be absent (every row the full length)."""
    if call.inline is None:
        raise Unsupported("Scan inside a folded sub-graph")
    if call.present(0):
        raise Unsupported("Scan-8 with sequence_lens: kiln scans every batch row to the full length")
    n, m, k = _counts(call, len(call.node.input) - 1)
    inputs = [call.known[i] if call.known[i] is not None else call.input(i) for i in range(1, len(call.node.input))]
    batches = {(x.shape if isinstance(x, np.ndarray) else x.type.shape)[0] for x in inputs}
    if None in batches or len(batches) != 1:
        raise Unsupported(f"Scan-8 batch dims {sorted(map(str, batches))}: kiln needs one batch size known at import")
    rows = [_unroll(call, [_element(call, x, 0, b) for x in inputs[:n]], [_element(call, x, 0, b) for x in inputs[n:]],
                    [0] * m, _per(call, "directions", m), [0] * k, [0] * k) for b in range(batches.pop())]
    return [_stack(call, list(values)) for values in zip(*rows)]


def _unroll(call: NodeCall, carried: list[Output], xs: list[np.ndarray | Value], axes: Sequence[int],
            backwards: Sequence[int], out_axes: Sequence[int], reverse: Sequence[int]) -> list[Output]:
    """Scan's outputs, its body converted once per element of the scan inputs along `axes` (`backwards`: from the
    end), each scan output stacked along its `out_axes` (`reverse`: last iteration first)."""
    body, n = call.required("body"), len(carried)
    ranks = [x.ndim if isinstance(x, np.ndarray) else x.type.rank for x in xs]
    if 0 in ranks:
        raise Unsupported(f"scan input {ranks.index(0)} is a scalar; a scan input needs an axis to slice")
    for j, (a, r) in enumerate(zip(axes, ranks)):
        if not -r <= a < r:
            raise Unsupported(f"scan axis {a} of scan input {j}, of rank {r}")
    axes = [a % r for a, r in zip(axes, ranks)]
    lengths = {(x.shape if isinstance(x, np.ndarray) else x.type.shape)[a] for x, a in zip(xs, axes)}
    if None in lengths:
        j = next(j for j, (x, a) in enumerate(zip(xs, axes))
                 if not isinstance(x, np.ndarray) and x.type.shape[a] is None)
        name = call.node.input[len(call.node.input) - len(xs) + j]
        raise Unsupported(f"the sequence length is known only at run time (scan input {j}, {name!r}: {xs[j].type}, "
                          f"axis {axes[j]}); kiln's IR has no loop, so a Scan is unrolled and needs its length at "
                          f"import: give it with input_shapes={{{name!r}: [...]}}")
    if len(lengths) != 1:
        raise Unsupported(f"scan inputs of different lengths {sorted(lengths)}")
    (length,) = lengths
    if length > MAX_UNROLL:
        raise Unsupported(f"sequence length {length} is more than the {MAX_UNROLL} iterations kiln unrolls")
    scans: list[list[Output]] = [[] for _ in range(len(body.output) - n)]
    for t in range(length):
        elems = [_element(call, x, a, length - 1 - t if back else t) for x, a, back in zip(xs, axes, backwards)]
        outs = call.inline(body, [*carried, *elems])
        carried = _carry(carried, outs[:n], t)
        for scan, value in zip(scans, outs[n:]):
            scan.append(value)
    if scans and not length:
        raise Unsupported("a Scan of no iterations with scan outputs (their shape is unknown at import)")
    return [*carried, *(_stack(call, scan[::-1] if back else scan, a)
                        for scan, a, back in zip(scans, out_axes, reverse))]


def _element(call: NodeCall, x: np.ndarray | Value, axis: int, t: int) -> Output:
    """Element t of scan input x along `axis`, the axis removed."""
    if isinstance(x, np.ndarray):
        return np.take(x, t, axis=axis)
    part = call.emit("slice", x, starts=[t], ends=[t + 1], axes=[axis])
    return reshape_to(call, part, [d for i, d in enumerate(ShapeVector.of(part).items) if i != axis])


def _stack(call: NodeCall, values: list[Output], axis: int = 0) -> Output:
    """One scan output: the iterations' values along a new axis (negative counts from the stacked rank)."""
    if all(isinstance(v, np.ndarray) for v in values):
        return np.stack(values, axis)  # type: ignore[arg-type]
    parts = [call.constant(v) if isinstance(v, np.ndarray) else v for v in values]
    if any(isinstance(p, ShapeVector) for p in parts):
        raise Unsupported("a scan output that is a shape computed at run time")
    rank = parts[0].type.rank + 1
    if not -rank <= axis < rank:
        raise Unsupported(f"scan output axis {axis} for outputs of rank {rank}")
    axis %= rank
    rows = [reshape_to(call, p, [*(items := ShapeVector.of(p).items)[:axis], 1, *items[axis:]]) for p in parts]
    return rows[0] if len(rows) == 1 else call.emit("concat", *rows, axis=axis)
