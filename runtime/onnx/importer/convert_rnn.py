"""Converters of ONNX's LSTM and GRU with a static sequence length, unrolled into matmuls and gate arithmetic.

Per direction, the input projection of every step is one matmul (X [seq, batch, in] @ W^T); each step adds
H @ R^T and applies the gates. A missing initial state is zero, so the first step leaves out the recurrent
term (the batch dim may then be dynamic). Only the default activations are implemented; clip, input_forget
and a sequence_lens shorter than the sequence are refused.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kiln.ir import Value

from .call import NodeCall
from .registry import Unsupported, converts

_DEFAULT_ACTIVATIONS = {"LSTM": ("sigmoid", "tanh", "tanh"), "GRU": ("sigmoid", "tanh")}


def _check(call: NodeCall) -> None:
    """clip and non-default activations, which kiln does not implement."""
    if call.attr("clip") is not None:
        raise Unsupported("clip")
    given = call.attr("activations")
    default = _DEFAULT_ACTIVATIONS[call.node.op_type]
    if given is not None and tuple(a.lower() for a in given) != default * (len(given) // len(default)):
        raise Unsupported(f"activations = {list(given)}; kiln implements the defaults {list(default)}")


def _of_direction(call: NodeCall, v: Value, d: int) -> Value:
    """v [num_directions, ...] at direction d, without that axis."""
    one = call.emit("slice", v, starts=(d,), ends=(d + 1,), axes=(0,))
    return call.emit("reshape", one, shape=tuple(v.type.shape[1:]))  # type: ignore[arg-type]


def _gates(call: NodeCall, v: Value, hidden: int, count: int) -> list[Value]:
    """v [..., count * hidden] split into its gates along the last axis."""
    last = v.type.rank - 1
    return [call.emit("slice", v, starts=(g * hidden,), ends=((g + 1) * hidden,), axes=(last,)) for g in range(count)]


def _unroll(call: NodeCall, count: int, step: Callable[..., tuple[Value, ...]], states: int,
            inner: Sequence[int] = ()) -> Sequence[Value | None]:
    """Run `step(projected_t, state, r_t, inner_biases, direction) -> new states` over every direction and time
    step (`r_t`: R^T [hidden, count * hidden]; a state is None while it is zero). The input projection includes
    Wb + Rb except Rb's gates in `inner`, which go to `step`. Results: Y [seq, dirs, batch, hidden] and the
    final states [dirs, batch, hidden]."""
    x, w, r, b = call.input(0), call.input(1), call.input(2), call.optional(3)
    if call.attr("layout", 0):
        x = call.emit("transpose", x, perm=(1, 0, 2))
    seq, hidden = x.type.shape[0], call.required("hidden_size")
    if seq is None:
        raise Unsupported(f"the sequence length of {x.type} is dynamic; kiln unrolls a static one")
    lengths = call.value(4, "sequence_lens")
    if lengths is not None and (lengths != seq).any():
        raise Unsupported(f"sequence_lens = {lengths.tolist()} ends sequences before step {seq}; kiln runs them all")
    direction = call.attr("direction", "forward")
    dirs = {"forward": [False], "reverse": [True], "bidirectional": [False, True]}.get(direction)
    if dirs is None:
        raise Unsupported(f"direction = {direction!r}")
    initial = [call.optional(5 + i) for i in range(states)]
    if call.attr("layout", 0):
        initial = [None if v is None else call.emit("transpose", v, perm=(1, 0, 2)) for v in initial]
    ys, finals = [], [[] for _ in range(states)]
    for d, backwards in enumerate(dirs):
        wd, rd = (call.emit("transpose", _of_direction(call, v, d), perm=(1, 0)) for v in (w, r))
        projected = call.emit("matmul", x, wd)  # [seq, batch, count * hidden]
        inner_biases: list[Value] = []
        if b is not None:
            wb, rb = _gates(call, _of_direction(call, b, d), count * hidden, 2)
            bias = call.emit("add", wb, rb)
            if inner:
                wg, rg = _gates(call, wb, hidden, count), _gates(call, rb, hidden, count)
                inner_biases = [rg[g] for g in inner]
                parts = [wg[g] if g in inner else call.emit("add", wg[g], rg[g]) for g in range(count)]
                bias = call.emit("concat", *parts, axis=0)
            projected = call.emit("add", projected, bias)
        state = [None if v is None else _of_direction(call, v, d) for v in initial]
        hs: list[Value] = []
        for t in reversed(range(seq)) if backwards else range(seq):
            xt = call.emit("reshape", call.emit("slice", projected, starts=(t,), ends=(t + 1,), axes=(0,)),
                           shape=(-1, count * hidden))
            state = list(step(xt, state, rd, inner_biases, d))
            hs.append(call.emit("reshape", state[0], shape=(1, 1, -1, hidden)))
        ys.append(call.emit("concat", *(hs[::-1] if backwards else hs), axis=0) if seq > 1 else hs[0])
        for i in range(states):
            finals[i].append(call.emit("reshape", state[i], shape=(1, -1, hidden)))
    y = call.emit("concat", *ys, axis=1) if len(ys) > 1 else ys[0]
    last = [call.emit("concat", *f, axis=0) if len(f) > 1 else f[0] for f in finals]
    if call.attr("layout", 0):
        y = call.emit("transpose", y, perm=(2, 0, 1, 3))
        last = [call.emit("transpose", v, perm=(1, 0, 2)) for v in last]
    return (y, *last)


@converts("LSTM", since=7)
def _lstm(call: NodeCall) -> Sequence[Value | None]:
    """Gates i, o, f, c: C = f * C + i * tanh(c); H = o * tanh(C); peepholes P (i, o, f) add P_i * C and P_f * C
    of the previous cell to i and f, P_o * C of the new one to o."""
    _check(call)
    if call.attr("input_forget", 0):
        raise Unsupported("input_forget = 1")
    hidden = call.required("hidden_size")
    peepholes = call.optional(7)

    def step(xt, state, rd, _, d):
        pre = xt if state[0] is None else call.emit("add", xt, call.emit("matmul", state[0], rd))
        i, o, f, c = _gates(call, pre, hidden, 4)
        p_i, p_o, p_f = (None,) * 3 if peepholes is None else _gates(call, _of_direction(call, peepholes, d),
                                                                       hidden, 3)
        if p_i is not None and state[1] is not None:
            i, f = (call.emit("add", g, call.emit("mul", p, state[1])) for g, p in ((i, p_i), (f, p_f)))
        i, f = (call.emit("sigmoid", g) for g in (i, f))
        cell = call.emit("mul", i, call.emit("tanh", c))
        if state[1] is not None:
            cell = call.emit("add", call.emit("mul", f, state[1]), cell)
        if p_o is not None:
            o = call.emit("add", o, call.emit("mul", p_o, cell))
        return call.emit("mul", call.emit("sigmoid", o), call.emit("tanh", cell)), cell
    return _unroll(call, 4, step, 2)


@converts("GRU", since=7)
def _gru(call: NodeCall) -> Sequence[Value | None]:
    """Gates z, r, h: h = tanh(Xh + (r * H) Rh + Rbh), or under linear_before_reset tanh(Xh + r * (H Rh + Rbh));
    H = (1 - z) * h + z * H."""
    _check(call)
    reset_after = bool(call.attr("linear_before_reset", 0))
    hidden = call.required("hidden_size")

    def step(xt, state, rd, inner_biases, _):
        xz, xr, xh = _gates(call, xt, hidden, 3)
        h_prev = state[0]
        rz, rr, rh = (None,) * 3 if h_prev is None else _gates(call, call.emit("matmul", h_prev, rd), hidden, 3)
        z, r = (call.emit("sigmoid", a if c is None else call.emit("add", a, c)) for a, c in ((xz, rz), (xr, rr)))
        if reset_after:
            recurrent = [v for v in (rh, *inner_biases) if v is not None]
            if recurrent:
                summed = recurrent[0] if len(recurrent) == 1 else call.emit("add", *recurrent)
                xh = call.emit("add", xh, call.emit("mul", r, summed))
        elif h_prev is not None:
            rd_h = _gates(call, rd, hidden, 3)[2]
            xh = call.emit("add", xh, call.emit("matmul", call.emit("mul", r, h_prev), rd_h))
        new = call.emit("mul", call.emit("sub", call.constant(1.0, like=z), z), call.emit("tanh", xh))
        return (new if h_prev is None else call.emit("add", new, call.emit("mul", z, h_prev)),)
    return _unroll(call, 3, step, 1, inner=(2,) if reset_after else ())
