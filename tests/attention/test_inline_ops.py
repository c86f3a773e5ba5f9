"""The inline ops (``stableflash::attn_fwd_inline``, ``attn_bwd_inline``): what torch.compile calls.

Without a GPU (Triton's interpreter): the inline forward's schema and fake implementation agree
with its real run (``torch.library.opcheck``), and under the interpreter both ops hand every call
to the opaque ops (``why_not_inline``), whose outputs they return unchanged.

On a GPU: a compiled forward and backward launches its kernels from torch.compile's own code —
a second call runs with this package's forward and backward functions replaced by ones that
raise — and gives eager's O, dQ, dK, dV bit for bit on the same fixed tiles, and with the tuners
on (the traced call tunes them for its shapes; the eager call after it takes the same choice);
with grouped-query heads within 1.25× eager's error against float64.
Calls that need the opaque ops (dropout and stochastic rounding draw a seed per call, the Gluon
Hopper forward is picked by address) are named, and compiled dropout gives eager's values for
the same seed.
"""
from unittest import mock

import pytest
import torch

import stableflash as sf
from stableflash.attention.gluon import route
from stableflash.attention.policy import PrecisionPolicy
from stableflash.attention.shift import ShiftRule
from stableflash.attention.triton import op
from stableflash.attention.triton.launch import kernel_config, stabilized_config
from stableflash.attention.triton.op import Masks
from tests.attention.test_triton import expanded_reference
from tests.conftest import DEVICE

CONFIG = stabilized_config(torch.bfloat16)


def _inputs(shape, seed, device=DEVICE):
    gen = torch.Generator(device=device).manual_seed(seed)
    return [torch.randn(*shape, generator=gen, device=device).bfloat16() for _ in range(4)]


def _run(fn, q, k, v, do):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    o = fn(q, k, v)
    return (o, *torch.autograd.grad(o, (q, k, v), do))


def test_the_inline_forward_agrees_with_its_fake_and_schema():
    q, k, v, _ = _inputs((1, 2, 40, 32), 0)
    args = (q, k, v, True, 0.25, CONFIG.op_key, *Masks().op_args())
    torch.library.opcheck(op.attn_fwd_inline, args, test_utils=("test_schema", "test_faketensor"))


def test_the_packed_ops_agree_with_their_fakes_and_schemas():
    """The packed forward (qkv (B, N, 3, H, d) for q, k, v) and the packed backward, whose one output is
    the gradient of qkv, laid out as qkv contiguous."""
    gen = torch.Generator(device=DEVICE).manual_seed(5)
    qkv, do = (torch.randn(*shape, generator=gen, device=DEVICE).bfloat16() for shape in ((1, 40, 3, 2, 32),
                                                                                         (1, 2, 40, 32)))
    args = (True, 0.25, CONFIG.op_key, *Masks().op_args())
    checks = ("test_schema", "test_faketensor")
    torch.library.opcheck(op.attn_fwd_packed_inline, (qkv, *args), test_utils=checks)
    o, lse, o32, seed = op.attn_fwd_packed(qkv, *args)
    saved = (o, o32) if CONFIG.delta.residual else (o, o32.new_empty(0))
    for backward in (op.attn_bwd_packed, op.attn_bwd_packed_inline):
        torch.library.opcheck(backward, (do, qkv, *saved, lse, *args, seed), test_utils=checks)
    dqkv = op.attn_bwd_packed(do, qkv, *saved, lse, *args, seed)
    want = op.attn_bwd(do, *op.unpack_qkv(qkv), *saved, lse, *args, seed)
    assert dqkv.is_contiguous() and torch.equal(torch.stack(want, 2).transpose(1, 3), dqkv)


def test_a_packed_body_fills_left_out_trailing_arguments_as_its_signature_does():
    """``_PackedBody``: torch's dispatcher leaves out trailing arguments equal to their defaults; the body gets
    what binding the call to its signature gives — the defaults filled in from the left-out one on, by position
    or with keywords — and a call short of a required argument is refused as binding refuses it."""
    got = []

    def body(q, k, v, causal, scale, band=None, dropout_p=0.0):
        got.append((q, k, v, causal, scale, band, dropout_p))

    packed = op._PackedBody(body, "body", grads=False)
    qkv = torch.arange(2 * 5 * 3 * 1 * 4, dtype=torch.float32).view(2, 5, 3, 1, 4)
    q, k, v = op.unpack_qkv(qkv)

    def bound(*args, **kwargs):
        call = packed.__signature__.bind(*args, **kwargs)
        call.apply_defaults()
        return tuple(call.arguments.values())
    for args, kwargs in (((qkv, True, 0.5), {}), ((qkv, True, 0.5, (3, 0, False)), {}),
                         ((qkv, True, 0.5, None, 0.1), {}), ((qkv, True), {"scale": 0.5, "dropout_p": 0.2})):
        got.clear()
        packed(*args, **kwargs)
        want = bound(*args, **kwargs)
        (gq, gk, gv, *rest), = got
        assert all(torch.equal(a, b) for a, b in zip((gq, gk, gv), (q, k, v))) and tuple(rest) == want[1:], (args, rest)
    assert packed._required == 3 and packed._defaults[3:] == (None, 0.0)
    with pytest.raises(TypeError, match="scale"):
        packed(qkv, True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs only without a GPU here")
def test_the_inline_forward_hands_a_call_to_the_opaque_forward_without_an_autograd_layer():
    """The op the inline forward's body calls where a call must stay opaque (here: the interpreter) is
    ``stableflash::attn_fwd_opaque``: schema and fake agree with its run, it has no autograd kernel of its
    own (the inline op's formula gives the gradient; a custom_op's Python autograd layer would run on
    every call in a compiled graph), and it gives the outputs of ``stableflash::attn_fwd``, which has one."""
    q, k, v, _ = _inputs((1, 2, 40, 32), 3)
    args = (q, k, v, True, 0.25, CONFIG.op_key, *Masks().op_args())
    torch.library.opcheck(op.attn_fwd_opaque, args, test_utils=("test_schema", "test_faketensor"))
    assert op.attn_fwd_opaque is torch.ops.stableflash.attn_fwd_opaque.default
    called = []
    real = op.attn_fwd_opaque
    with mock.patch.object(op, "attn_fwd_opaque", lambda *a: called.append(a) or real(*a)):
        inline = op.attn_fwd_inline(*args)
    assert len(called) == 1
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    assert not has("stableflash::attn_fwd_opaque", "Autograd") and has("stableflash::attn_fwd", "Autograd")
    for a, b in zip(inline, op.attn_fwd(*args)):
        assert torch.equal(a, b)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs only without a GPU here")
def test_under_the_interpreter_the_inline_ops_return_the_opaque_ops_outputs():
    q, k, v, do = _inputs((1, 2, 40, 32), 1)
    assert op.why_not_inline(q, k, v, CONFIG, Masks()) == "Triton's interpreter runs the kernels"
    args = (True, 0.25, CONFIG.op_key, *Masks().op_args())
    inline, opaque = (f(q, k, v, *args) for f in (op.attn_fwd_inline, op.attn_fwd))
    for a, b in zip(inline, opaque):
        assert torch.equal(a, b)
    o, lse, o32, seed = opaque
    saved = (o, o32) if CONFIG.delta.residual else (o, o32.new_empty(0))
    bwd = [f(do, q, k, v, *saved, lse, *args, seed) for f in (op.attn_bwd_inline, op.attn_bwd)]
    for a, b in zip(*bwd):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_a_compiled_call_launches_its_kernels_without_this_packages_python(causal, monkeypatch):
    """Fixed tiles (AUTOTUNE off) on both sides: eager's values bit for bit, on the first compiled
    call and on a second one during which ``_forward`` and ``_backward_impl`` raise."""
    monkeypatch.setattr(op, "AUTOTUNE", False)
    torch._dynamo.reset()
    fn = lambda q, k, v: sf.flash_attention(q, k, v, causal=causal)     # noqa: E731
    compiled = torch.compile(fn, fullgraph=True)
    q, k, v, do = (t.transpose(1, 2) for t in _inputs((2, 300, 3, 64), 7))   # (B, N, H, d) buffers
    want = _run(fn, q, k, v, do)
    first = _run(compiled, q, k, v, do)
    stop = AssertionError("the package's Python ran inside the compiled call")
    with mock.patch.object(op, "_forward", side_effect=stop), mock.patch.object(op, "_backward_impl", side_effect=stop):
        again = _run(compiled, q, k, v, do)
    for name, w, a, b in zip(("O", "dQ", "dK", "dV"), want, first, again):
        assert torch.equal(w, a) and torch.equal(w, b), name


@pytest.mark.gpu
def test_a_compiled_packed_call_launches_its_kernels_without_this_packages_python(monkeypatch):
    """flash_attn_qkvpacked_func compiled, fixed tiles: eager's O and gradient of qkv bit for bit, also
    during a second call in which ``_forward`` and ``_backward_impl`` raise. The kernels write dQ, dK
    and dV into the one gradient inside torch.compile's graph as in eager."""
    monkeypatch.setattr(op, "AUTOTUNE", False)
    torch._dynamo.reset()
    fn = lambda qkv: sf.flash_attn_qkvpacked_func(qkv, causal=True)     # noqa: E731
    compiled = torch.compile(fn, fullgraph=True)
    gen = torch.Generator(device="cuda").manual_seed(8)
    qkv, do = (torch.randn(*shape, generator=gen, device="cuda").bfloat16() for shape in ((2, 300, 3, 3, 64),
                                                                                           (2, 300, 3, 64)))

    def run(f):
        leaf = qkv.clone().requires_grad_(True)
        o = f(leaf)
        return o, *torch.autograd.grad(o, leaf, do)

    want, first = run(fn), run(compiled)
    stop = AssertionError("the package's Python ran inside the compiled call")
    with mock.patch.object(op, "_forward", side_effect=stop), mock.patch.object(op, "_backward_impl", side_effect=stop):
        again = run(compiled)
    for name, w, a, b in zip(("O", "dQKV"), want, first, again):
        assert torch.equal(w, a) and torch.equal(w, b), name


def _causal_inputs(B, H, Hk, n, d):
    gen = torch.Generator(device="cuda").manual_seed(n)
    q, do = (torch.randn(B, H, n, d, generator=gen, device="cuda").bfloat16() for _ in range(2))
    k, v = (torch.randn(B, Hk, n, d, generator=gen, device="cuda").bfloat16() for _ in range(2))
    return q, k, v, do


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(2, 4, 4, 512, 64), (1, 4, 4, 700, 32)], ids=["64", "32"])
def test_compiled_with_the_tuners_on_takes_the_tiles_eager_takes(shape):
    """Tuners on: the compiled call's kernels get the tuners' choice for its shapes (tuned while it
    is traced), which the eager call after it reuses: the same values bit for bit, and both within
    bf16 rounding of float64 (relative error ≤ 2⁻⁷)."""
    torch._dynamo.reset()
    fn = lambda q, k, v: sf.flash_attention(q, k, v, causal=True)      # noqa: E731
    q, k, v, do = _causal_inputs(*shape)
    got = _run(torch.compile(fn, fullgraph=True), q, k, v, do)
    eager = _run(fn, q, k, v, do)
    ref = expanded_reference(q, k, v, do, True)
    for name, x, x_e, r in zip(("O", "dQ", "dK", "dV"), got, eager, ref):
        assert torch.equal(x, x_e), name
        assert ((x.double() - r).norm() / r.norm()).item() <= 2.0 ** -7, name


@pytest.mark.gpu
def test_compiled_grouped_query_heads_are_as_accurate_as_eager():
    """Grouped-query heads (two query heads per key head) with the tuners on: within 1.25× (+1e-4)
    eager's error against float64 (not bit for bit: the backward's kernels are tuned by inductor
    here, and the forward's O has differed from eager's by one bf16 unit on the same tile)."""
    torch._dynamo.reset()
    fn = lambda q, k, v: sf.flash_attention(q, k, v, causal=True)      # noqa: E731
    q, k, v, do = _causal_inputs(2, 4, 2, 512, 64)
    got = _run(torch.compile(fn, fullgraph=True), q, k, v, do)
    eager = _run(fn, q, k, v, do)
    ref = expanded_reference(q, k, v, do, True)
    for name, x, x_e, r in zip(("O", "dQ", "dK", "dV"), got, eager, ref):
        err, err_e = (((y.double() - r).norm() / r.norm()).item() for y in (x, x_e))
        assert err <= 1.25 * err_e + 1e-4, (name, err, err_e)


@pytest.mark.gpu
def test_calls_that_need_the_opaque_ops_are_named():
    q, k, v, _ = _inputs((1, 2, 64, 64), 2)
    assert op.why_not_inline(q, k, v, CONFIG, Masks()) is None
    assert "seed" in op.why_not_inline(q, k, v, CONFIG, Masks(dropout_p=0.1))
    sr = kernel_config(PrecisionPolicy.preset("fa2").replace(out="e8m3:stochastic"), ShiftRule(), torch.bfloat16)
    assert sr.stochastic and "seed" in op.why_not_inline(q, k, v, sr, Masks())
    q128, k128, v128 = (torch.zeros(1, 2, 64, 128, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    gluon = route.why_not(q128, k128, v128, CONFIG, Masks()) is None
    assert (op.why_not_inline(q128, k128, v128, CONFIG, Masks()) == "the Gluon Hopper forward may take the call") == gluon


@pytest.mark.gpu
def test_compiled_dropout_gives_eagers_values_for_the_same_seed():
    torch._dynamo.reset()
    fn = lambda q, k, v: sf.flash_attention(q, k, v, causal=True, dropout_p=0.2)     # noqa: E731
    compiled = torch.compile(fn, fullgraph=True)
    q, k, v, do = _inputs((2, 2, 256, 64), 4)
    outs = []
    for f in (fn, compiled):
        torch.manual_seed(11)
        outs.append(_run(f, q, k, v, do))
    for name, a, b in zip(("O", "dQ", "dK", "dV"), *outs):
        assert torch.equal(a, b), name


LAYOUTS = {  # (B, H, N, d) views as a model or a user hands them over
    "packed qkv (B, N, 3, H, d)": lambda: torch.empty(2, 5, 3, 4, 8)[:, :, 0].transpose(1, 2),
    "contiguous": lambda: torch.empty(2, 4, 5, 8),
    "(B, N, H, d)": lambda: torch.empty(2, 6, 4, 8).transpose(1, 2),
    "one head, one batch": lambda: torch.empty(1, 1, 7, 8),
    "expanded heads (stride 0)": lambda: torch.empty(3, 1, 6, 8).expand(3, 4, 6, 8),
    "last dimension strided": lambda: torch.empty(2, 4, 5, 16)[..., ::2],
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_an_output_follows_its_inputs_layout_as_torch_empty_permuted_lays_it_out(name):
    t = LAYOUTS[name]()
    dense = t if t.stride(-1) == 1 else t.contiguous()
    order = sorted(range(4), key=lambda i: -dense.stride(i))
    expected = torch.empty_permuted(dense.shape, order, dtype=t.dtype)
    for _ in range(2):                         # the strides computed, then remembered
        got = op._empty_like_layout(t)
        assert got.shape == t.shape and got.dtype == t.dtype and got.stride() == expected.stride()
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:             # a traced call's outputs: the same strides
        assert op._empty_like_layout(mode.from_tensor(t)).stride() == expected.stride()
