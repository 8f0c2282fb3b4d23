"""The symbol resolver: parameters, flags and derivations (of derivations) resolved once, through callbacks."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.ir import Builder, DType, Interpreter, VerifyError
from kiln.ir.symbols import SymbolResolver

RNG = np.random.default_rng(3)
P, Q = RNG.normal(size=(2, 2)), RNG.normal(size=(2, 2))


def derived_of_derived():
    """@h = add(@p, @q); @w = mul(@h, @p): a derivation whose operand is itself derived (as QLoRA's lora over a
    dequantize)."""
    b = Builder("M")
    b.param("p", (2, 2), DType.f64, data=P)
    b.param("q", (2, 2), DType.f64, data=Q)
    b.flag("training", True)
    b.reparam("h", "add", "p", "q")
    b.reparam("w", "mul", "h", "p")
    return b.build()


def test_a_derivation_of_a_derivation_resolves_recursively_and_once() -> None:
    graph = derived_of_derived()
    derived: list[str] = []

    def derive(node, operands, types):
        derived.append(node.name)
        assert [str(t) for t in types] == [str(graph.symbol(o).type) for o in node.operands]
        return f"{node.kind}({', '.join(operands)})"

    resolve = SymbolResolver(graph, lambda p: p.name, lambda f: f"flag {f.value}", derive)
    assert resolve("w") == "mul(add(p, q), p)"
    assert resolve("h") == "add(p, q)" and resolve("w") == "mul(add(p, q), p)"
    assert derived == ["h", "w"]  # memoized: h once, though w and the caller both use it
    assert resolve("training") == "flag True"
    with pytest.raises(VerifyError, match="@nope is not a symbol"):
        resolve("nope")


def test_the_interpreter_resolves_derivations_through_it() -> None:
    """Against numpy: w = (p + q) * p; an override replaces a stored value before anything derives from it."""
    np.testing.assert_allclose(Interpreter(derived_of_derived()).symbol("w"), (P + Q) * P)
    np.testing.assert_allclose(Interpreter(derived_of_derived(), {"p": Q}).symbol("w"), (Q + Q) * Q)


def test_graph_reads_follows_derivations_to_every_stored_symbol() -> None:
    """What lowering passes as parameters and materialize drops: a derived symbol reads its operands, recursively."""
    graph = derived_of_derived()
    assert graph.reads(["w"]) == {"w", "h", "p", "q"}
    assert graph.reads(["h", "training"]) == {"h", "p", "q", "training"}
    assert graph.reads(["p"]) == {"p"} and graph.reads([]) == set()
