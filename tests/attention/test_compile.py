"""torch.compile(fullgraph=True) through every public entry with the default options: no graph break.

On the CPU backend="auto" picks the emulation; the GPU's default path, the Triton kernels, is
compiled here under Triton's interpreter (backend="triton"), with dynamic shapes, and with inductor
on a GPU."""
import pytest
import torch

import stableflash as sf
from stableflash.attention.dropin import StableAttention, scaled_dot_product_attention
from tests.conftest import DEVICE


def every_entry(backend: str | None):
    kw = {} if backend is None else {"backend": backend}
    module = StableAttention(**kw)

    def run(q, k, v):
        a = sf.flash_attention(q, k, v, causal=True, **kw)
        b = scaled_dot_product_attention(q, k, v, is_causal=True, **kw)
        c = module(q, k, v, is_causal=True)
        d = sf.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True, **kw)
        e = sf.flash_attn_qkvpacked_func(torch.stack((q, k, v), 2).transpose(1, 3), causal=True, **kw)
        return a + b + c + d.transpose(1, 2) + e.transpose(1, 2)

    return run


def check(fn, compiled, device="cpu", n=16):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 16, generator=gen).bfloat16().to(device).requires_grad_(True) for _ in range(3))
    got = compiled(q, k, v)
    got.float().sum().backward()
    grads = [t.grad for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    want = fn(q, k, v)
    want.float().sum().backward()
    assert torch.equal(got, want)
    for g, t in zip(grads, (q, k, v)):
        assert torch.equal(g, t.grad)


def inputs(n=16, d=16, device="cpu"):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(1, 2, n, d, generator=gen).bfloat16().to(device).requires_grad_(True) for _ in range(3)]


@pytest.mark.parametrize("backend,dynamic", [(None, False), ("triton", True)])
def test_no_graph_break_in_any_entry(backend, dynamic):
    """The defaults (the emulation on the CPU, the kernels on a GPU) and the kernels, static and dynamic shapes."""
    torch._dynamo.reset()
    entries = every_entry(backend)
    explained = torch._dynamo.explain(entries)(*inputs(n=4, device=DEVICE)) if not dynamic else None
    if explained is not None:
        assert explained.graph_break_count == 0, explained.break_reasons
        return
    fn = every_entry(backend)
    compiled = torch.compile(fn, backend="eager", fullgraph=True, dynamic=True)
    assert torch.equal(compiled(*inputs(device=DEVICE)), fn(*inputs(device=DEVICE)))


@pytest.mark.slow
def test_fullgraph_compile_runs_forward_and_backward_as_eager():
    torch._dynamo.reset()
    fn = lambda q, k, v: sf.flash_attention(q, k, v, causal=True, backend="triton")     # noqa: E731
    check(fn, torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=True), device=DEVICE)


@pytest.mark.gpu
@pytest.mark.parametrize("dynamic", [False, True])
def test_fullgraph_compile_with_inductor_on_the_gpu(dynamic):
    """The five entries summed (5·O): output and gradients within 1.25× (+1e-4) eager's error against
    float64 (the compiled graph's kernels may take other tiles than eager's: not bit for bit)."""
    from tests.attention.test_triton import expanded_reference
    torch._dynamo.reset()
    fn = every_entry(None)
    compiled = torch.compile(fn, fullgraph=True, dynamic=dynamic)
    gen = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, 2, 128, 64, generator=gen).bfloat16().cuda() for _ in range(4))
    results = []
    for f in (compiled, fn):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = f(*leaves)
        results.append((out, *torch.autograd.grad(out, leaves, do)))
    ref = [5 * r for r in expanded_reference(q, k, v, do, True)]
    for name, x, x_e, r in zip(("O", "dQ", "dK", "dV"), *results, ref):
        err, err_e = (((y.double() - r).norm() / r.norm()).item() for y in (x, x_e))
        assert err <= 1.25 * err_e + 1e-4, (name, err, err_e)


def test_a_symbolic_float_of_the_configuration_reaches_the_ops_with_its_value():
    """The ops take the configuration as one string (``KernelConfig.op_key``). Under ``dynamic=True`` a
    float argument such as ``beta`` is symbolic in the trace: the key must carry each call's value
    (specialized and guarded), so that a later call with another beta runs with that beta, as eager does.
    Every query's largest scores are two tied keys, where the paper's rule shifts by beta."""
    torch._dynamo.reset()
    fn = lambda q, k, v, beta: sf.flash_attention(q, k, v, causal=True, backend="triton",  # noqa: E731
                                                  stabilize="paper", beta=beta)
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=True)
    q, k, v = (t.detach().clone() for t in inputs(device=DEVICE))
    q[:] = q[..., :1, :]                          # one query direction u: keys 0 and 1 (2u each) lead every row
    k[..., 0:2, :] = 2 * q[..., :1, :]
    eager = {beta: fn(q, k, v, beta) for beta in (2.0, 5.5)}
    assert not torch.equal(eager[2.0], eager[5.5])       # the rule's beta reaches the output
    for beta in (2.0, 5.5, 2.0):
        assert torch.equal(compiled(q, k, v, beta), eager[beta]), beta


@pytest.mark.parametrize("dropout_p", [0.0, 0.25])
def test_the_forward_op_has_a_cpu_output_only_under_dropout(dropout_p):
    """Without dropout the forward op's seed output is an empty tensor on q's device (CUDA graphs,
    torch.compile's "reduce-overhead", cannot record a CPU output); with dropout it is dropout's seed,
    one int64 on the CPU. The fake implementation (what torch.compile traces) agrees."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from stableflash.attention.triton.launch import stabilized_config
    from stableflash.attention.triton.op import Masks, attn_fwd

    q, k, v = (t.detach() for t in inputs(device=DEVICE))
    args = (q, k, v, True, 0.25, stabilized_config(torch.bfloat16).op_key, *Masks(dropout_p=dropout_p).op_args())
    seed = attn_fwd(*args)[3]
    want = ((1,), torch.device("cpu")) if dropout_p else ((0,), q.device)
    assert (tuple(seed.shape), seed.device, seed.dtype) == (*want, torch.int64)
    with FakeTensorMode() as mode:
        fake = attn_fwd(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args))[3]
    assert (tuple(fake.shape), fake.device, fake.dtype) == (*want, torch.int64)


@pytest.mark.gpu
def test_reduce_overhead_compile_replays_the_kernels_as_cuda_graphs():
    """torch.compile(mode="reduce-overhead") records the kernels' forward and backward as CUDA graphs
    and replays them: gradients as eager's within bf16 rounding of the other kernels in the graph."""
    torch._dynamo.reset()
    fn = lambda q, k, v: (sf.flash_attention(q, k, v, causal=True) * 2).float().sum()   # noqa: E731
    compiled = torch.compile(fn, mode="reduce-overhead", fullgraph=True)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 256, 64, generator=gen).bfloat16().cuda() for _ in range(3))
    want = torch.autograd.grad(fn(*(t.requires_grad_(True) for t in (q, k, v))), (q, k, v))
    for _ in range(3):                          # warm-up, recording, replay
        torch.compiler.cudagraph_mark_step_begin()
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        got = torch.autograd.grad(compiled(*leaves), leaves)
    for g, w in zip(got, want):
        assert (g.float() - w.float()).abs().max().item() <= 1e-2 * w.float().abs().max().item()
