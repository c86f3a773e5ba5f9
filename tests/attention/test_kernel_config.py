"""The Triton backend's one configuration: launch.kernel_config builds a typed KernelConfig from a
policy, a rule, the dtype, a soft cap and a key block; the custom ops take it as one string
(``op_key``) and give it back unchanged. No kernel runs here."""
import copy
import dataclasses
import json
import math
import pickle
from enum import Enum

import pytest
import torch

from stableflash.attention import PrecisionPolicy, ShiftRule

pytest.importorskip("triton")
from stableflash.attention.triton import common, op  # noqa: E402
from stableflash.attention.triton.config import (OP_FIELDS, Arithmetic, DeltaSource, Format,  # noqa: E402
                                                 KernelConfig, RuleKind)
from stableflash.attention.triton.launch import (check_key_block, check_policy, kernel_config,  # noqa: E402
                                                stabilized_config)

FA2, PAPER = PrecisionPolicy.preset("fa2"), PrecisionPolicy.preset("paper")
E8M5 = PAPER.replace(acc="e8m5", row_sum="e8m5", out="e8m5")


def test_the_fa2_preset_narrows_only_o_in_bf16():
    c = kernel_config(FA2, ShiftRule("tie-shift"), torch.bfloat16)
    assert c == KernelConfig(arithmetic=Arithmetic.FA2, rule=RuleKind.TIE_SHIFT, beta=2.0, eps=1e-3,
                             min_shift=ShiftRule().min_shift, max_shift=ShiftRule().max_shift, narrow=Format.BF16,
                             narrow_out=True)
    assert not c.emulated and not c.p_bar_fp32 and c.softcap is None and c.block_k is None


def test_stabilized_config_is_what_the_default_call_resolves_to():
    """flash_attention(q, k, v) on bf16: FlashAttention-2 arithmetic, the standard row maximum, O
    stored in bf16 and δ from dO·(O + R); on fp16 O is stored in fp16 with the same δ source."""
    bf16 = stabilized_config(torch.bfloat16)
    assert bf16 == stabilized_config()
    assert (bf16.arithmetic, bf16.narrow, bf16.narrow_out, bf16.delta) == (
        Arithmetic.FA2, Format.BF16, True, DeltaSource.DO_O_R)
    assert bf16.rule == kernel_config(PrecisionPolicy.preset("fa2", "bf16"), ShiftRule(), torch.bfloat16).rule
    assert stabilized_config(torch.float16).narrow is Format.FP16


def test_paper_policies_narrow_acc_row_sum_and_out_in_one_format():
    c = kernel_config(E8M5.replace(out="fp32", hp_heads=(3, 1)), ShiftRule("all-shift", beta=4.0), torch.bfloat16,
                      30, 64)
    assert (c.arithmetic, c.rule, c.beta, c.narrow) == (Arithmetic.PAPER, RuleKind.ALL_SHIFT, 4.0, Format.E8M5)
    assert (c.narrow_acc, c.narrow_row_sum, c.narrow_out, c.stochastic) == (True, True, False, False)
    assert c.delta is DeltaSource.DO_O_FP32            # out=fp32 with δ from dO·O: the forward keeps that O
    assert (c.hp_heads, c.softcap, c.block_k) == ((1, 3), 30.0, 64)
    s = kernel_config(PAPER.replace(acc="e8m3:stochastic", row_sum="fp32", out="e8m3:stochastic"), ShiftRule(),
                      torch.bfloat16)
    assert (s.narrow, s.narrow_acc, s.narrow_row_sum, s.narrow_out, s.stochastic) == (
        Format.E8M3, True, False, True, True)


def test_p_bar_formats_and_the_fp8_product():
    rule = ShiftRule("tie-shift")
    fp32 = kernel_config(FA2.replace(p_bar="fp32"), rule, torch.bfloat16)
    assert fp32.p_bar is Format.FP32 and fp32.p_bar_fp32 and not fp32.fp8_product
    pv = kernel_config(FA2.replace(p_bar="fp8_e4m3", v_bar="fp8_e4m3", out="fp8_e4m3"), rule, torch.bfloat16)
    assert (pv.p_bar, pv.fp8_product, pv.narrow, pv.narrow_out) == (Format.FP8_E4M3, True, Format.FP8_E4M3, True)
    assert pv.max_shift == pytest.approx(math.log(8 / 7) + 5 * math.log(2))    # capped: P̄ stays normal in e4m3
    assert not kernel_config(FA2.replace(p_bar="e8m3"), rule, torch.bfloat16).fp8_product
    assert kernel_config(FA2.replace(p_bar="e8m3"), rule, torch.bfloat16).p_bar is Format.E8M3


@pytest.mark.parametrize("delta,want", [("dO·O", DeltaSource.DO_O), ("dP·P", DeltaSource.DP_P),
                                        ("recompute_fp32", DeltaSource.RECOMPUTE_FP32),
                                        ("dO·O32", DeltaSource.DO_O32), ("dO·O16", DeltaSource.DO_O16),
                                        ("dO·(O+R)", DeltaSource.DO_O_R), ("dO·(O16+R)", DeltaSource.DO_O16_R),
                                        ("consistent", DeltaSource.DO_O_R)])
def test_every_delta_source_has_one_member(delta, want):
    c = kernel_config(FA2.replace(delta=delta), ShiftRule(), torch.bfloat16)
    assert c.delta is want
    assert c.delta.for_forward is (want if want.keeps_o else DeltaSource.DO_O)


def test_fp16_inputs_store_o_in_fp16():
    c = kernel_config(PrecisionPolicy.preset("fa2", "fp16").replace(delta="dP·P"), ShiftRule(), torch.float16)
    assert (c.arithmetic, c.narrow, c.narrow_out, c.narrow_acc, c.delta) == (
        Arithmetic.FA2, Format.FP16, True, False, DeltaSource.DP_P)


@pytest.mark.parametrize("policy,dtype,softcap,block_k", [
    (FA2, torch.bfloat16, None, None),
    (E8M5.replace(hp_heads=(0, 30), delta="dO·(O+R)"), torch.bfloat16, 5.0, 128),
    (FA2.replace(p_bar="fp8_e5m2", v_bar="fp8_e5m2", out="bf16:stochastic", delta="dO·(O16+R)"), torch.bfloat16,
     None, None),
    (FA2.replace(p_bar="fp32", out="fp32"), torch.bfloat16, None, None),
    (PrecisionPolicy.preset("fa2", "fp16"), torch.float16, 1.0, None),
])
def test_op_key_is_one_string_that_round_trips(policy, dtype, softcap, block_k):
    c = kernel_config(policy, ShiftRule("paper"), dtype, softcap, block_k)
    key = c.op_key
    assert isinstance(key, str) and tuple(json.loads(key)) == OP_FIELDS
    # written as json writes the fields' values (enums as their values, the heads as a list)
    values = [f.value if isinstance(f, Enum) else list(f) if isinstance(f, tuple) else f
              for f in (getattr(c, name) for name in OP_FIELDS)]
    assert key == json.dumps(dict(zip(OP_FIELDS, values)), separators=(",", ":"))
    assert KernelConfig.from_op_key(key) == c
    # a configuration built again gives the same key, and one that differs in any field another
    assert kernel_config(policy, ShiftRule("paper"), dtype, softcap, block_k).op_key == key
    assert dataclasses.replace(c, beta=c.beta + 1).op_key != key
    # its copies and pickles equal it and hash alike, the memoized hash and key not carried (strings hash
    # differently in another process)
    hash(c)
    for other in (copy.copy(c), copy.deepcopy(c), pickle.loads(pickle.dumps(c))):
        assert "_hash" not in vars(other)
        assert other == c and hash(other) == hash(c) and other.op_key == key
    # the custom ops' schemas take the configuration as one argument after (..., causal, scale), then the
    # masks' arguments (and, for the backward, dropout's seed)
    for custom_op, tail in ((op.attn_fwd, op.MASK_ARGS), (op.attn_bwd, (*op.MASK_ARGS, "seed")),
                            (op.attn_bwd_packed, (*op.MASK_ARGS, "seed")), (op.attn_fwd_opaque, op.MASK_ARGS)):
        schema = getattr(custom_op, "_opoverload", custom_op)._schema
        names = [a.name for a in schema.arguments]
        assert tuple(names[names.index("scale") + 1:]) == ("config", *tail)
        assert str(schema.arguments[names.index("config")].type) == "str"


@pytest.mark.parametrize("key, says", [
    ("not json", "is not JSON"),
    ("[1, 2]", "a JSON object of the fields"),
    ('{"arithmetic": "fa2"}', "a JSON object of the fields"),
    (KernelConfig().op_key.replace('"rule":0', '"rule":9'), "9 is not a valid RuleKind"),
    (KernelConfig().op_key.replace('"narrow":23', '"narrow":"e5m2"'), "is not a valid Format"),
])
def test_from_op_key_names_what_is_wrong(key, says):
    with pytest.raises(ValueError, match="config=") as e:
        KernelConfig.from_op_key(key)
    assert says in str(e.value) and "accepted" in str(e.value)


def test_op_fields_are_the_dataclass_fields_and_the_config_is_frozen():
    assert OP_FIELDS == tuple(f.name for f in dataclasses.fields(KernelConfig))
    with pytest.raises(dataclasses.FrozenInstanceError):
        KernelConfig().narrow = Format.E8M3


def test_the_kernels_names_are_the_enums_values():
    """The constexpr globals the kernels compare with are derived from the enums: one numbering."""
    assert (common.STANDARD.value, common.PAPER.value, common.TIE_SHIFT.value, common.ALL_SHIFT.value) == tuple(
        r.value for r in RuleKind)
    assert (common.BF16.value, common.FP32.value, common.FP16.value, common.E5M2.value, common.E4M3.value) == (
        Format.BF16.value, Format.FP32.value, Format.FP16.value, Format.FP8_E5M2.value, Format.FP8_E4M3.value)
    assert common.DELTA_O16_R.value == DeltaSource.DO_O16_R.value and common.DELTA_DP_P.value == DeltaSource.DP_P.value
    assert {RuleKind.of(k).kind for k in ("standard", "paper", "tie-shift", "all-shift")} == {
        "standard", "paper", "tie-shift", "all-shift"}


def test_forward_switches_of_a_config():
    c = kernel_config(FA2.replace(p_bar="fp8_e4m3", v_bar="fp8_e4m3", hp_heads=(2,), delta="dP·P"),
                      ShiftRule("tie-shift"), torch.bfloat16, 30.0)
    assert op.forward_switches(c) == dict(
        STAB=RuleKind.TIE_SHIFT.value, EMU=False, FMT=Format.BF16.value, SR=False, ACC_NARROW=False, ROW_NARROW=False,
        O_NARROW=True, PBAR32=False, HP=True, PFMT=Format.FP8_E4M3.value, FP8_PV=True, SOFTCAP=True,
        DELTA_SRC=DeltaSource.DO_O.value)            # dP·P: the forward keeps nothing
    assert set(op.forward_switches(c)) | {"PERSISTENT"} == set(op._FWD_MODE)    # the tuner keys on each switch
    assert op.forward_switches(kernel_config(FA2.replace(p_bar="fp32"), ShiftRule(), torch.bfloat16))["PFMT"] == \
        common.NO_FORMAT.value


def test_the_builder_is_memoized_and_refuses_as_before():
    rule = ShiftRule("tie-shift")
    assert kernel_config(FA2, rule, torch.bfloat16) is kernel_config(FA2, rule, torch.bfloat16)
    with pytest.raises(ValueError, match=r"block_k=64 with policy=.*only under the 'paper' emulation"):
        kernel_config(FA2, rule, torch.bfloat16, None, 64)
    with pytest.raises(ValueError, match=r"block_k=48 is not a key block the kernels take; accepted: one of"):
        kernel_config(PAPER, rule, torch.bfloat16, None, 48)
    with pytest.raises(ValueError, match=r"block_k=512 with head_dim=128 is not a key block the kernels take"):
        check_key_block(512, PAPER, torch.bfloat16, 128)
    assert check_key_block(None, FA2, torch.bfloat16, 64) == 0
    assert check_key_block(512, PAPER, torch.bfloat16, 64) == 512
    with pytest.raises(ValueError, match=r"policy=.* is not implemented by backend='triton'; accepted: "):
        check_policy(PrecisionPolicy.preset("fp32"), torch.bfloat16)


@pytest.mark.parametrize("fields,match", [
    (dict(narrow_out=True), r"narrow=Format.FP32 narrows nothing"),
    (dict(p_bar=Format.E8M3, fp8_product=True), r"fp8_product with p_bar=Format.E8M3"),
    (dict(arithmetic=Arithmetic.PAPER, delta=DeltaSource.DO_O16_R), r"under the paper emulation"),
    (dict(hp_heads=(31,)), r"hp_heads=\(31,\); accepted: heads 0-30"),
    (dict(softcap=0.0), r"softcap=0.0; accepted: None \(off\) or > 0"),
    (dict(block_k=64), r"block_k=64 under 'fa2'"),
])
def test_a_config_the_kernels_have_no_code_for_is_refused(fields, match):
    with pytest.raises(ValueError, match=match):
        KernelConfig(**fields)
