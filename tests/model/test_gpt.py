"""GPT-2 with per-layer attention: sizes, the loss at init, agreement between backends, routing,
low-precision training steps, and the errors at its boundary."""
import math

import pytest
import torch

from stableflash.attention import emulated
from stableflash.model import GPT, MODEL_PRESETS, AttentionChoice, GPTConfig, model_config, parse_attention_spec
from tests.conftest import DEVICE, rel_err

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")   # Triton interpreter: numpy's inf − inf


def tiny(attention="sdpa", dtype=torch.float32, seed=0, **overrides) -> GPT:
    torch.manual_seed(seed)
    return GPT(model_config("tiny", **overrides), attention).to(dtype)


def tokens(gen, b=2, t=48, vocab=256) -> torch.Tensor:
    return torch.randint(0, vocab, (b, t), generator=gen)


def gpt2_small_params(non_embedding: bool) -> int:
    """By formula: bias=False, so a LayerNorm has C weights and a Linear only its matrix."""
    L, C, V, T = 12, 768, 50304, 1024
    per_layer = 4 * C * C + 8 * C * C + 2 * C          # attention (Q, K, V, O) + MLP (4C wide) + 2 LayerNorms
    total = V * C + T * C + L * per_layer + C          # wte (tied to lm_head) + wpe + blocks + ln_f
    return total - T * C if non_embedding else total   # nanoGPT: only the position embedding is "embedding"


def test_gpt2_small_parameter_count_on_meta():
    with torch.device("meta"):
        model = GPT(model_config("gpt2-small"))
        logits, loss = model(torch.zeros(2, 16, dtype=torch.long), torch.zeros(2, 16, dtype=torch.long))
    assert model.num_params(non_embedding=False) == gpt2_small_params(False) == 124_373_760
    assert model.num_params() == gpt2_small_params(True) == 123_587_328
    assert logits.shape == (2, 16, 50304) and loss.shape == ()
    assert model.lm_head.weight is model.transformer.wte.weight


def test_flops_per_token_and_mfu():
    with torch.device("meta"):
        model = GPT(model_config("gpt2-small"))
    want = 6 * 123_587_328 + 12 * 12 * 12 * 64 * 1024   # 6N + 12·L·H·Q·T
    assert model.flops_per_token() == want == 854_770_176
    assert model.estimate_mfu(1e5, 989e12) == pytest.approx(want * 1e5 / 989e12, rel=1e-12)
    with pytest.raises(ValueError, match="peak_flops"):
        model.estimate_mfu(1e5, 0)


def test_presets():
    gpt = [c for c in MODEL_PRESETS.values() if isinstance(c, GPTConfig)]
    assert [(c.n_layer, c.n_head, c.n_embd, c.block_size, c.vocab_size) for c in gpt] == [
        (2, 2, 64, 64, 256), (4, 4, 128, 256, 256), (6, 6, 384, 512, 256), (12, 12, 768, 1024, 50304),
        (24, 16, 1024, 1024, 50304)]
    assert model_config("tiny", n_layer=3, dropout=0.1) == GPTConfig(3, 2, 64, 64, 256, dropout=0.1)
    with pytest.raises(ValueError, match="'huge'.*tiny, mini, small, gpt2-small, gpt2-medium, llama-tiny"):
        model_config("huge")
    with pytest.raises(TypeError, match="n_layers.*n_layer"):
        model_config("tiny", n_layers=3)


@pytest.mark.parametrize("kw, token", [({"n_embd": 65}, "n_embd=65"), ({"n_head": 0}, "n_head=0"),
                                       ({"dropout": 1.0}, "dropout=1.0"), ({"init_std": -1.0}, "init_std=-1.0"),
                                       ({"block_size": 2.5}, "block_size=2.5")])
def test_config_validation(kw, token):
    with pytest.raises(ValueError, match=token):
        model_config("tiny", **kw)


def test_init_loss_is_log_vocab_and_backward(gen):
    model = tiny()
    idx, targets = tokens(gen, 4, 64), tokens(gen, 4, 64)      # targets independent of the inputs
    logits, loss = model(idx, targets)
    assert logits.shape == (4, 64, 256) and logits.dtype == torch.float32
    # small init: nearly uniform predictions, loss ≈ ln 256 = 5.545 (within 0.2)
    assert abs(loss.item() - math.log(256)) < 0.2
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0
               for p in model.parameters())
    assert model(idx)[1] is None


def test_ignore_index(gen):
    model = tiny()
    idx, targets = tokens(gen), tokens(gen)
    masked = targets.clone()
    masked[:, 24:] = -1
    _, loss = model(idx, masked)
    logits, _ = model(idx)
    want = torch.nn.functional.cross_entropy(logits[:, :24].reshape(-1, 256), targets[:, :24].reshape(-1))
    assert abs(loss.item() - want.item()) < 1e-6


def test_residual_init_is_scaled():
    model = GPT(model_config("mini", init_std=0.02))
    proj = torch.cat([b.attn.c_proj.weight.flatten() for b in model.transformer.h])
    fc = torch.cat([b.mlp.c_fc.weight.flatten() for b in model.transformer.h])
    assert abs(proj.std().item() - 0.02 / math.sqrt(8)) < 5e-4       # 65k samples: std error ~ 3e-5
    assert abs(fc.std().item() - 0.02) < 5e-4


def forward_backward(model, idx, targets):
    model.zero_grad()
    logits, loss = model(idx, targets)
    loss.backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_backends_agree_in_float32(gen):
    """sdpa, emulated at the fp32 policy and the float64 reference: same logits to 1e-5 and same gradients
    to 1e-4 (max error over the max entry), so gradients flow through each backend."""
    model = tiny(seed=1)
    idx, targets = tokens(gen), tokens(gen)
    want_logits, want_grads = forward_backward(model, idx, targets)
    for spec in ("emulated policy=fp32", "emulated policy=fp32 block=16", "reference"):
        model.set_attention(spec)
        logits, grads = forward_backward(model, idx, targets)
        assert rel_err(logits, want_logits) < 1e-5, spec
        for name, g in grads.items():
            assert rel_err(g, want_grads[name]) < 1e-4, (spec, name)


def test_paper_policy_in_bfloat16_trains(gen):
    model = tiny("emulated policy=paper", dtype=torch.bfloat16, seed=2)
    idx, targets = tokens(gen), tokens(gen)
    logits, grads = forward_backward(model, idx, targets)
    assert logits.dtype == torch.bfloat16
    assert all(torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads.values())
    model.set_attention("sdpa")
    sdpa_logits, _ = model(idx)
    # the paper policy rounds S, Ō and ℓ to bf16 (2⁻⁸ relative); on a 2-layer model at init the
    # logits stay within 3% of SDPA's
    assert ((logits.float() - sdpa_logits.float()).norm() / sdpa_logits.float().norm()).item() < 3e-2


def test_per_layer_routing(gen, monkeypatch):
    """Layer 1 (only) goes through the emulated backend, with its policy."""
    seen = []
    real = emulated.emulated_attention

    def spy(q, k, v, **kw):
        seen.append(kw["policy"])
        return real(q, k, v, **kw)

    monkeypatch.setattr(emulated, "emulated_attention", spy)
    model = tiny("sdpa; 1: emulated policy=fp32 hp_heads=0")
    assert [m.choice.backend for m in model.attention_layers()] == ["sdpa", "emulated"]
    assert [m.layer for m in model.attention_layers()] == [0, 1]
    model(tokens(gen))
    assert len(seen) == 1 and seen[0].hp_heads == (0,) and seen[0].acc == "fp32"
    model.set_attention("sdpa")
    model(tokens(gen))
    assert len(seen) == 1


def test_set_attention():
    model = tiny()
    model.set_attention("sdpa; 1: triton stabilize=tie-shift")
    assert model.attention_layers()[1].choice == AttentionChoice("triton", stabilize="tie-shift")
    assert model.attention_layers()[0].choice == AttentionChoice("sdpa")
    assert model.attention_spec == parse_attention_spec("sdpa; 1: triton stabilize=tie-shift")
    new = model.attention_spec.with_layers([0], AttentionChoice("emulated", stabilize="tie-shift"))
    model.set_attention(new)
    assert model.attention_layers()[0].choice.stabilize == "tie-shift"
    for bad, token in (("sdpa; 2: emulated", "layer 2"), ("emulated hp_heads=2", "hp_heads=2")):
        with pytest.raises(ValueError, match=token):
            model.set_attention(bad)
        assert model.attention_spec == new                               # unchanged after an error
    with pytest.raises(ValueError, match="n_layer=2"):
        tiny("3: emulated")


def test_sequence_and_input_errors(gen):
    model = tiny()
    with pytest.raises(ValueError, match=r"T=65.*block_size=64"):
        model(tokens(gen, 1, 65))
    with pytest.raises(TypeError, match="int64"):
        model(torch.zeros(1, 8))
    with pytest.raises(ValueError, match=r"\(batch, T\)"):
        model(torch.zeros(8, dtype=torch.long))
    with pytest.raises(ValueError, match="targets"):
        model(tokens(gen, 1, 8), tokens(gen, 1, 9))


def test_projection_weights_slice_c_attn(gen):
    model = tiny(bias=True)
    attn = model.attention_layers()[0]
    x = torch.randn(3, 64, generator=gen)
    q, k, v = attn.c_attn(x).split(64, dim=-1)
    b = attn.c_attn.bias
    for got, w, bias in ((q, attn.q_weight(), b[:64]), (k, attn.k_weight(), b[64:128]), (v, attn.v_weight(), b[128:])):
        assert w.shape == (64, 64)
        torch.testing.assert_close(got, x @ w.T + bias)
    assert attn.o_weight() is attn.c_proj.weight


def test_dropout_only_in_training(gen):
    model = tiny(dropout=0.2)
    idx = tokens(gen)
    model.train()
    assert not torch.equal(model(idx)[0], model(idx)[0])
    model.eval()
    assert torch.equal(model(idx)[0], model(idx)[0])


def test_triton_backend(gen, monkeypatch):
    """The fused kernels (on CPU: Triton's interpreter) in a bf16 model, rule 'tie-shift': forward and backward
    finite, logits within bf16 tolerance (1e-2, norm-relative) of the emulated backend (same fa2 policy)."""
    pytest.importorskip("triton")
    from stableflash.attention.triton import op as triton_op
    monkeypatch.setattr(triton_op, "AUTOTUNE", False)
    model = tiny("triton stabilize=tie-shift", dtype=torch.bfloat16, seed=3).to(DEVICE)
    idx, targets = tokens(gen, 2, 40).to(DEVICE), tokens(gen, 2, 40).to(DEVICE)
    logits, grads = forward_backward(model, idx, targets)
    assert all(torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads.values())
    model.set_attention("emulated stabilize=tie-shift policy=fa2")
    want, want_grads = forward_backward(model, idx, targets)
    assert ((logits.float() - want.float()).norm() / want.float().norm()).item() < 1e-2
    g, w = grads["transformer.h.0.attn.c_attn.weight"].float(), want_grads["transformer.h.0.attn.c_attn.weight"].float()
    assert ((g - w).norm() / w.norm()).item() < 5e-2


@pytest.mark.parametrize("attention", ["triton", "sdpa"])
def test_the_attention_layer_passes_its_projection_packed(gen, monkeypatch, attention):
    """Without q/k norm or documents a layer hands its c_attn output to ``flash_attn_qkvpacked_func``
    as one (B, T, 3, H, d) tensor: its output and every gradient equal, bit for bit, those of
    ``flash_attention`` on the three split views (the layer written out by hand)."""
    if attention == "triton":
        pytest.importorskip("triton")
    import stableflash.model.gpt as gpt_module
    from stableflash.attention import flash_attention
    calls = []
    packed = gpt_module.flash_attn_qkvpacked_func
    monkeypatch.setattr(gpt_module, "flash_attn_qkvpacked_func", lambda qkv, **kw: calls.append(qkv.shape) or packed(qkv, **kw))
    layer = tiny(attention, dtype=torch.bfloat16, seed=4).to(DEVICE).transformer.h[0].attn
    x = torch.randn(2, 40, layer.n_embd, generator=gen).bfloat16().to(DEVICE)
    dy = torch.randn(2, 40, layer.n_embd, generator=gen).bfloat16().to(DEVICE)

    def by_hand(x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, layer.n_head, -1).transpose(1, 2) for t in layer.c_attn(x).split(C, dim=2))
        y = flash_attention(q, k, v, causal=True, **layer.choice.kwargs())
        return layer.c_proj(y.transpose(1, 2).reshape(B, T, C))

    results = []
    for f in (layer, by_hand):
        leaf = x.clone().requires_grad_(True)
        out = f(leaf)
        results.append((out, *torch.autograd.grad(out, (leaf, layer.c_attn.weight, layer.c_proj.weight), dy)))
    assert calls == [(2, 40, 3, layer.n_head, layer.n_embd // layer.n_head)]
    for name, a, b in zip(("y", "dx", "dW_qkv", "dW_o"), *results):
        assert torch.equal(a, b), name


@pytest.mark.gpu
def test_a_compiled_bf16_step_on_the_kernels_gives_eagers_gradients(gen):
    """torch.compile (inductor) of a bf16-autocast step of a 4-layer model on the default kernels (the
    packed attention inline in the graph): loss and every gradient within 2⁻⁶ (norm-relative) of
    eager's — the compiled graph may take other matrix-product and kernel tiles than eager, so not bit
    for bit."""
    torch._dynamo.reset()
    model = GPT(model_config("tiny", n_layer=4, n_head=4, n_embd=256, block_size=512), "triton").cuda()
    idx, targets = tokens(gen, 4, 512).cuda(), tokens(gen, 4, 512).cuda()

    def step(net):
        model.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = net(idx, targets)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    loss, grads = step(torch.compile(model))
    want_loss, want = step(model)
    assert abs(loss.item() - want_loss.item()) <= 2.0 ** -6 * abs(want_loss.item())
    for name, w in want.items():
        assert ((grads[name].float() - w.float()).norm() / w.float().norm()).item() <= 2.0 ** -6, name


def test_qk_norm_bounds_the_logits_whatever_w_q(gen):
    """With qk_norm each head's q and k are LayerNormed (unit gain at init): |q·k| ≤ head_dim, so the
    scaled logits stay ≤ √head_dim even when W_Q and W_K are scaled by 1000; without it they grow."""
    seen = {}

    def observe(mod, x, q, k, v, y):
        seen[mod.layer] = (q @ k.transpose(-1, -2)).abs().max().item() / q.shape[-1] ** 0.5

    for qk_norm in (True, False):
        model = tiny(qk_norm=qk_norm)
        with torch.no_grad():
            for block in model.transformer.h:
                block.attn.c_attn.weight[: 2 * model.config.n_embd] *= 1000.0
                block.attn.observer = observe
        model(tokens(gen))
        hd = model.config.head_dim
        top = max(seen.values())
        if qk_norm:
            assert top <= hd ** 0.5 * (1 + 1e-4)
            assert sum(p.numel() for p in model.parameters()) == sum(
                p.numel() for p in tiny().parameters()) + 2 * hd * model.config.n_layer
        else:
            assert top > 100 * hd ** 0.5


def test_qk_norm_hands_attention_one_dtype_when_the_norm_returns_fp32(gen):
    """CUDA autocast runs LayerNorm in fp32, so the normed q and k came back fp32 beside a bf16 v and
    attention refused them (a GPU run failed so). A norm that returns fp32, as there, must still
    give attention q, k and v in one dtype."""
    class Fp32Norm(torch.nn.LayerNorm):
        def forward(self, x):
            return super().forward(x.float())

    model = tiny(attention="emulated", dtype=torch.bfloat16, qk_norm=True)
    dtypes = set()
    for block in model.transformer.h:
        hd = model.config.head_dim
        block.attn.q_norm, block.attn.k_norm = Fp32Norm(hd), Fp32Norm(hd)
        block.attn.observer = lambda mod, x, q, k, v, y: dtypes.add((q.dtype, k.dtype, v.dtype))
    _, loss = model(tokens(gen), tokens(gen))
    assert torch.isfinite(loss) and dtypes == {(torch.bfloat16,) * 3}


def test_attention_gate_multiplies_each_output_by_its_sigmoid(gen):
    """attn_gate: y·σ(x W_g) before W_O. With W_g = 0 the gate is ½ everywhere, so the attention
    branch's output is exactly half the ungated model's (same weights otherwise)."""
    plain, gated = tiny(), tiny(attn_gate=True)
    gated.load_state_dict(plain.state_dict(), strict=False)
    outs = {}
    x = torch.randn(2, 16, plain.config.n_embd, generator=gen)
    for name, model in (("plain", plain), ("gated", gated)):
        attn = model.transformer.h[0].attn
        if attn.c_gate is not None:
            torch.nn.init.zeros_(attn.c_gate.weight)
        outs[name] = attn(x)
    torch.testing.assert_close(outs["gated"], 0.5 * outs["plain"], rtol=1e-6, atol=1e-7)
    with pytest.raises(TypeError, match="attn_gate='yes' is invalid; accepted: True or False"):
        model_config("tiny", attn_gate="yes")


def test_attention_softcap_caps_the_scores_of_every_layer(gen):
    """attn_softcap=c: each layer's attention is softmax(c·tanh(S/c))·V (checked against float64
    on the layer's own q, k, v); the config refuses it on SDPA layers, which cannot cap."""
    from stableflash.attention import reference
    from stableflash.train.config import make_config
    model = tiny(attention="emulated policy=fp32", attn_softcap=0.05)     # at init the scores are ~0.1
    seen = {}

    def observe(mod, x, q, k, v, y):
        seen[mod.layer] = (q.detach(), k.detach(), v.detach(), y.detach())

    for block in model.transformer.h:
        block.attn.observer = observe
    model(tokens(gen))
    for q, k, v, y in seen.values():
        want = reference.attention(q, k, v, causal=True, softcap=0.05)
        assert rel_err(y, want) < 1e-5
        assert rel_err(y, reference.attention(q, k, v, causal=True)) > 1e-3
    with pytest.raises(ValueError, match=r"attn_softcap=1.5 cannot apply to the layers on backend 'sdpa' \(\[1\]\)"):
        make_config("tiny", overrides=["attn_softcap=1.5", "attention=emulated; 1: sdpa"])


@pytest.mark.parametrize("attention", ["triton", "emulated stabilize=tie-shift"])
def test_a_compiled_model_has_no_graph_break(gen, attention):
    """Each layer reads its attention's keyword arguments on every forward; torch.compile traces that
    too, without a break (a ``functools.cached_property`` there broke the graph in every layer on
    Python 3.11, whose version takes a lock). On the CPU the Triton kernels run under the interpreter."""
    torch._dynamo.reset()
    model = tiny(attention, dtype=torch.bfloat16, n_layer=2).to(DEVICE)
    x = tokens(gen, b=1, t=32).to(DEVICE)
    explained = torch._dynamo.explain(model)(x, x)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1
