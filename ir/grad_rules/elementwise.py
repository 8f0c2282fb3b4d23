"""Gradients of elementwise ops: unary math and activations, broadcasting arithmetic, comparisons, where, cast."""

from __future__ import annotations

import math

from ..gradients import GradContext, Grads, emit, gradient, is_float, scalar, unbroadcast
from ..graph import Op, Value


def unary(*kinds: str):
    """Register fn(fb, g, x, y, attrs) -> dx as the rule of a one-operand op."""
    def register(fn):
        def rule(ctx: GradContext, op: Op, out_grads: Grads) -> Grads:
            (x,), (y,), (g,) = op.operands, op.results, out_grads
            if g is None or not is_float(x) or not ctx.wanted(0):
                return (None,)
            return (fn(ctx, g, x, y, op.attrs),)
        gradient(*kinds)(rule)
        return fn
    return register


def _mul(fb, a, b):
    return emit(fb, "mul", a, b)


def _c(fb, v: float, like) -> Value:
    return scalar(fb, v, like.type.dtype)


@unary("neg")
def _neg(fb, g, x, y, attrs):
    return emit(fb, "neg", g)


@unary("abs")
def _abs(fb, g, x, y, attrs):
    """g * sign(x), with sign(0) = 0 as torch's."""
    zero = _c(fb, 0.0, g)
    return emit(fb, "where", emit(fb, "greater", x, zero), g,
                emit(fb, "where", emit(fb, "less", x, zero), emit(fb, "neg", g), zero))


@unary("relu")
def _relu(fb, g, x, y, attrs):
    """g where x > 0 (0 at x = 0, as torch's threshold_backward)."""
    zero = _c(fb, 0.0, g)
    return emit(fb, "where", emit(fb, "greater", x, zero), g, zero)


@unary("leaky_relu")
def _leaky_relu(fb, g, x, y, attrs):
    """g where x > 0, alpha * g elsewhere (torch's convention at 0)."""
    return emit(fb, "where", emit(fb, "greater", x, _c(fb, 0.0, x)), g, _mul(fb, g, _c(fb, attrs["alpha"], g)))


@unary("exp")
def _exp(fb, g, x, y, attrs):
    return _mul(fb, g, y)


@unary("log")
def _log(fb, g, x, y, attrs):
    return emit(fb, "div", g, x)


@unary("sqrt")
def _sqrt(fb, g, x, y, attrs):
    """g / (2 sqrt(x))."""
    return emit(fb, "div", g, _mul(fb, y, _c(fb, 2.0, y)))


@unary("rsqrt")
def _rsqrt(fb, g, x, y, attrs):
    """-g / 2 * x^(-3/2) = -g / 2 * y^3."""
    cube = _mul(fb, _mul(fb, y, y), y)
    return _mul(fb, g, _mul(fb, cube, _c(fb, -0.5, y)))


@unary("tanh")
def _tanh(fb, g, x, y, attrs):
    return _mul(fb, g, emit(fb, "sub", _c(fb, 1.0, y), _mul(fb, y, y)))


@unary("sigmoid")
def _sigmoid(fb, g, x, y, attrs):
    return _mul(fb, g, _mul(fb, y, emit(fb, "sub", _c(fb, 1.0, y), y)))


@unary("silu")
def _silu(fb, g, x, y, attrs):
    """d(x s) = s (1 + x (1 - s)) with s = sigmoid(x)."""
    s = emit(fb, "sigmoid", x)
    one = _c(fb, 1.0, x)
    return _mul(fb, g, _mul(fb, s, emit(fb, "add", one, _mul(fb, x, emit(fb, "sub", one, s)))))


@unary("gelu")
def _gelu(fb, g, x, y, attrs):
    """Phi(x) + x phi(x) exactly; the tanh form's derivative as torch's gelu_backward computes it."""
    if attrs["approximate"] == "tanh":
        beta, kappa = math.sqrt(2 / math.pi), 0.044715
        x2 = _mul(fb, x, x)
        inner = _mul(fb, _c(fb, beta, x), emit(fb, "add", x, _mul(fb, _c(fb, kappa, x), _mul(fb, x2, x))))
        t = emit(fb, "tanh", inner)
        one = _c(fb, 1.0, x)
        left = _mul(fb, _c(fb, 0.5, x), emit(fb, "add", one, t))
        dinner = _mul(fb, _c(fb, beta, x), emit(fb, "add", one, _mul(fb, _c(fb, 3 * kappa, x), x2)))
        right = _mul(fb, _mul(fb, _mul(fb, _c(fb, 0.5, x), x), emit(fb, "sub", one, _mul(fb, t, t))), dinner)
        return _mul(fb, g, emit(fb, "add", left, right))
    cdf = _mul(fb, _c(fb, 0.5, x), emit(fb, "add", _c(fb, 1.0, x),
                                        emit(fb, "erf", _mul(fb, x, _c(fb, 1 / math.sqrt(2), x)))))
    pdf = _mul(fb, emit(fb, "exp", _mul(fb, _mul(fb, x, x), _c(fb, -0.5, x))), _c(fb, 1 / math.sqrt(2 * math.pi), x))
    return _mul(fb, g, emit(fb, "add", cdf, _mul(fb, x, pdf)))


@unary("erf")
def _erf(fb, g, x, y, attrs):
    """g * 2 / sqrt(pi) * exp(-x^2)."""
    e = emit(fb, "exp", emit(fb, "neg", _mul(fb, x, x)))
    return _mul(fb, g, _mul(fb, e, _c(fb, 2 / math.sqrt(math.pi), x)))


@unary("floor", "ceil", "round", "sign")
def _piecewise_constant(fb, g, x, y, attrs):
    """Piecewise constant: the gradient is zero almost everywhere (torch's too), so none flows back."""
    return None


@unary("cast")
def _cast(fb, g, x, y, attrs):
    """Float to float: the gradient cast back; from an integer or bool result none reaches here (not float)."""
    return emit(fb, "cast", g, dtype=x.type.dtype) if g.type.dtype is not x.type.dtype else g


# --- binary, broadcasting


def binary(*kinds: str):
    """Register fn(fb, g, lhs, rhs, y, want_l, want_r) -> (dl, dr) in the broadcast shape; unbroadcast after."""
    def register(fn):
        def rule(ctx: GradContext, op: Op, out_grads: Grads) -> Grads:
            (lhs, rhs), (y,), (g,) = op.operands, op.results, out_grads
            want = [is_float(o) and ctx.wanted(i) for i, o in enumerate(op.operands)]
            if g is None or not any(want):
                return (None, None)
            dl, dr = fn(ctx, g, lhs, rhs, y, *want)
            return (unbroadcast(ctx, dl, lhs.type) if want[0] and dl is not None else None,
                    unbroadcast(ctx, dr, rhs.type) if want[1] and dr is not None else None)
        gradient(*kinds)(rule)
        return fn
    return register


@binary("add")
def _add(fb, g, lhs, rhs, y, wl, wr):
    return g, g


@binary("sub")
def _sub(fb, g, lhs, rhs, y, wl, wr):
    return g, emit(fb, "neg", g) if wr else None


@binary("mul")
def _mulrule(fb, g, lhs, rhs, y, wl, wr):
    return (_mul(fb, g, rhs) if wl else None, _mul(fb, g, lhs) if wr else None)


@binary("div")
def _div(fb, g, lhs, rhs, y, wl, wr):
    """d lhs = g / rhs; d rhs = -g lhs / rhs^2 (as torch)."""
    dl = emit(fb, "div", g, rhs) if wl else None
    dr = emit(fb, "neg", emit(fb, "div", _mul(fb, g, lhs), _mul(fb, rhs, rhs))) if wr else None
    return dl, dr


@binary("pow")
def _pow(fb, g, lhs, rhs, y, wl, wr):
    """As torch: d base = g e b^(e-1), 0 where e = 0; d exponent = g y log(b), 0 where b = 0 and e >= 0."""
    zero = _c(fb, 0.0, g)
    dl = dr = None
    if wl:
        d = _mul(fb, g, _mul(fb, rhs, emit(fb, "pow", lhs, emit(fb, "sub", rhs, _c(fb, 1.0, rhs)))))
        dl = emit(fb, "where", emit(fb, "equal", rhs, zero), zero, d)
    if wr:
        d = _mul(fb, g, _mul(fb, y, emit(fb, "log", lhs)))
        masked = emit(fb, "where", emit(fb, "less", rhs, zero), d, zero)  # base 0 and exponent >= 0: zero
        dr = emit(fb, "where", emit(fb, "equal", lhs, zero), masked, d)
    return dl, dr


def _extremum(pick: str):
    """maximum/minimum as torch: the gradient goes to the winner, split in halves on ties."""
    def fn(fb, g, lhs, rhs, y, wl, wr):
        zero = _c(fb, 0.0, g)
        half = _mul(fb, g, _c(fb, 0.5, g))
        tie = emit(fb, "equal", lhs, rhs)
        out = []
        for want, a, b in ((wl, lhs, rhs), (wr, rhs, lhs)):
            if want:
                out.append(emit(fb, "where", emit(fb, pick, a, b), g, emit(fb, "where", tie, half, zero)))
            else:
                out.append(None)
        return tuple(out)
    return fn


binary("maximum")(_extremum("greater"))
binary("minimum")(_extremum("less"))


@gradient("logical_not")
def _logical_not(ctx: GradContext, op: Op, out_grads: Grads) -> Grads:
    """Bool in, bool out: no gradient."""
    return (None,)


@gradient("equal", "less", "greater", "logical_and", "logical_or", "logical_xor")
def _comparison(ctx: GradContext, op: Op, out_grads: Grads) -> Grads:
    """Bool results are piecewise constant: no gradient."""
    return (None, None)


@gradient("where")
def _where(ctx: GradContext, op: Op, out_grads: Grads) -> Grads:
    """The gradient goes to the chosen side; none to the condition."""
    (cond, lhs, rhs), (g,) = op.operands, out_grads
    if g is None:
        return (None, None, None)
    zero = _c(ctx, 0.0, g)
    dl = unbroadcast(ctx, emit(ctx, "where", cond, g, zero), lhs.type) if is_float(lhs) and ctx.wanted(1) else None
    dr = unbroadcast(ctx, emit(ctx, "where", cond, zero, g), rhs.type) if is_float(rhs) and ctx.wanted(2) else None
    return (None, dl, dr)
