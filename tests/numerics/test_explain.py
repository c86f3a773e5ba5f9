"""explain_add: the paper's worked example exactly, and agreement with IEEE float32 addition and
round_to on random pairs."""
import json
import math
import re
from fractions import Fraction

import pytest
import torch

from stableflash.numerics import AddTrace, encode, explain_add, round_to

SEED = 20251004
PAPER_A, PAPER_B = -2.4071154594421387, -2.296875


def test_paper_example_exact_numbers():
    t = explain_add(PAPER_A, PAPER_B)
    assert isinstance(t, AddTrace)
    assert (t.fmt, t.acc) == ("bf16", "fp32")
    assert t.exact == -4.703990459442139
    assert t.acc_result == -4.703990459442139
    assert t.acc_exact is True
    assert t.result == -4.71875
    assert t.bits == "1100000010010111"
    assert t.error == -0.014759540557861328
    assert (t.guard, t.round, t.sticky) == (1, 0, 1)
    assert t.decision == "round up (magnitude)"
    assert t.exponent_difference == 0 and t.normalisation_shift == 1


def test_paper_example_text():
    text = str(explain_add(PAPER_A, PAPER_B))
    for needle in [repr(PAPER_A), repr(PAPER_B), "-4.703990459442139", "-4.71875",
                   "1100000010010111", "-0.014759540557861328", "1|10000001|0010111",
                   "guard 1, round 0, sticky 1", "round up (magnitude)", "carry out",
                   "1.0010110 | 1 | 0 |"]:
        assert needle in text, needle
    lines = text.splitlines()
    assert 10 <= len(lines) <= 40
    assert max(map(len, lines)) <= 120


def test_paper_example_alignment_columns():
    """The operand, sum and store lines put the binary point in the same column."""
    lines = str(explain_add(PAPER_A, PAPER_B)).splitlines()
    bit_lines = [ln for ln in lines if re.match(r"^\s+[+=-]?\s+[01]+\.[01]", ln)]
    assert len(bit_lines) >= 7
    assert len({ln.index(".") for ln in bit_lines}) == 1, bit_lines


def test_to_dict_is_json_and_complete():
    t = explain_add(PAPER_A, PAPER_B)
    d = json.loads(json.dumps(t.to_dict()))
    assert d["result"] == -4.71875 and d["exact"] == -4.703990459442139
    assert d["error"] == -0.014759540557861328 and d["bits"] == "1100000010010111"
    assert d["a_hex"] == PAPER_A.hex() and d["b_hex"] == PAPER_B.hex()
    assert d["a_bits"] == format(torch.tensor([PAPER_A]).view(torch.int32).item() & 0xFFFFFFFF, "032b")
    assert d["steps"] == str(t).splitlines()
    for key in ("a", "b", "fmt", "acc", "acc_result", "guard", "round", "sticky", "decision"):
        assert key in d


def random_fp32_pairs(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pairs with all kinds of exponent differences, a quarter of them nearly cancelling."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(n, generator=g) * torch.pow(2.0, torch.randint(-30, 30, (n,), generator=g).float())
    b = torch.randn(n, generator=g) * torch.pow(2.0, torch.randint(-30, 30, (n,), generator=g).float())
    near = torch.rand(n, generator=g) < 0.25
    b = torch.where(near, -a * (1 + torch.randn(n, generator=g) * 2.0**-12), b)
    return a.float(), b.float()


@pytest.mark.parametrize("fmt,n", [("bf16", 1000), ("fp16", 500), ("fp8_e4m3", 300), ("fp8_e5m2", 200)])
def test_random_pairs_agree_with_float32_addition_and_round_to(fmt, n):
    seed = SEED + n
    a32, b32 = random_fp32_pairs(n, seed)
    acc_sum = a32 + b32                       # IEEE float32 addition, round to nearest even
    stored = round_to(acc_sum, fmt)
    for a, b, s, r in zip(a32.tolist(), b32.tolist(), acc_sum.tolist(), stored.tolist()):
        t = explain_add(a, b, fmt=fmt)
        where = f"{fmt}, seed {seed}: explain_add({a!r}, {b!r})"
        exact = Fraction(a) + Fraction(b)
        assert t.exact == float(exact), where
        assert t.acc_result == s, where
        assert t.acc_exact == (Fraction(s) == exact), where
        assert t.result == r and math.copysign(1, t.result) == math.copysign(1, r), where
        if math.isfinite(r):
            assert t.error == float(Fraction(r) - exact), where
        width = len(t.bits)
        assert t.bits == format(encode(torch.tensor([r]), fmt).item(), f"0{width}b"), where


def test_cancellation():
    t = explain_add(1.0, -0.99999988079071044921875)  # 1 - (1 - 2**-23)
    assert t.exact == t.acc_result == t.result == 2.0**-23
    assert t.normalisation_shift == -23 and t.exponent_difference == 1
    assert "cancellation: shift left by 23" in str(t)
    assert t.decision.startswith("exact")


def test_exact_zero_is_positive():
    t = explain_add(3.0, -3.0)
    assert t.result == 0.0 and math.copysign(1, t.result) == 1.0
    assert t.bits == "0" * 16 and t.error == 0.0
    assert "cancellation" in str(t)
    neg = explain_add(-0.0, -0.0)
    assert math.copysign(1, neg.result) == -1.0 and neg.bits == "1" + "0" * 15


def test_overflow_to_inf_in_fp16():
    t = explain_add(65504, 65504, fmt="fp16")
    assert t.acc_result == 131008.0 and t.result == math.inf
    assert t.bits == "0111110000000000" and t.overflow == "inf"
    assert t.error == math.inf
    assert "overflow to inf" in str(t)
    json.dumps(t.to_dict())


def test_overflow_of_the_accumulator():
    t = explain_add(3e38, 3e38)
    assert t.acc_result == math.inf and t.result == math.inf and not t.acc_exact
    assert "overflow" in str(t)


def test_subnormal_result():
    t = explain_add(1e-5, 1e-6, fmt="fp16")
    s = (torch.tensor([1e-5]) + torch.tensor([1e-6])).item()
    assert t.acc_result == s
    assert t.result == round_to(torch.tensor([s]), "fp16").item() < 2.0**-14
    assert t.bits.startswith("000000")  # sign 0, exponent 00000
    assert "subnormal in fp16" in str(t)
    tiny = explain_add(1e-8, 1e-9, fmt="fp16")
    assert tiny.result == 0.0 and "underflow" in str(tiny)


def test_fp8_e4m3_saturates():
    t = explain_add(300.0, 170.0, fmt="fp8_e4m3")
    assert t.acc_result == 470.0 and t.result == 448.0 and t.bits == "01111110"
    assert t.overflow == "saturate" and t.error == -22.0
    assert "saturate" in str(t)
    u = explain_add(1.0, 0.0625, fmt="fp8_e4m3")  # tie between 1.0 and 1.125: even is 1.0
    assert u.result == 1.0 and (u.guard, u.round, u.sticky) == (1, 0, 0)
    assert u.decision == "round down (truncate)"


def test_operands_rounded_into_the_accumulator():
    t = explain_add(0.1, 0.2)
    assert t.a_acc == torch.tensor(0.1).item() and t.b_acc == torch.tensor(0.2).item()
    assert "not exact in fp32" in str(t)
    assert t.exact == float(Fraction(0.1) + Fraction(0.2))
    t64 = explain_add(0.1, 0.2, fmt="fp64", acc="fp64")
    assert t64.result == 0.30000000000000004 and t64.a_acc == 0.1


def test_inexact_accumulation():
    t = explain_add(1.0, 2.0**-24, fmt="fp32")
    assert t.acc_result == 1.0 and not t.acc_exact and t.result == 1.0
    assert t.error == -(2.0**-24)


def test_large_exponent_difference_is_abbreviated():
    t = explain_add(1e30, 1e-30)
    assert t.exponent_difference > 150
    assert max(map(len, str(t).splitlines())) <= 120
    assert t.acc_result == (torch.tensor(1e30) + torch.tensor(1e-30)).item()


def test_special_operands():
    assert explain_add(math.inf, 1.0).result == math.inf
    nan = explain_add(math.inf, -math.inf)
    assert math.isnan(nan.result) and nan.bits[1:10] == "111111111"
    assert math.isnan(explain_add(float("nan"), 1.0).result)
    assert explain_add(math.inf, 1.0, fmt="fp8_e4m3").result == 448.0  # like torch's cast
    assert explain_add("1.5", 2).result == 3.5


def test_bad_arguments():
    with pytest.raises(ValueError, match="^fmt: .*'bf17'"):
        explain_add(1.0, 2.0, fmt="bf17")
    with pytest.raises(ValueError, match="^acc: .*'fp99'"):
        explain_add(1.0, 2.0, acc="fp99")
    with pytest.raises(ValueError, match="a must be a number.*'abc'"):
        explain_add("abc", 1.0)
