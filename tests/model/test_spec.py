"""The attention spec: the examples of the grammar, round trips, errors that name the bad token."""
import importlib.util

import pytest

from stableflash.attention import PrecisionPolicy, ShiftRule, Stabilization
from stableflash.attention.stabilization import parse_stabilize
from stableflash.model import AttentionChoice, AttentionSpec, parse_attention_spec

EXAMPLES = [
    "sdpa",
    "triton stabilize=tie-shift",
    "sdpa; 2: emulated policy=paper",
    "emulated policy=paper; 2: emulated policy=paper hp_heads=1,7,8",
    "*: emulated policy=paper stabilize=paper beta=4; 0-1,5: sdpa",
    "2: emulated policy=paper acc=fp32 delta=dP*P",
    "triton stabilize=tie-shift policy=fa2 out=e8m4 delta=dO*O32",
    "emulated low=fp16 p_bar=bf16:stochastic block=16; 3-4: reference; 1: triton stabilize=all-shift eps=1e-05",
]


def test_single_backend():
    spec = parse_attention_spec("sdpa")
    assert spec.default == AttentionChoice("sdpa") and spec.overrides == ()
    assert spec.choice(0) == spec.choice(11) == AttentionChoice()
    c = parse_attention_spec("triton stabilize=tie-shift").choice(3)
    assert (c.backend, c.stabilize, c.beta, c.eps, c.policy, c.block) == ("triton", "tie-shift", 2.0, 1e-3, None, 64)
    assert c.stabilization == Stabilization(ShiftRule("tie-shift"), consistent_delta=False)


def test_a_bare_backend_is_stabilized_as_flash_attention_is():
    """``triton`` means what ``flash_attention(backend="triton")`` means: the default stabilization;
    unstabilized is asked for by name; sdpa cannot be stabilized and is "none"."""
    for backend in ("triton", "emulated", "reference"):
        c = parse_attention_spec(backend).default
        assert c.stabilize == "consistent-delta" and c.kwargs()["stabilize"] == parse_stabilize(True), backend
        assert parse_attention_spec(f"{backend} stabilize=none").default.kwargs()["stabilize"] == parse_stabilize(False)
    assert parse_attention_spec("sdpa").default.stabilize == "none"
    assert parse_attention_spec("sdpa stabilize=none") == parse_attention_spec("sdpa")


def test_layer_override_keeps_preset_name():
    spec = parse_attention_spec("sdpa; 2: emulated policy=paper")
    assert [spec.choice(i).backend for i in range(4)] == ["sdpa", "sdpa", "emulated", "sdpa"]
    assert spec.choice(2).policy == "paper"          # a bare preset stays a name, resolved per dtype


def test_hp_heads_override():
    spec = parse_attention_spec("emulated policy=paper; 2: emulated policy=paper hp_heads=1,7,8")
    assert spec.choice(0).policy == "paper"
    p = spec.choice(2).policy
    assert isinstance(p, PrecisionPolicy)
    assert p == PrecisionPolicy.preset("paper").replace(hp_heads=(1, 7, 8))
    assert p.hp_heads == (1, 7, 8) and p.acc == "bf16"


def test_star_default_and_layer_list():
    spec = parse_attention_spec("*: emulated policy=paper stabilize=paper beta=4; 0-1,5: sdpa")
    stab = AttentionChoice("emulated", stabilize="paper", beta=4.0, policy="paper")
    assert spec.default == stab
    assert [spec.choice(i) for i in range(7)] == [AttentionChoice()] * 2 + [stab] * 3 + [AttentionChoice(), stab]


def test_overrides_without_default_entry_start_from_sdpa():
    spec = parse_attention_spec("2: emulated policy=paper acc=fp32 delta=dP*P")
    assert spec.default == AttentionChoice("sdpa")
    p = spec.choice(2).policy
    assert p == PrecisionPolicy.preset("paper").replace(acc="fp32", delta="dP·P")
    assert (p.acc, p.delta, p.row_sum, p.scores) == ("fp32", "dP·P", "bf16", "bf16")


@pytest.mark.parametrize("alias", ["dP·P", "dP*P", "dp_p"])
def test_delta_aliases(alias):
    assert parse_attention_spec(f"emulated delta={alias}").default.policy.delta == "dP·P"


def test_fields_without_policy_start_from_fa2_and_low():
    p = parse_attention_spec("emulated out=fp32").default.policy
    assert p == PrecisionPolicy.preset("fa2").replace(out="fp32")
    p16 = parse_attention_spec("emulated policy=paper low=fp16").default.policy
    assert p16 == PrecisionPolicy.preset("paper", low="fp16") and p16.inputs == "fp16"


def test_later_entries_win():
    spec = parse_attention_spec("emulated; 1-3: reference; 2: sdpa")
    assert [spec.choice(i).backend for i in range(5)] == ["emulated", "reference", "sdpa", "reference", "emulated"]
    assert parse_attention_spec("1: reference; triton").overrides == ()     # a later default resets all


def test_kwargs():
    kw = parse_attention_spec("emulated stabilize=paper beta=4 policy=paper block=16").default.kwargs()
    assert kw == {"backend": "emulated", "stabilize": Stabilization(ShiftRule("paper", beta=4.0), False),
                  "policy": "paper", "block_k": 16}
    assert AttentionChoice().kwargs() == {"backend": "sdpa", "stabilize": parse_stabilize("none"), "policy": None}
    if importlib.util.find_spec("triton"):       # the kernels take a key block under "paper"
        assert parse_attention_spec("triton policy=paper block=512").default.kwargs()["block_k"] == 512


@pytest.mark.parametrize("text", EXAMPLES)
def test_round_trip(text):
    spec = parse_attention_spec(text)
    assert parse_attention_spec(str(spec)) == spec
    assert hash(parse_attention_spec(str(spec))) == hash(spec)


def test_str_is_compact():
    assert str(parse_attention_spec("*: emulated policy=paper stabilize=paper beta=4; 0-1,5: sdpa")) == \
        "emulated stabilize=paper beta=4 policy=paper; 0-1,5: sdpa"
    assert str(parse_attention_spec("2: emulated policy=paper acc=fp32 delta=dP*P")) == \
        "sdpa; 2: emulated policy=paper acc=fp32 delta=dP·P"


def test_round_trip_of_built_policies():
    custom = PrecisionPolicy(out="fp32", hp_heads=(0, 3))          # named "custom", not a preset
    for policy in (custom, PrecisionPolicy.preset("paper"), PrecisionPolicy.preset("paper", low="e5m2"),
                   PrecisionPolicy.preset("fp32")):
        spec = AttentionSpec(AttentionChoice("emulated", policy=policy))
        again = parse_attention_spec(str(spec))
        assert again == spec, str(spec)
        got = again.default.policy
        got = PrecisionPolicy.preset(got) if isinstance(got, str) else got
        assert got.replace(name="x") == policy.replace(name="x")      # same rounding at every point
    # a built bf16 preset is not the bare name (which becomes fp16 for fp16 inputs)
    assert str(AttentionChoice("emulated", policy=PrecisionPolicy.preset("paper"))) == "emulated policy=paper low=bf16"


@pytest.mark.parametrize("text, token", [
    ("flash", "flash"),                                        # unknown backend
    ("sdpa; 2: fast", "fast"),
    ("emulated colour=red", "colour"),                         # unknown key
    ("triton stabilize=maximal", "maximal"),                   # bad stabilization
    ("triton rule=tie-shift", "rule"),                         # a key of the earlier grammar
    ("triton stabilize=ours", "ours"),                         # a name of the earlier grammar
    ("sdpa stabilize=tie-shift", "tie-shift"),                 # sdpa cannot stabilize
    ("sdpa", None),
    ("reference policy=paper", "policy"),                      # reference takes no policy
    ("sdpa acc=fp32", "policy"),
    ("-1: emulated", "-1"),                                    # negative layer
    ("2-1: emulated", "2-1"),
    ("x: emulated", "x"),
    ("emulated stabilize=tie-shift stabilize=paper", "stabilize"),            # duplicate key
    ("emulated beta=big", "big"),
    ("emulated beta=0.5", "beta"),
    ("emulated policy=fa3", "fa3"),
    ("emulated acc=fp33", "fp33"),
    ("emulated hp_heads=1,x", "1,x"),
    ("emulated low=fp17", "fp17"),
    ("triton block=32", "block"),                              # a key block only under "paper"
    ("triton policy=paper block=48", "block"),
    ("sdpa block=32", "block"),
    ("emulated block=0", "block"),
    ("emulated policy", "policy"),
    ("2: ", "2:"),
    ("", "empty"),
])
def test_bad_specs_name_the_token(text, token):
    if token is None:
        parse_attention_spec(text)
        return
    with pytest.raises(ValueError) as err:
        parse_attention_spec(text)
    assert token in str(err.value)
    assert "accepted" in str(err.value)


def test_choice_validation():
    with pytest.raises(ValueError, match="sdpa.*tie-shift"):
        AttentionChoice("sdpa", stabilize="tie-shift")
    with pytest.raises(ValueError, match="sdpa.*consistent-delta"):
        AttentionChoice("sdpa", stabilize="consistent-delta")
    with pytest.raises(ValueError, match="reference.*paper"):
        AttentionChoice("reference", policy="paper")
    with pytest.raises(ValueError, match="auto"):
        AttentionChoice("auto")
    with pytest.raises(TypeError, match="policy"):
        AttentionChoice("emulated", policy=3)


def test_check_against_model_shape():
    spec = parse_attention_spec("sdpa; 3: emulated hp_heads=1,7,8")
    spec.check(n_layer=4, n_head=12)
    with pytest.raises(ValueError, match="layer 3.*n_layer=3"):
        spec.check(n_layer=3, n_head=12)
    with pytest.raises(ValueError, match="hp_heads=7,8.*n_head=4"):
        spec.check(n_layer=4, n_head=4)
    with pytest.raises(ValueError, match="-1"):
        spec.choice(-1)


def test_with_layers():
    spec = parse_attention_spec("sdpa; 0: reference")
    stab = AttentionChoice("triton", stabilize="tie-shift")
    new = spec.with_layers([1, 3], stab)
    assert [new.choice(i) for i in range(4)] == [AttentionChoice("reference"), stab, AttentionChoice(), stab]
    assert spec.choice(1) == AttentionChoice()                       # the original is unchanged
    assert new == parse_attention_spec("sdpa; 0: reference; 1,3: triton stabilize=tie-shift")
    assert spec.with_layers(2, "emulated policy=paper").choice(2).policy == "paper"
    assert new.with_layers([1, 3], AttentionChoice()) == spec         # back to the default: no override left
    with pytest.raises(ValueError, match="-2"):
        spec.with_layers([-2], stab)


def test_a_consistent_delta_has_one_spelling_in_a_spec():
    """``delta=consistent`` (and its earlier spelling ``delta=auto``) is the stabilization's
    ``+consistent-delta``, written that way, and resolves where a backend reads it to the δ source
    ``consistent_delta_source`` names for the policy's rounding."""
    import torch

    from stableflash.attention.policy import resolve_policy
    for text, want in (("triton stabilize=tie-shift delta=consistent", "dO·(O+R)"),
                       ("triton stabilize=tie-shift policy=fa2 p_bar=fp8_e4m3 out=fp8_e4m3 delta=auto", "dO·(O16+R)"),
                       ("emulated stabilize=tie-shift policy=paper acc=e8m5 row_sum=e8m5 out=e8m5 delta=consistent",
                        "dP·P")):
        spec = parse_attention_spec(text)
        assert "stabilize=tie-shift+consistent-delta" in str(spec) and " delta=" not in str(spec)
        assert parse_attention_spec(str(spec)) == spec
        kw = spec.default.kwargs()
        assert kw["stabilize"].policy_for(resolve_policy(kw["policy"], torch.bfloat16)).delta == want
    assert parse_attention_spec("triton delta=consistent") == parse_attention_spec("triton")
    assert parse_attention_spec("triton stabilize=none delta=auto") == parse_attention_spec("triton")


def test_consistent_delta_sources_say_what_the_consistent_delta_runs():
    spec = parse_attention_spec("triton stabilize=none policy=fa2 p_bar=fp8_e4m3 out=fp8_e4m3; "
                                "1: triton policy=fa2 p_bar=fp8_e4m3 out=fp8_e4m3; "
                                "2: triton policy=fa2 out=e8m4; 3: emulated policy=paper; "
                                "4: triton policy=fa2 out=e8m4 stabilize=tie-shift+consistent-delta")
    assert spec.consistent_delta_sources() == ["dO·(O16+R)", "dO·(O+R)", "dP·P"]
    assert parse_attention_spec("triton").consistent_delta_sources() == ["dO·(O+R)"]
    assert parse_attention_spec("emulated policy=fp32").consistent_delta_sources() == ["dO·O"]
    for text in ("sdpa", "triton stabilize=tie-shift", "triton policy=fa2 out=e8m4 delta=dP*P",
                 "emulated stabilize=none policy=paper"):
        assert parse_attention_spec(text).consistent_delta_sources() == [], text


@pytest.mark.parametrize("old, new", [
    ("triton", "triton stabilize=none"),
    ("triton rule=ours", "triton stabilize=tie-shift"),
    ("triton delta=auto", "triton"),
    ("triton rule=ours delta=auto", "triton stabilize=tie-shift+consistent-delta"),
    ("emulated policy=paper rule=bounded beta=4", "emulated stabilize=all-shift beta=4 policy=paper"),
    ("sdpa; 2: emulated policy=paper acc=fp32 delta=dP*P", "sdpa; 2: emulated stabilize=none policy=paper acc=fp32 delta=dP·P"),
    ("*: emulated policy=paper rule=paper; 0-1,5: sdpa", "emulated stabilize=paper policy=paper; 0-1,5: sdpa"),
    ("triton stabilize=none", "triton stabilize=none"),                  # already of this grammar
])
def test_a_stored_spec_of_the_earlier_grammar_keeps_its_meaning(old, new):
    from stableflash.model.spec import upgrade_stored_spec
    assert parse_attention_spec(upgrade_stored_spec(old)) == parse_attention_spec(new)


@pytest.mark.parametrize("old, new", [("delta=auto", "delta=consistent"), ("rule=ours", "stabilize=tie-shift"),
                                      ("rule=ours delta=auto", "stabilize=tie-shift delta=consistent"),
                                      ("rule=paper beta=4", "stabilize=paper beta=4"), ("delta=dP*P", "delta=dP*P")])
def test_a_stored_switch_of_the_earlier_grammar_keeps_its_meaning(old, new):
    from stableflash.model.spec import upgrade_stored_settings
    assert upgrade_stored_settings(old) == new
