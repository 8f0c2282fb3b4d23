"""ParamGroup's matching rules (burn-notes §2.7): constructors, path-less values, exclude and fuse."""

from __future__ import annotations

import pytest

from kiln.ir import ParamGroupError
from kiln.passes.group import ParamGroup


@pytest.mark.parametrize(("group", "path", "hit"), [
    (ParamGroup.all(), "a.b", True),
    (ParamGroup.from_path("enc.w"), "enc.w", True),
    (ParamGroup.from_path("enc.w"), "enc.w2", False),
    (ParamGroup.from_paths(["x", "enc.w"]), "enc.w", True),
    (ParamGroup.from_predicate("enc"), "layers.enc.w", True),
    (ParamGroup.from_predicates(["enc", "bias"]), "enc.weight", False),
    (ParamGroup.from_predicates(["enc", "bias"]), "enc.bias", True),
    (ParamGroup.from_any_predicates(["dec", "bias"]), "enc.bias", True),
    (ParamGroup.from_regex(r"\.\d+\."), "layers.3.weight", True),
    (ParamGroup.from_regexes([r"^layers", r"bias$"]), "layers.0.weight", False),
    (ParamGroup.from_any_regexes([r"^dec", r"bias$"]), "layers.0.bias", True),
    (ParamGroup.from_glob("encoder.*.weight"), "encoder.0.weight", True),
    (ParamGroup.from_glob("encoder.*.weight"), "encoder.0.attn.weight", False),
    (ParamGroup.from_glob("encoder.**.weight"), "encoder.0.attn.weight", True),
    (ParamGroup.from_glob("fc?.bias"), "fc1.bias", True),
])
def test_path_matchers(group, path, hit):
    assert group.matches(7, path) is hit


def test_path_matchers_never_match_without_a_path_but_all_and_ids_do():
    assert ParamGroup.all().matches(1, None)
    assert ParamGroup.from_ids([1]).matches(1, None) and not ParamGroup.from_ids([1]).matches(2, None)
    for g in (ParamGroup.from_path("a"), ParamGroup.from_predicate("a"), ParamGroup.from_regex("a"),
              ParamGroup.from_glob("a")):
        assert not g.matches(1, None)


def test_exclude_adds_the_matcher_and_ignores_its_excludes():
    inner = ParamGroup.from_predicate("enc").exclude(ParamGroup.from_predicate("bias"))
    g = ParamGroup.all().exclude(inner)
    assert not g.matches(1, "enc.bias")  # inner's own exclude of "bias" is ignored
    assert g.matches(1, "dec.bias")


def test_fuse_is_or_and_drops_excludes():
    a = ParamGroup.from_predicate("enc").exclude(ParamGroup.from_predicate("bias"))
    fused = a.fuse(ParamGroup.from_predicate("dec"))
    assert fused.matches(1, "enc.bias") and fused.matches(1, "dec.w") and not fused.matches(1, "head.w")


def test_python_predicates_see_path_and_param():
    class P:
        def __init__(self, id):
            self.id = id

    g = ParamGroup.from_fn(lambda path, p: p.id % 2 == 0 and path is not None and path.endswith("weight"))
    assert g.matches(2, "fc.weight", P(2)) and not g.matches(3, "fc.weight", P(3))
    assert not g.matches(2, "fc.bias", P(2))


@pytest.mark.parametrize("bad", [lambda: ParamGroup.from_regex("("), lambda: ParamGroup.from_glob(""),
                                 lambda: ParamGroup.from_option_text(["id:zz"])])
def test_invalid_patterns_raise_a_clear_error(bad):
    with pytest.raises(ParamGroupError):
        bad()


def test_option_text_terms():
    g = ParamGroup.from_option_text(["enc.*", "re:^dec", "id:0x1f"], exclude=["*.bias"])
    assert g.matches(0, "enc.w") and g.matches(0, "dec.x.y") and g.matches(31, "anything")
    assert not g.matches(0, "enc.bias") and not g.matches(0, "head.w")


# ParamIds in group terms and messages take Burn's display form (burn-notes §1.6: 123456 → `83h0200000000`).
def test_group_id_terms_take_hex_and_burns_form():
    for term in ("id:0x1e240", "id:83h0200000000"):
        group = ParamGroup.from_option_text([term])
        assert group.matches(123456, None) and not group.matches(123457, None)


def test_group_messages_show_ids_in_burns_form():
    assert str(ParamGroup.from_ids([123456])) == "from_ids([83h0200000000])"


@pytest.mark.parametrize("term", ["id:83H0200000000", "id:zz", "id:0x"])
def test_a_bad_group_id_term_is_a_group_error_naming_it(term):
    with pytest.raises(ParamGroupError, match=f"group term '{term}': invalid ParamId '{term[3:]}'"):
        ParamGroup.from_option_text([term])


def test_from_ids_refuses_a_non_u64_naming_it():
    with pytest.raises(ParamGroupError, match="ParamId -1 is not a u64"):
        ParamGroup.from_ids([-1])
