"""Tensors on another GPU than the current one. Triton launches on the current device, so the kernels'
callers run a call under its tensors' device (``launch_cache.elsewhere``): a model split over GPUs, as
transformers' ``device_map="auto"`` splits one, calls each layer on its own GPU while the process's current
device stays the first. On two GPUs: such a call computes what the same call computes with its device
current — O and dK, dV bit for bit, dQ (summed by atomics) as close to float64 as that call's — and
allocates nothing on the current device; a repeated call (a plan's replay) as well."""
import pytest
import torch

import stableflash as sf
from stableflash.attention.triton import launch_cache
from tests.attention.test_triton import expanded_reference

two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")


def test_elsewhere_is_false_for_cpu_and_traced_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode
    x = torch.zeros(2)
    assert not launch_cache.elsewhere(x)
    with FakeTensorMode() as mode:
        assert not launch_cache.elsewhere(mode.from_tensor(x))


def _step(q, k, v, do, packed: bool):
    """O and (dQ, dK, dV) of flash_attention's defaults (causal), the packed entry when ``packed``."""
    if packed:
        qkv = torch.stack((q, k, v), 2).transpose(1, 3).contiguous().requires_grad_(True)   # (B, N, 3, H, d)
        o = sf.flash_attn_qkvpacked_func(qkv, causal=True).transpose(1, 2)
        o.backward(do)
        return [o.detach(), *qkv.grad.transpose(1, 3).unbind(2)]
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    o = sf.flash_attention(q, k, v, causal=True)
    o.backward(do)
    return [o.detach(), q.grad, k.grad, v.grad]


@two_gpus
@pytest.mark.parametrize("packed", [False, True], ids=["separate", "packed"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_a_call_on_the_second_gpu_while_the_first_is_current(head_dim, packed):
    gen = torch.Generator().manual_seed(head_dim)
    B, H, N = 2, 4, 1024
    cpu = [torch.randn(B, H, N, head_dim, generator=gen).bfloat16() for _ in range(4)]
    there = [t.to("cuda:1") for t in cpu]
    with torch.cuda.device(1):
        want = _step(*there, packed)
        torch.cuda.synchronize()
    ref = expanded_reference(*(t.double() for t in cpu), True)
    torch.cuda.synchronize(0)
    torch.cuda.reset_peak_memory_stats(0)
    before = torch.cuda.memory_allocated(0)
    with torch.cuda.device(0):
        for call in range(2):                      # the second call: the plans' replay
            got = _step(*there, packed)
            torch.cuda.synchronize(1)
            assert all(t.device == torch.device("cuda", 1) for t in got)
            for name, x, w in zip(("O", "dK", "dV"), (got[0], got[2], got[3]), (want[0], want[2], want[3])):
                assert torch.equal(x, w), (name, call)
            err, err_want = ((d.double().cpu() - ref[1]).norm() / ref[1].norm() for d in (got[1], want[1]))
            assert err <= 1.25 * err_want + 1e-4, (call, err.item(), err_want.item())
    assert torch.cuda.max_memory_allocated(0) == before           # not even for a while
