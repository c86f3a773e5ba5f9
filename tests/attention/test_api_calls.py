"""The API's kept decisions: a repeated call signature runs the Call decided for it without the checks,
computes what a fresh decision computes, and anything outside the signature is decided afresh."""
import pytest
import torch

import stableflash as sf
from stableflash.attention import api, flash_style
from tests.conftest import qkv


@pytest.fixture
def decisions(monkeypatch):
    """The real shortcut (``api.VERIFY`` off, as outside the tests), and a count of fresh decisions."""
    monkeypatch.setattr(api, "VERIFY", False)
    made = []
    decide = api.decide

    def counted(*args, **kwargs):
        made.append(kwargs)
        return decide(*args, **kwargs)

    monkeypatch.setattr(api, "decide", counted)
    monkeypatch.setattr(flash_style, "decide", counted)
    return made


def _grads(fn, *inputs):
    inputs = [t.detach().requires_grad_() for t in inputs]
    out = fn(*inputs)
    out.backward(torch.ones_like(out))
    return out.detach(), [t.grad for t in inputs]


@pytest.mark.parametrize("backend", ["emulated", "reference", "sdpa", "auto"])
def test_a_repeated_call_runs_its_kept_decision(gen, decisions, backend):
    q, k, v = qkv(gen, 2, 3, 33, 16)
    stabilize = "none" if backend == "sdpa" else True
    fn = lambda q, k, v: sf.flash_attention(q, k, v, causal=True, backend=backend, stabilize=stabilize)  # noqa: E731
    first, first_grads = _grads(fn, q, k, v)
    assert len(decisions) == 1
    again, again_grads = _grads(fn, q, k, v)
    assert len(decisions) == 1                       # nothing checked or decided again
    assert torch.equal(again, first) and all(map(torch.equal, again_grads, first_grads))
    fresh = (t.clone() for t in qkv(gen, 2, 3, 33, 16))
    sf.flash_attention(*fresh, causal=True, backend=backend, stabilize=stabilize)
    assert len(decisions) == 1                       # other values, one signature


def test_the_interpreted_kernels_run_from_a_kept_decision(gen, decisions):
    """backend="triton" under Triton's CPU interpreter (what runs the kernels without a GPU): the kept
    Call hands the kernels the configuration and masks decided on the first call."""
    if not api._triton_module().op.interpreting() and not torch.cuda.is_available():
        pytest.skip("the kernels need a GPU or TRITON_INTERPRET=1")
    device = "cpu" if api._triton_module().op.interpreting() else "cuda"
    q, k, v = (t.to(device, torch.bfloat16) for t in qkv(gen, 1, 2, 40, 16))
    fn = lambda q, k, v: sf.flash_attention(q, k, v, causal=True, backend="triton")  # noqa: E731
    first, first_grads = _grads(fn, q, k, v)
    again, again_grads = _grads(fn, q, k, v)
    assert len(decisions) == 1
    assert torch.equal(again, first) and all(map(torch.equal, again_grads, first_grads))


@pytest.mark.parametrize("good, bad, error", [
    (dict(causal=True), dict(causal=1), "causal=1 must be a bool"),
    (dict(window=(1, None)), dict(window=(True, None)), r"window=\(True, None\) is invalid"),
    (dict(scale=1.0), dict(scale=True), "scale=True is invalid"),
    (dict(return_lse=True), dict(return_lse=1), "return_lse=1 must be a bool"),
])
def test_an_option_equal_in_value_but_not_in_type_is_checked(gen, decisions, good, bad, error):
    """True == 1 == 1.0 with one hash in Python: the kept Calls' keys hold each option's type (a
    tuple's items' too), so the Call kept for a valid call never answers an invalid one equal to it."""
    q, k, v = qkv(gen, 1, 2, 20, 16)
    sf.flash_attention(q, k, v, backend="emulated", **good)
    with pytest.raises((TypeError, ValueError), match=error):
        sf.flash_attention(q, k, v, backend="emulated", **bad)


def test_invalid_calls_are_never_kept(gen, decisions):
    q, k, v = qkv(gen, 1, 2, 20, 16)
    for _ in range(2):
        with pytest.raises(ValueError, match="scale=-1.0 is invalid"):
            sf.flash_attention(q, k, v, scale=-1.0)
        with pytest.raises(ValueError, match="backend='nosuch' is unknown"):
            sf.flash_attention(q, k, v, backend="nosuch")
    assert not api._CALLS


def test_each_shape_dtype_and_device_is_decided(gen, decisions):
    q, k, v = qkv(gen, 1, 2, 20, 16)
    calls = [(q, k, v), (q[:, :1], k[:, :1], v[:, :1]), (q.double(), k.double(), v.double()),
             (q[..., :8], k[..., :8], v[..., :8])]
    for tensors in calls + calls:
        sf.flash_attention(*tensors, backend="emulated")
    assert len(decisions) == len(calls)
    with pytest.raises(TypeError, match="q, k, v must share one dtype"):
        sf.flash_attention(q, k.double(), v, backend="emulated")      # one tensor's dtype changed


def test_an_attn_mask_and_tensor_subclasses_are_decided_on_every_call(gen, decisions):
    q, k, v = qkv(gen, 1, 2, 20, 16)
    mask = torch.ones(20, 20, dtype=torch.bool).tril()
    for _ in range(2):
        sf.flash_attention(q, k, v, attn_mask=mask, backend="emulated")
    assert len(decisions) == 2
    p = torch.nn.Parameter(q.clone())
    for _ in range(2):
        sf.flash_attention(p, k, v, backend="emulated")
    assert len(decisions) == 4
    assert not api._CALLS


def test_the_store_is_bounded(gen, decisions, monkeypatch):
    monkeypatch.setattr(api, "MAX_CALLS", 3)
    q, k, v = qkv(gen, 1, 2, 20, 16)
    for n in range(1, 8):
        sf.flash_attention(q[:, :, :n], k, v, backend="emulated")
        assert 1 <= len(api._CALLS) <= 3


def test_the_flash_style_entries_keep_their_decisions(gen, decisions):
    q, k, v = (t.transpose(1, 2) for t in qkv(gen, 2, 3, 24, 16))     # (batch, seq, heads, head_dim)
    qkv_packed = torch.stack((q, k, v), dim=2)
    cases = [(lambda **kw: flash_style.flash_attn_func(q, k, v, **kw)),
             (lambda **kw: flash_style.flash_attn_qkvpacked_func(qkv_packed, **kw))]
    for fn in cases:
        decisions.clear()
        first = fn(causal=True, backend="emulated")
        again = fn(causal=True, backend="emulated")
        assert len(decisions) == 1 and torch.equal(first, again)
        with pytest.raises(TypeError, match="causal=1 must be a bool"):
            fn(causal=1, backend="emulated")
        with pytest.raises(ValueError, match=r"window_size=\(True, -1\) is invalid"):
            fn(window_size=(True, -1), causal=True, backend="emulated")
    assert torch.equal(cases[0](causal=True, backend="emulated"), cases[1](causal=True, backend="emulated"))


def test_verify_catches_a_kept_call_that_differs(gen, monkeypatch):
    """Under ``VERIFY`` (on in the tests) a kept Call is compared with a fresh decision."""
    monkeypatch.setattr(api, "VERIFY", True)
    q, k, v = qkv(gen, 1, 2, 20, 16)
    sf.flash_attention(q, k, v, backend="emulated")
    (key, call), = api._CALLS.items()
    api._CALLS[key] = call._replace(backend="reference")
    with pytest.raises(AssertionError, match="a kept Call differs"):
        sf.flash_attention(q, k, v, backend="emulated")


def test_the_entries_warnings_point_at_the_callers_line(gen, monkeypatch):
    """backend="auto" falling back to the emulation warns once per reason, at the line that called the
    entry (the decision's helpers in between are the library's)."""
    q, k, v = qkv(gen, 1, 2, 20, 16)
    packed = torch.stack([t.transpose(1, 2) for t in (q, k, v)], dim=2)
    cu = torch.tensor([0, 20], dtype=torch.int32)
    calls = [lambda: sf.flash_attention(q, k, v, stabilize="tie-shift"),
             lambda: flash_style.flash_attn_func(*(t.transpose(1, 2) for t in (q, k, v)), stabilize="tie-shift"),
             lambda: flash_style.flash_attn_qkvpacked_func(packed, stabilize="tie-shift"),
             lambda: flash_style.flash_attn_varlen_func(*(t[0].transpose(0, 1) for t in (q, k, v)), cu, cu, 20, 20,
                                                        stabilize="tie-shift")]
    for call in calls:
        monkeypatch.setattr(api, "_warned", set())
        with pytest.warns(UserWarning, match="chose 'emulated'") as caught:
            call()
        assert [w.filename for w in caught] == [__file__]


def test_the_paper_rules_warning_points_at_the_callers_line_from_each_entry(monkeypatch):
    """Rows tied at 120 under the paper's rule with β = 2 underflow to NaN; the warning that says so
    names the line that called the entry, from the FlashAttention-style and varlen entries too."""
    import warnings
    from tests.attention.test_api import tied_at
    q, k, v = tied_at(120.0)
    bnhd = [t.transpose(1, 2) for t in (q, k, v)]
    cu = torch.tensor([0, q.shape[2]], dtype=torch.int32)
    n = q.shape[2]
    calls = [lambda: flash_style.flash_attn_func(*bnhd, softmax_scale=1.0, stabilize="paper", backend="emulated"),
             lambda: flash_style.flash_attn_varlen_func(*(t[0] for t in bnhd), cu, cu, n, n, softmax_scale=1.0,
                                                        stabilize="paper", backend="emulated")]
    for call in calls:
        monkeypatch.setattr(api, "_paper_watch", api._NonFiniteWatch())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert torch.isnan(call()).all()
        assert [(w.category, w.filename) for w in caught] == [(RuntimeWarning, __file__)]


def test_an_unhashable_option_is_decided_on_every_call(gen, decisions):
    """A window given as a list (accepted, as a tuple is) cannot key a kept Call: each call is decided."""
    q, k, v = qkv(gen, 1, 2, 20, 16)
    outs = [sf.flash_attention(q, k, v, window=[3, None], backend="emulated") for _ in range(2)]
    assert len(decisions) == 2 and not api._CALLS
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(outs[0], sf.flash_attention(q, k, v, window=(3, None), backend="emulated"))
