"""flash_attention: dispatch, and a clear error for every bad input."""
import math
import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import stableflash as sf
from stableflash.attention import PrecisionPolicy, ShiftRule, reference
from stableflash.attention.policy import resolve_policy
from tests.conftest import qkv, rel_err


@pytest.mark.parametrize("backend", ["reference", "emulated"])
@pytest.mark.parametrize("causal", [False, True])
def test_backends_agree_with_float64(gen, backend, causal):
    q, k, v = qkv(gen, 2, 3, 37, 32)
    want = reference.attention(q, k, v, causal=causal)
    got = sf.flash_attention(q, k, v, causal=causal, backend=backend)
    assert got.dtype == q.dtype and got.shape == q.shape
    assert rel_err(got, want) <= 1e-5


def test_sdpa_backend_unstabilized(gen):
    q, k, v = qkv(gen, 2, 3, 37, 32)
    got = sf.flash_attention(q, k, v, causal=True, backend="sdpa", stabilize=False)
    assert rel_err(got, reference.attention(q, k, v, causal=True)) <= 1e-5


def test_scale_argument_is_used(gen):
    q, k, v = qkv(gen, 1, 2, 20, 16)
    want = reference.attention(q, k, v, scale=0.05)
    for backend in ("reference", "emulated"):
        assert rel_err(sf.flash_attention(q, k, v, scale=0.05, backend=backend), want) <= 1e-5
    assert rel_err(sf.flash_attention(q, k, v, scale=0.05, backend="sdpa", stabilize=False), want) <= 1e-5


def test_auto_uses_sdpa_when_not_stabilized(gen, recwarn):
    q, k, v = qkv(gen, 1, 2, 20, 16)
    out = sf.flash_attention(q, k, v, stabilize=False)
    assert torch.equal(out, torch.nn.functional.scaled_dot_product_attention(q, k, v))
    assert not [w for w in recwarn if "backend='auto'" in str(w.message)]


def test_auto_says_when_it_falls_back_to_the_emulation(gen, monkeypatch):
    from stableflash.attention import api
    monkeypatch.setattr(api, "_warned", set())
    q, k, v = qkv(gen, 1, 2, 20, 16)
    with pytest.warns(UserWarning, match="chose 'emulated'.*because the stabilized softmax"):
        out = sf.flash_attention(q, k, v, stabilize="tie-shift")
    assert rel_err(out, reference.attention(q, k, v)) <= 1e-5
    with pytest.warns(UserWarning, match=r"chose 'emulated'.*because δ from dO·\(O\+R\) was asked for \(a consistent δ\)"):
        sf.flash_attention(q.bfloat16(), k.bfloat16(), v.bfloat16())      # the default guards bf16's δ


def test_auto_honours_a_key_block_through_the_emulation(gen, monkeypatch):
    """Only the emulated backend takes block_k: 'auto' never hands another key block to the kernels,
    which would ignore it (here the kernels are made to look available, as on a GPU)."""
    from stableflash.attention import api

    class NoKernels:
        def __getattr__(self, name):
            raise AssertionError("the kernels were called with block_k=8")

    monkeypatch.setattr(api, "_triton_reason", lambda *a: None)
    monkeypatch.setattr(api, "_triton_module", lambda: NoKernels())
    q, k, v = (t.bfloat16() for t in qkv(gen, 1, 2, 40, 16))
    with pytest.raises(AssertionError, match="kernels were called"):     # the default block goes to them
        sf.flash_attention(q, k, v, causal=True, policy="paper")
    got = sf.flash_attention(q, k, v, causal=True, policy="paper", block_k=8)
    want = sf.flash_attention(q, k, v, causal=True, policy="paper", block_k=8, backend="emulated")
    assert torch.equal(got, want)
    other = sf.flash_attention(q, k, v, causal=True, policy="paper", block_k=40, backend="emulated")
    assert not torch.equal(got, other)                       # the block changes the rounding here


def test_policy_presets_resolve_by_dtype():
    assert resolve_policy(None, torch.bfloat16) == PrecisionPolicy.preset("fa2")
    assert resolve_policy(None, torch.float16).p_bar == "fp16"
    assert resolve_policy(None, torch.float32).name == "fp32"
    assert resolve_policy("paper", torch.float16).acc == "fp16"
    paper = PrecisionPolicy.preset("paper")
    assert (paper.scores, paper.p_bar, paper.acc, paper.row_sum, paper.out) == ("bf16",) * 5
    fa2 = PrecisionPolicy.preset("fa2")
    assert (fa2.scores, fa2.p_bar, fa2.acc, fa2.row_sum, fa2.out) == ("fp32", "bf16", "fp32", "fp32", "bf16")
    assert PrecisionPolicy.preset("fa2", low="e5m2").p_bar == "fp8_e5m2"


def _bad(gen):
    return qkv(gen, 2, 3, 8, 16)


BAD_TENSORS = [
    (lambda q, k, v: (q[0], k, v), ValueError, r"q must have 4 dimensions .*got shape \(3, 8, 16\)"),
    (lambda q, k, v: (q, k[:1], v[:1]), ValueError, r"same batch .*k=\(1, 3, 8, 16\)"),
    (lambda q, k, v: (q, k[:, :2], v), ValueError, r"same heads .*k=\(2, 2, 8, 16\)"),
    (lambda q, k, v: (q, k[:, :2], v[:, :2]), ValueError, r"multiple of them .*q=\(2, 3, 8, 16\)"),
    (lambda q, k, v: (q, k[..., :8], v[..., :8]), ValueError, r"same head_dim .*k=\(2, 3, 8, 8\)"),
    (lambda q, k, v: (q, k, v[:, :, :5]), ValueError, r"k and v must have the same sequence length"),
    (lambda q, k, v: (q, k.double(), v), TypeError, r"one dtype; got q=torch.float32, k=torch.float64"),
    (lambda q, k, v: (q.to(torch.int32), k, v), TypeError, r"q has dtype torch.int32; accepted: float16"),
    (lambda q, k, v: (q, k.to("meta"), v), ValueError, r"one device; got q=cpu, k=meta"),
    (lambda q, k, v: (torch.zeros(1, 1, 4, 300), torch.zeros(1, 1, 4, 300), torch.zeros(1, 1, 4, 300)),
     ValueError, r"head_dim=300 is unsupported; accepted: 1 to 256"),
    (lambda q, k, v: (q.numpy(), k, v), TypeError, r"q must be a torch.Tensor; got ndarray"),
    (lambda q, k, v: (q[:, :, :0], k, v), ValueError, r"sequence lengths must be >= 1"),
    (lambda q, k, v: (q[:, :0], k, v), ValueError, r"q has 0 heads \(dim 1\): shape \(2, 0, 8, 16\); accepted: at least 1"),
    (lambda q, k, v: (q, k[:, :0], v[:, :0]), ValueError, r"k has 0 heads \(dim 1\): shape \(2, 0, 8, 16\)"),
    (lambda q, k, v: (q, k, v[:, :0]), ValueError, r"v has 0 heads"),
]


@pytest.mark.parametrize("make,exc,match", BAD_TENSORS)
def test_bad_tensors_raise_clear_errors(gen, make, exc, match):
    with pytest.raises(exc, match=match):
        sf.flash_attention(*make(*_bad(gen)), backend="emulated")


BAD_OPTIONS = [
    ({"beta": 1.0}, ValueError, r"beta=1.0 is invalid; accepted: a finite number > 1"),
    ({"beta": -2}, ValueError, r"beta=-2 is invalid"),
    ({"eps": -0.1}, ValueError, r"eps=-0.1 is invalid; accepted: a finite number >= 0"),
    ({"policy": "bf16-ish"}, ValueError, r"policy='bf16-ish' is not a preset; accepted: fa2, paper, fp32, fp64"),
    ({"policy": 3}, TypeError, r"policy=3 is invalid"),
    ({"backend": "cuda"}, ValueError, r"backend='cuda' is unknown; accepted: auto, triton, emulated"),
    ({"backend": "sdpa", "stabilize": "tie-shift"}, ValueError, r"backend='sdpa' cannot apply the row-maximum rule of stabilize='tie-shift'; pass stabilize='none'"),
    ({"backend": "sdpa", "stabilize": False, "policy": "fa2"}, ValueError, r"honoured only by backend='emulated'"),
    ({"backend": "reference", "policy": "paper"}, ValueError, r"honoured only by backend='emulated'"),
    ({"backend": "triton", "stabilize": "fancy"}, ValueError, r"stabilize='fancy' is invalid"),
    ({"stabilize": "maybe"}, ValueError, r"stabilize='maybe' is invalid; accepted: True"),
    ({"scale": 0.0}, ValueError, r"scale=0.0 is invalid; accepted: None"),
    ({"scale": float("inf")}, ValueError, r"scale=inf is invalid"),
    ({"scale": np.float32("nan")}, ValueError, r"scale=np.float32\(nan\) is invalid; accepted: None \(1/sqrt\(head_dim\)\) "
                                               r"or a finite number > 0$"),
    ({"scale": "0.1"}, ValueError, r"scale='0.1' is invalid"),
    ({"scale": torch.tensor(0.1)}, ValueError, r"scale=tensor\(0.1000\) is a tensor; accepted: None .* pass float\(t\)"),
    ({"block_k": np.float32(16)}, ValueError, r"block_k=np.float32\(16.0\) is invalid; accepted: a positive int"),
    ({"causal": 1}, TypeError, r"causal=1 must be a bool"),
    ({"block_k": 0}, ValueError, r"block_k=0 is invalid; accepted: a positive int"),
    ({"policy": PrecisionPolicy.preset("paper").replace(hp_heads=(1, 5))}, ValueError,
     r"hp_heads=\(1, 5\) names heads \[5\], but q has 3 heads"),
    ({"softcap": 0.0}, ValueError, r"softcap=0.0 is invalid; accepted: None \(off\) or a finite number > 0"),
    ({"softcap": float("nan")}, ValueError, r"softcap=nan is invalid"),
    ({"softcap": True}, ValueError, r"softcap=True is invalid"),
    ({"backend": "sdpa", "stabilize": False, "softcap": 30.0}, ValueError,
     r"backend='sdpa' cannot soft-cap the scores \(softcap=30.0\); accepted with sdpa: softcap=None"),
]


@pytest.mark.parametrize("kwargs,exc,match", BAD_OPTIONS)
def test_bad_options_raise_clear_errors(gen, kwargs, exc, match):
    kwargs = {"backend": "emulated", **kwargs}
    with pytest.raises(exc, match=match):
        sf.flash_attention(*_bad(gen), **kwargs)


BAD_POLICIES = [
    ({"p_bar": "bf17"}, ValueError, r"p_bar='bf17'"),
    ({"out": "bf16:up"}, ValueError, r"out='bf16:up' has rounding mode 'up'; accepted: rne, rtz, stochastic"),
    ({"acc": "fp64"}, ValueError, r"acc='fp64' is wider than compute='fp32'"),
    ({"delta": "dO.O"}, ValueError,
     r"delta='dO.O' is invalid; accepted: dO·O, dO·O32, dO·\(O\+R\), dO·O16, dO·\(O16\+R\), dP·P, recompute_fp32, "
     r"consistent$"),
    ({"hp_heads": (-1,)}, ValueError, r"hp_heads=\(-1,\) is invalid"),
    ({"compute": "fp16"}, ValueError, r"compute='fp16' is invalid; accepted: fp32, fp64"),
    ({"scores": 16}, TypeError, r"scores=16 is not a string"),
]


@pytest.mark.parametrize("kwargs,exc,match", BAD_POLICIES)
def test_bad_policy_fields_raise_clear_errors(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        PrecisionPolicy(**kwargs)


def test_unknown_preset_is_named():
    with pytest.raises(ValueError, match=r"policy='fa3' is not a preset"):
        PrecisionPolicy.preset("fa3")


def test_no_warning_for_explicit_backends(gen):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sf.flash_attention(*_bad(gen), backend="emulated")
        sf.flash_attention(*_bad(gen), backend="reference")


@pytest.mark.parametrize("causal", [False, True])
def test_soft_capping_is_exact_in_float64(gen, causal):
    """softcap·tanh(S/softcap) before the softmax: the emulated backend in fp64 (with its own
    backward, which carries the cap's slope) equals float64 autograd through the capped scores,
    and "auto" does not pick SDPA (which cannot cap) for a capped call."""
    q, k, v = qkv(gen, 2, 3, 40, 16, dtype=torch.float64, scale=3.0)
    do = torch.randn(2, 3, 40, 16, generator=gen, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    got = sf.flash_attention(*leaves, causal=causal, softcap=4.0, backend="emulated", policy="fp64", block_k=16)
    got_grads = torch.autograd.grad(got, leaves, do)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want = reference.attention(*leaves, causal=causal, softcap=4.0)
    want_grads = torch.autograd.grad(want, leaves, do)
    for a, b in zip((got, *got_grads), (want, *want_grads)):
        assert rel_err(a, b) < 1e-12
    plain = reference.attention(q, k, v, causal=causal)
    assert rel_err(plain, want) > 0.05                                  # the cap bites at this scale
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        auto = sf.flash_attention(q.float(), k.float(), v.float(), causal=causal, softcap=4.0, stabilize=False)
    assert rel_err(auto, want) < 1e-5


GUARDED = [                     # the policy's rounding → the δ source stabilize=True reads
    (PrecisionPolicy.preset("fa2"), "dO·(O+R)"),                                         # bf16 kernel
    (PrecisionPolicy.preset("fa2", "fp16"), "dO·(O+R)"),
    (PrecisionPolicy.preset("fa2").replace(out="e8m4"), "dO·(O+R)"),                     # narrow O store
    (PrecisionPolicy.preset("fa2").replace(p_bar="fp16", out="fp16"), "dO·(O+R)"),      # P̄ not narrower
    (PrecisionPolicy.preset("fa2").replace(p_bar="fp8_e4m3", out="fp8_e4m3"), "dO·(O16+R)"),
    (PrecisionPolicy.preset("fa2").replace(p_bar="fp8_e5m2"), "dO·(O16+R)"),
    (PrecisionPolicy.preset("fa2").replace(p_bar="fp8_e4m3", v_bar="fp8_e4m3"), "dO·(O16+R)"),
    (PrecisionPolicy.preset("paper"), "dP·P"),                                         # rounded Ō, ℓ
    (PrecisionPolicy.preset("paper").replace(acc="e8m5", row_sum="e8m5", out="e8m5"), "dP·P"),
    (PrecisionPolicy.preset("fa2").replace(p_bar="fp8_e4m3", acc="bf16"), "dP·P"),
    (PrecisionPolicy.preset("fa2").replace(out="fp32"), "dO·O"),                      # O kept exact
    (PrecisionPolicy.preset("fp32"), "dO·O"),
]


@pytest.mark.parametrize("policy, want", GUARDED, ids=lambda x: getattr(x, "describe", lambda: x)())
def test_consistent_delta_source_follows_the_policys_rounding(policy, want):
    from stableflash.attention.policy import with_consistent_delta, consistent_delta_source
    assert consistent_delta_source(policy) == want
    assert with_consistent_delta(policy).delta == want
    assert resolve_policy(policy.replace(delta="auto"), torch.bfloat16).delta == want
    chosen = policy.replace(delta="dP·P")                        # a named source is kept
    assert with_consistent_delta(chosen) == chosen


def _grads(q, k, v, do, **kw):
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    o = sf.flash_attention(q, k, v, causal=True, **kw)
    return (o, *torch.autograd.grad(o, (q, k, v), do))


def test_stabilize_true_is_the_standard_max_with_delta_from_o_plus_its_residual(gen):
    """stabilize=True on a bf16 kernel: the model's O is the standard kernel's, bit for bit, and the
    gradients are those of δ from the stored O plus its bf16 residual (delta="dO·(O+R)", O as
    computed to about 16 bits), not from the stored O. (The fused kernels: tests/attention/test_triton.py.)"""
    q, k, v, do = (torch.randn(1, 2, 48, 32, generator=gen).to(torch.bfloat16) for _ in range(4))
    fa2 = PrecisionPolicy.preset("fa2")
    got = _grads(q, k, v, do, stabilize=True, backend="emulated")
    want = _grads(q, k, v, do, stabilize=False, backend="emulated", policy=fa2.replace(delta="dO·(O+R)"))
    exact = _grads(q, k, v, do, stabilize=False, backend="emulated", policy=fa2.replace(delta="dO·O32"))
    standard = _grads(q, k, v, do, stabilize=False, backend="emulated", policy=fa2)
    assert torch.equal(got[0], standard[0])
    for name, a, b, c, x in zip(("dQ", "dK", "dV"), got[1:], want[1:], standard[1:], exact[1:]):
        assert torch.equal(a, b), name
        if name != "dV":                                         # dV does not read δ
            assert not torch.equal(a, c), name
            near, far = (a != x).float().mean().item(), (c != x).float().mean().item()
            assert near <= far / 20, (name, near, far)           # δ's O is O as computed, nearly
    for a, r in zip(got, reference.forward_backward(q, k, v, do, causal=True)):
        assert rel_err(a, r) <= 2e-2                             # bf16: 8 significant bits
    assert torch.equal(sf.flash_attention(q, k, v, causal=True, stabilize="consistent-delta", backend="emulated"), got[0])


def test_a_rule_with_the_guard(gen):
    """stabilize="tie-shift+consistent-delta": our row-maximum rule's O, bit for bit, and the guard's δ source."""
    q, k, v, do = (torch.randn(1, 2, 48, 32, generator=gen).to(torch.bfloat16) for _ in range(4))
    fa2 = PrecisionPolicy.preset("fa2")
    got = _grads(q, k, v, do, stabilize="tie-shift+consistent-delta", backend="emulated")
    want = _grads(q, k, v, do, stabilize="tie-shift", backend="emulated", policy=fa2.replace(delta="dO·(O+R)"))
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    standard = sf.flash_attention(q, k, v, causal=True, stabilize=True, backend="emulated")
    assert not torch.equal(got[0], standard)                     # the rule changes O's rounding


def test_stabilize_names_a_rule_and_a_delta_choice():
    from stableflash.attention.stabilization import NAMES, PRESETS, Stabilization, parse_stabilize
    cases = {True: ("standard", True), "consistent-delta": ("standard", True), False: ("standard", False),
             None: ("standard", False), "none": ("standard", False), "tie-shift": ("tie-shift", False),
             "paper": ("paper", False), "all-shift": ("all-shift", False),
             "paper+consistent-delta": ("paper", True), "tie-shift+consistent-delta": ("tie-shift", True),
             "all-shift+consistent-delta": ("all-shift", True)}
    assert set(PRESETS) <= set(NAMES) and set(cases) - {True, False, None} == set(NAMES)
    for arg, (kind, consistent) in cases.items():
        stab = parse_stabilize(arg, beta=3.0)
        assert (stab.rule.kind, stab.consistent_delta, stab.rule.beta) == (kind, consistent, 3.0), arg
        assert parse_stabilize(stab.name, beta=3.0) == stab          # the name builds it back
    custom = Stabilization(ShiftRule("paper", beta=4.0), consistent_delta=False)
    assert parse_stabilize(custom, beta=9.0) is custom and custom.name == "paper"
    for bad in ("standard+consistent-delta", "consistent-delta+tie-shift", "tie-shift+", "yes", 1):
        with pytest.raises(ValueError, match=rf"stabilize={re.escape(repr(bad))} is invalid; accepted: True \(the "
                                             r"default, 'consistent-delta'\), False \('none'\), a Stabilization"):
            parse_stabilize(bad)


def test_a_named_stabilization_is_one_object_eagerly_and_built_plainly_while_compiling(monkeypatch):
    """``Stabilization.named``: eagerly, one frozen object per name and numbers (its memo); while
    torch.compile traces, built without the memo, which dynamo would warn about tracing through —
    the same value either way."""
    from stableflash.attention import stabilization
    eager = stabilization.Stabilization.named("tie-shift", 3.0, 1e-3)
    assert stabilization.Stabilization.named("tie-shift", 3.0, 1e-3) is eager
    before = stabilization._named.cache_info()
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    traced = stabilization.Stabilization.named("tie-shift", 3.0, 1e-3)
    assert traced == eager and traced is not eager and stabilization._named.cache_info() == before


@pytest.mark.parametrize("old, new", [("guard", "consistent-delta"), ("ours", "tie-shift"), ("bounded", "all-shift"),
                                      ("ours+guard", "tie-shift+consistent-delta"), ("standard", "none")])
def test_an_earlier_stabilize_spelling_is_refused_with_its_current_name(gen, old, new):
    q, k, v = (torch.randn(1, 2, 16, 8, generator=gen) for _ in range(3))
    with pytest.raises(ValueError, match=rf"stabilize={re.escape(repr(old))} is invalid \({re.escape(repr(old))} is "
                                         rf"the earlier name of {re.escape(repr(new))}\)"):
        sf.flash_attention(q, k, v, stabilize=old)
    with pytest.raises(ValueError, match="earlier name"):
        sf.attention.StableAttention(stabilize=old)


def test_the_guard_keeps_sdpa_only_where_it_changes_nothing(gen):
    """The guard changes δ for bf16 inputs, which SDPA cannot do (a clear error); for fp32 inputs δ
    from the stored O is exact already, so SDPA still serves stabilize=True."""
    q, k, v = (torch.randn(1, 2, 16, 8, generator=gen) for _ in range(3))
    with pytest.raises(ValueError, match=r"backend='sdpa' cannot take δ from dO·\(O\+R\) \(stabilize=True asks for a consistent δ"):
        sf.flash_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), stabilize=True, backend="sdpa")
    got = sf.flash_attention(q, k, v, causal=True, stabilize=True, backend="sdpa")
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.equal(got, want)


def test_stabilize_true_keeps_a_delta_source_the_policy_names(gen):
    q, k, v, do = (torch.randn(1, 2, 40, 16, generator=gen).to(torch.bfloat16) for _ in range(4))
    dpp = PrecisionPolicy.preset("fa2").replace(delta="dP·P")
    got = _grads(q, k, v, do, stabilize=True, backend="emulated", policy=dpp)
    want = _grads(q, k, v, do, stabilize=False, backend="emulated", policy=dpp)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_the_docstring_documents_every_argument_and_the_result():
    """flash_attention's docstring is its reference: every parameter under "Arguments:" with its
    default as the signature has it, then "Returns:" and "Raises:"."""
    import ast
    import inspect
    doc = sf.flash_attention.__doc__
    args = doc[doc.index("Arguments:"):doc.index("Returns:")]
    assert "Raises:" in doc[doc.index("Returns:"):]
    for name, p in inspect.signature(sf.flash_attention).parameters.items():
        assert f"\n        {name}: " in args, name
        if p.default is not inspect.Parameter.empty:
            entry = re.split(r"\n {8}(?=\S)", args[args.index(f"\n        {name}: "):])[1]
            stated = re.search(r"default\s+(\S+?)[.,]?(?:\s|$)", entry)
            assert stated and ast.literal_eval(stated.group(1)) == p.default, (name, entry[:80])


@pytest.mark.parametrize("number", [np.float32, np.float64, np.float16, float])
def test_numeric_arguments_take_any_real_number_type(gen, number):
    """scale, softcap, beta and eps as NumPy scalars give what Python floats give; block sizes as
    NumPy integers what ints give."""
    q, k, v = qkv(gen, 1, 2, 24, 16)
    kwargs = dict(scale=0.25, softcap=8.0, beta=4.0, eps=0.5, stabilize="tie-shift", block_k=8, block_q=4)
    want = sf.flash_attention(q, k, v, backend="emulated", **kwargs)
    got = sf.flash_attention(q, k, v, backend="emulated", **{
        **kwargs, **{name: number(kwargs[name]) for name in ("scale", "softcap", "beta", "eps")},
        "block_k": np.int64(8), "block_q": np.int32(4)})
    assert torch.equal(got, want)


def tied_at(top: float, n: int = 6, d: int = 8, device="cpu"):
    """q, k, v where every query row's two largest scores are tied at ``top`` (scale 1)."""
    q = torch.zeros(1, 1, n, d, device=device)
    q[..., 0] = 1.0
    k = torch.zeros(1, 1, n, d, device=device)
    k[0, 0, :2, 0] = top
    v = torch.linspace(-1, 1, n * d, device=device).reshape(1, 1, n, d)
    return q, k, v


@pytest.fixture
def paper_watch(monkeypatch):
    """A fresh once-per-process watch for the paper rule's non-finite outputs."""
    from stableflash.attention import api
    watch = api._NonFiniteWatch()
    monkeypatch.setattr(api, "_paper_watch", watch)
    return watch


def test_the_paper_rule_warns_once_when_its_shift_underflows_a_row(paper_watch):
    """Tied at 120 with beta 2, the paper's rule subtracts 240: every exp underflows in float32 and
    the row is 0/0 (docs/design.md). The output is still what the rule gives, and it says so, once."""
    from stableflash.attention.api import PAPER_RULE_NONFINITE
    q, k, v = tied_at(120.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        o = sf.flash_attention(q, k, v, scale=1.0, stabilize="paper", backend="emulated")
        again = sf.flash_attention(q, k, v, scale=1.0, stabilize="paper", backend="emulated")
    assert torch.isnan(o).all() and torch.isnan(again).all()
    assert [(w.category, str(w.message)) for w in caught] == [(RuntimeWarning, PAPER_RULE_NONFINITE)]
    assert caught[0].filename == __file__                       # it points at the call, not at stableflash
    section = "'Row-maximum rules'"
    assert "docs/design.md" in PAPER_RULE_NONFINITE and section in PAPER_RULE_NONFINITE
    design = (Path(__file__).resolve().parents[2] / "docs" / "design.md").read_text()
    assert "## Row-maximum rules" in design and "NaN at rm = ±120, β = 2" in design


def test_the_paper_rule_is_silent_where_its_output_is_finite_or_its_inputs_were_not(paper_watch):
    q, k, v = tied_at(30.0)                                     # exp(-30) is a float32 number: finite
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.isfinite(sf.flash_attention(q, k, v, scale=1.0, stabilize="paper", backend="emulated")).all()
        q, k, v = tied_at(120.0)
        assert torch.isfinite(sf.flash_attention(q, k, v, scale=1.0, stabilize="tie-shift", backend="emulated")).all()
        v[0, 0, 3, 0] = math.nan                                # NaN in, NaN out: not the rule's doing
        sf.flash_attention(q, k, v, scale=1.0, stabilize="paper", backend="emulated")
    assert not paper_watch.warned


@pytest.mark.gpu
def test_the_paper_rule_warning_on_cuda_waits_for_no_kernel(paper_watch):
    """On CUDA the check is queued: a later call reads it once its event has completed."""
    q, k, v = (t.to(torch.bfloat16) for t in tied_at(120.0, n=64, d=64, device="cuda"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        o = sf.flash_attention(q, k, v, scale=1.0, stabilize="paper", backend="triton")
        assert len(paper_watch.pending) == 1
        torch.cuda.synchronize()
        fine = sf.flash_attention(q, k, v, scale=1.0, stabilize="tie-shift", backend="triton")
        assert caught == []                                     # the paper rule's calls alone are watched
        sf.flash_attention(q / 8, k / 8, v, scale=1.0, stabilize="paper", backend="triton")
    assert torch.isnan(o).any() and torch.isfinite(fine).all()
    assert [w.category for w in caught] == [RuntimeWarning] and caught[0].filename == __file__
    assert paper_watch.warned and not paper_watch.pending
