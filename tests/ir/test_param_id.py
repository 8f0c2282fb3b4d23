"""ParamId as Burn's type (`crates/burn-std/src/id.rs`). burn-notes §1.6: "`param_id` is stored as the raw `u64`
(`ParamId::val()`) ... `Display` is `BASE32_DNSSEC` (base32hex, lowercase, no padding) of the 8 LE bytes, e.g.
123456 → `83h0200000000`"."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import kiln
from kiln.ir import Builder, ParamId, new_param_id, parse, print_graph, seed_param_ids

u64 = st.one_of(st.integers(0, 2**64 - 1), st.sampled_from([0, 1, 2**63, 2**64 - 1]))
RFC4648_EXTENDED_HEX = "0123456789abcdefghijklmnopqrstuv"  # RFC 4648 §7 "base32hex", lower case


def burn_display(value: int) -> str:
    """The oracle: RFC 4648 base32hex written out bit by bit over the 8 little-endian bytes, unpadded."""
    bits = "".join(f"{byte:08b}" for byte in value.to_bytes(8, "little"))
    bits += "0" * (-len(bits) % 5)  # the last group is zero-filled, as RFC 4648 §6 specifies
    return "".join(RFC4648_EXTENDED_HEX[int(bits[i:i + 5], 2)] for i in range(0, len(bits), 5))


def test_display_is_burns_example():
    """burn-notes §1.6: "e.g. 123456 → `83h0200000000`"."""
    assert str(ParamId(123456)) == "83h0200000000"
    assert f"{ParamId(123456)}" == "83h0200000000" and f"{ParamId(123456):x}" == "1e240"


@given(u64)
def test_display_is_base32hex_of_the_little_endian_bytes_and_parses_back(value):
    pid = ParamId(value)
    assert str(pid) == burn_display(value)
    assert ParamId.parse(str(pid)) == value and type(ParamId.parse(str(pid))) is ParamId
    assert ParamId.from_text(str(pid)) == value and ParamId.from_text(f"0x{value:x}") == value


def test_parse_of_burns_example():
    assert ParamId.parse("83h0200000000") == 123456


@pytest.mark.parametrize("bad", ["83H0200000000", "83h020000000", "83h02000000000", "83h020000000w", "",
                                 "83h0200000001", "0x1e240"])
def test_bad_burn_text_is_a_value_error_naming_it(bad):
    """Burn writes lower case, 13 characters, the unused last bit zero: any other text is no id's display."""
    with pytest.raises(ValueError, match=f"invalid ParamId '{bad}'"):
        ParamId.parse(bad)


@pytest.mark.parametrize("bad", ["0x", "0x12345678901234567", "0xg", "1e240", "id", 123456], ids=repr)
def test_bad_user_text_is_a_value_error_naming_it(bad):
    with pytest.raises(ValueError, match=f"invalid ParamId {bad!r}"):
        ParamId.from_text(bad)
    with pytest.raises(ValueError, match=f"invalid ParamId {bad!r}"):
        ParamId.parse(bad)


def test_equal_to_and_hashed_as_its_int():
    assert ParamId(5) == 5 and hash(ParamId(5)) == hash(5) and isinstance(ParamId(5), int)
    table = {5: "int key"}
    assert table[ParamId(5)] == "int key"
    table[ParamId(5)] = "param id key"
    assert table == {5: "param id key"}
    assert repr(ParamId(123456)) == "ParamId.parse('83h0200000000')"


@pytest.mark.parametrize("bad", [-1, 2**64, True, 1.0, "83h0200000000"], ids=repr)
def test_a_non_u64_is_refused_naming_it(bad):
    with pytest.raises(ValueError, match=f"ParamId {bad!r} is not a u64"):
        ParamId(bad)


@given(st.text(RFC4648_EXTENDED_HEX, min_size=13, max_size=13))
def test_any_text_parse_accepts_is_exactly_that_ids_display(text):
    try:
        pid = ParamId.parse(text)
    except ValueError:
        assert int(text[-1], 32) % 2 == 1  # only a set unused last bit makes 13 such characters no display
    else:
        assert str(pid) == text == burn_display(pid)


def test_numpy_integers_are_ids_too():
    assert ParamId(np.uint64(2**64 - 1)) == 2**64 - 1 and type(ParamId(np.int64(5))) is ParamId


def test_fresh_ids_and_builder_ids_are_param_ids():
    assert type(new_param_id()) is ParamId
    b = Builder("M")
    b.param("w", (2,), id=5)
    b.flag("f", id=6)
    b.param("v", (2,))
    graph = b.build()
    assert [type(n.id) for n in (graph.params["w"], graph.flags["f"], graph.params["v"])] == [ParamId] * 3
    assert graph.params["w"].id == 5


KIR = """module @M {
  param @w : tensor<2xf32> {id = "%s", grad = true}
  func @f(%%x: tensor<2xf32>) -> (tensor<2xf32>) {
    %%y = add %%x, @w : tensor<2xf32>
    return %%y
  }
}
"""


def test_kir_keeps_hex_and_also_reads_burns_form():
    """The printer keeps `id = "0x..."`; the parser reads that and Burn's display form alike."""
    from_hex, from_burn = parse(KIR % "0x1e240"), parse(KIR % "83h0200000000")
    assert from_hex.params["w"].id == from_burn.params["w"].id == 123456
    assert type(from_burn.params["w"].id) is ParamId
    assert 'id = "0x000000000001e240"' in print_graph(from_burn)


def test_kir_refuses_a_bad_burn_form_naming_it():
    with pytest.raises(kiln.ir.IRParseError, match="invalid ParamId '83H0200000000'"):
        parse(KIR % "83H0200000000")


@pytest.mark.parametrize("bad", [-1, True, 1.5, "7"], ids=repr)
def test_seed_refuses_a_non_u64_naming_it(bad):
    with pytest.raises(ValueError, match=f"seed {bad!r} is not"):
        seed_param_ids(bad)
