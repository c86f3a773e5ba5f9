"""Training probes: spectral norms, row-maximum statistics, the observer, and one record per step
that leaves the model, its gradients and the RNG untouched."""
import json
import math
import time

import pytest
import torch

from stableflash.attention.policy import PrecisionPolicy
from stableflash.diagnostics import probes
from stableflash.diagnostics.delta import delta_summary
from stableflash.diagnostics.probes import (AttentionProbe, probe_record, row_max_stats, spectral_norm,
                                            spectral_norms, weight_spectra)
from stableflash.model import GPT, model_config
from stableflash.numerics import get_format, round_to


def tiny(seed=0, **overrides) -> GPT:
    torch.manual_seed(seed)
    return GPT(model_config("tiny", **overrides), attention="sdpa")


def tokens(gen, b=3, t=40):
    return torch.randint(0, 256, (b, t), generator=gen), torch.randint(0, 256, (b, t), generator=gen)


def exact_norm(w: torch.Tensor) -> float:
    return torch.linalg.matrix_norm(w.double(), ord=2).item()


# ----------------------------------------------------------------------------- spectral norms

@pytest.mark.parametrize("shape", [(64, 64), (32, 64), (200, 50), (256, 256), (3, 1)])
def test_spectral_norm_of_random_matrices(gen, shape):
    w = torch.randn(*shape, generator=gen)
    assert spectral_norm(w) == pytest.approx(exact_norm(w), rel=1e-3)
    assert spectral_norm(w) <= exact_norm(w) * (1 + 1e-5)          # a Ritz value never overshoots


def test_spectral_norm_with_known_singular_values(gen):
    u, _ = torch.linalg.qr(torch.randn(80, 80, generator=gen, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(60, 60, generator=gen, dtype=torch.float64))
    s = torch.linspace(4.99, 0.01, 60, dtype=torch.float64)
    s[0] = 5.0                                                     # σ₂/σ₁ = 0.998: hard for plain power steps
    w = (u[:, :60] * s) @ v.T
    assert spectral_norm(w) == pytest.approx(5.0, rel=1e-3)
    assert spectral_norm(w.T) == pytest.approx(5.0, rel=1e-3)


def test_spectral_norm_of_rank_one_and_degenerate_matrices(gen):
    a, b = torch.randn(30, generator=gen), torch.randn(70, generator=gen)
    assert spectral_norm(torch.outer(a, b)) == pytest.approx((a.norm() * b.norm()).item(), rel=1e-5)
    assert spectral_norm(torch.zeros(5, 7)) == 0.0
    assert spectral_norm(torch.full((4, 4), 2.0, dtype=torch.bfloat16)) == pytest.approx(8.0, rel=1e-6)
    w = torch.randn(6, 6, generator=gen)
    w[2, 3] = math.inf
    assert math.isnan(spectral_norm(w))


def test_spectral_norms_batched_equal_one_by_one(gen):
    w = torch.randn(2, 3, 16, 40, generator=gen)
    batched = spectral_norms(w)
    assert batched.shape == (2, 3)
    for i in range(2):
        for j in range(3):
            assert batched[i, j].item() == pytest.approx(exact_norm(w[i, j]), rel=1e-4)


@pytest.mark.parametrize("args,exc,match", [((torch.ones(3),), ValueError, "matrix"),
                                            ((torch.ones(3, 3), 0), ValueError, "iters=0"),
                                            (([[1.0]],), TypeError, "torch.Tensor")])
def test_spectral_norm_rejects_bad_arguments(args, exc, match):
    with pytest.raises(exc, match=match):
        spectral_norm(*args)


def test_weight_spectra_of_a_gpt(gen):
    model = tiny(n_layer=3, n_head=4, n_embd=32)
    with torch.no_grad():                                          # a distinct, non-random layer 1 W_Q head 2
        model.attention_layers()[1].q_weight()[16:24] *= 10
    spectra = weight_spectra(model)
    L, H, hd = 3, 4, 8
    for kind in "qkvo":
        assert len(spectra[kind]) == L and all(len(row) == H for row in spectra[kind])
        assert len(spectra[f"{kind}_full"]) == L
    for li, layer in enumerate(model.attention_layers()):
        for h in range(H):
            rows = slice(h * hd, (h + 1) * hd)
            expected = {"q": layer.q_weight()[rows], "k": layer.k_weight()[rows], "v": layer.v_weight()[rows],
                        "o": layer.o_weight()[:, rows]}
            for kind, w in expected.items():
                assert spectra[kind][li][h] == pytest.approx(exact_norm(w.detach()), rel=1e-4), (kind, li, h)
        for kind in "qkvo":
            w = getattr(layer, f"{kind}_weight")().detach()
            assert spectra[f"{kind}_full"][li] == pytest.approx(exact_norm(w), rel=1e-4)
    assert max(spectra["q"][1]) == spectra["q"][1][2]
    json.dumps(spectra, allow_nan=False)


def test_weight_spectra_is_duck_typed():
    class Layer:
        n_head = 2

        def __init__(self, scale):
            self.w = torch.eye(4) * scale

        def q_weight(self):
            return self.w

        k_weight = v_weight = o_weight = q_weight

    class Model:
        def attention_layers(self):
            return [Layer(2.0), Layer(3.0)]

    spectra = weight_spectra(Model())
    assert spectra["q"] == [pytest.approx([2.0, 2.0], rel=1e-6), pytest.approx([3.0, 3.0], rel=1e-6)]
    assert spectra["o_full"] == pytest.approx([2.0, 3.0], rel=1e-6)
    with pytest.raises(TypeError, match="attention_layers"):
        weight_spectra(object())


# ----------------------------------------------------------------------------- row maxima

def tied_rows(n_tied_per_head, n=16, d=4, level=3.0):
    """q = e₀ for every row; per head, keys 0..t−1 have k₀ = level (score `level`, scale 1) and the others
    k₀ = 0 (score 0), non-causal: every row's maximum is attained exactly t times."""
    H = len(n_tied_per_head)
    q = torch.zeros(2, H, n, d)
    q[..., 0] = 1.0
    k = torch.zeros(2, H, n, d)
    for h, t in enumerate(n_tied_per_head):
        k[:, h, :t, 0] = level
    return q, k


def test_all_rows_tied():
    q, k = tied_rows([3, 2, 1])
    st = row_max_stats(q, k, causal=False, scale=1.0)
    torch.testing.assert_close(st["repeated_max_frac"], torch.tensor([1.0, 1.0, 0.0], dtype=torch.float64))
    torch.testing.assert_close(st["pbar_one_count"], torch.tensor([3.0, 2.0, 1.0], dtype=torch.float64))
    torch.testing.assert_close(st["max_logit"], torch.full((3,), 3.0, dtype=torch.float64))


def test_unique_maxima_with_causal_mask(gen):
    """Scores q_i·k_j = c·(j + 1) grow with j: under the causal mask row i's maximum is key i, unique;
    row 0 sees one key, so one maximum, not repeated."""
    n, d = 40, 4
    c = 0.5 + torch.rand(1, generator=gen).item()
    q = torch.zeros(1, 2, n, d)
    q[..., 0] = c
    k = torch.zeros(1, 2, n, d)
    k[..., 0] = torch.arange(1.0, n + 1)
    st = row_max_stats(q, k, causal=True, scale=1.0)
    assert st["repeated_max_frac"].tolist() == [0.0, 0.0]
    assert st["pbar_one_count"].tolist() == [1.0, 1.0]
    assert st["max_logit"].tolist() == pytest.approx([c * n] * 2, rel=1e-6)
    # the same keys non-causally: every row's maximum is the last key
    st = row_max_stats(q, k, causal=False, scale=1.0)
    assert st["repeated_max_frac"].tolist() == [0.0, 0.0] and st["pbar_one_count"].tolist() == [1.0, 1.0]


def test_row_zero_alone_is_never_repeated():
    q, k = tied_rows([2], n=2)                         # keys 0 and 1 tie; causal row 0 sees key 0 only
    st = row_max_stats(q, k, causal=True, scale=1.0)
    assert st["repeated_max_frac"].item() == 0.5          # row 1 repeated, row 0 not
    assert st["pbar_one_count"].item() == 1.5


def test_ties_within_eps_but_not_equal():
    q, k = tied_rows([2], n=8)
    k[:, 0, 1, 0] = 3.0 - 5e-4                             # 5e-4 below the maximum
    st = row_max_stats(q, k, causal=False, scale=1.0, eps=1e-3)
    assert st["repeated_max_frac"].item() == 1.0
    assert st["pbar_one_count"].item() == 2.0              # exp(−5e-4) rounds to 1 in bf16 ...
    st = row_max_stats(q, k, causal=False, scale=1.0, eps=1e-4, p_bar_format="fp32")
    assert st["repeated_max_frac"].item() == 0.0
    assert st["pbar_one_count"].item() == 1.0              # ... but not in fp32
    st = row_max_stats(q, k, causal=False, scale=1.0, p_bar_format="fp16")
    assert st["pbar_one_count"].item() == 1.0              # nor in fp16: exp(−5e-4) < 1 − 2⁻¹¹, its largest value below 1


@pytest.mark.parametrize("fmt", ["bf16", "fp16", "e8m4", "fp8_e4m3", "bf16:rtz"])
def test_mixed_heads_and_chunked_rows_match_a_direct_count(gen, monkeypatch, fmt):
    """T = 300 spans three chunks of rows; compare with a count over the full score matrix (P̄ = 1
    by round_to in each format: near-even rounding takes a threshold inside row_max_stats)."""
    B, H, n, d = 2, 3, 300, 8
    monkeypatch.setattr(probes, "CHUNK_ELEMENTS", B * H * n * 128)
    q = torch.randint(-2, 3, (B, H, n, d), generator=gen).float()
    k = torch.randint(-2, 3, (B, H, n, d), generator=gen).float()     # small integers: many exact ties
    k[:, 1] += 1e-3 * torch.rand(B, n, d, generator=gen)                # head 1: P̄ just below 1
    k[:, 2] *= 1.0 + torch.rand(B, n, d, generator=gen)                 # head 2: ties are rare
    st = row_max_stats(q, k, causal=True, scale=0.5, p_bar_format=fmt)
    s = (q.double() @ k.double().transpose(-1, -2)) * 0.5
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -math.inf)
    rm = s.amax(-1, keepdim=True)
    ties = (s >= rm - 1e-3).sum(-1)
    s32 = (torch.matmul(q, k.transpose(-1, -2)) * 0.5).masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -math.inf)
    name, _, mode = fmt.partition(":")                  # P̄ as the probe defines it: fp32 scores, fp32 exp
    p_bar = round_to(torch.exp(s32 - s32.amax(-1, keepdim=True)), get_format(name), mode or "rne")
    torch.testing.assert_close(st["repeated_max_frac"], (ties > 1).double().mean((0, 2)), rtol=0, atol=1e-12)
    torch.testing.assert_close(st["pbar_one_count"], (p_bar == 1).double().sum(-1).mean((0, 2)), rtol=0, atol=1e-12)
    torch.testing.assert_close(st["max_logit"], s.amax((0, 2, 3)), rtol=1e-6, atol=0)
    assert st["repeated_max_frac"][0] > 0.1 and st["repeated_max_frac"][2] < st["repeated_max_frac"][0] / 2


def test_grouped_query_keys_are_shared(gen):
    q = torch.randn(2, 4, 20, 8, generator=gen)
    k = torch.randn(2, 2, 20, 8, generator=gen).round()
    shared = row_max_stats(q, k)
    expanded = row_max_stats(q, k.repeat_interleave(2, dim=1))
    for key in shared:
        torch.testing.assert_close(shared[key], expanded[key], rtol=0, atol=0)
    with pytest.raises(ValueError, match="multiple"):
        row_max_stats(q, torch.randn(2, 3, 20, 8, generator=gen))


@pytest.mark.parametrize("kwargs,exc,match", [({"eps": -1.0}, ValueError, "eps=-1.0"),
                                              ({"scale": 0.0}, ValueError, "scale=0.0"),
                                              ({"p_bar_format": "bf17"}, ValueError, "bf17"),
                                              ({"causal": "yes"}, TypeError, "causal='yes'")])
def test_row_max_stats_rejects_bad_arguments(kwargs, exc, match):
    q, k = tied_rows([2])
    with pytest.raises(exc, match=match):
        row_max_stats(q, k, **kwargs)
    with pytest.raises(ValueError, match="4 dimensions"):
        row_max_stats(q[0], k)


# ----------------------------------------------------------------------------- AttentionProbe

def test_attention_probe_records_what_the_layers_see(gen):
    model = tiny()
    x, _ = tokens(gen)
    sentinel = lambda *args: None                            # noqa: E731
    model.attention_layers()[0].observer = sentinel
    with AttentionProbe(model, n_seq=2, keep_v=True, grad_layers=(0,)) as probe:
        with torch.no_grad():
            model(x)
    layers = model.attention_layers()
    assert layers[0].observer is sentinel and layers[1].observer is None
    for i in range(2):
        assert probe.q[i].shape == probe.k[i].shape == probe.v[i].shape == (2, 2, 40, 32)
    # layer 0's input and q, k recomputed by hand
    with torch.no_grad():
        pos = torch.arange(40)
        x0 = model.transformer.h[0].ln_1(model.transformer.wte(x[:2]) + model.transformer.wpe(pos))
        q, k, _ = layers[0].c_attn(x0).split(64, dim=2)
    torch.testing.assert_close(probe.x[0], x0, rtol=0, atol=0)
    torch.testing.assert_close(probe.q[0], q.view(2, 40, 2, 32).transpose(1, 2), rtol=0, atol=0)
    torch.testing.assert_close(probe.k[0], k.view(2, 40, 2, 32).transpose(1, 2), rtol=0, atol=0)
    stats = probe.row_stats(eps=1e-3)
    for i in range(2):
        direct = row_max_stats(probe.q[i], probe.k[i], causal=True)
        for key in ("repeated_max_frac", "pbar_one_count", "max_logit"):
            assert stats[key][i] == direct[key].tolist()
    assert all(len(stats[key]) == 2 and len(stats[key][0]) == 2 for key in stats)
    assert all(c >= 1 for row in stats["pbar_one_count"] for c in row)   # every row's maximum has P̄ = 1


def test_attention_probe_captures_do(gen):
    model = tiny()
    x, y = tokens(gen)
    with AttentionProbe(model, n_seq=1, grad_layers=(1,)) as probe:
        _, loss = model(x, y)
        (expected,) = torch.autograd.grad(loss, probe.outputs[1], retain_graph=True)
        loss.backward()
    assert set(probe.do) == {1} and probe.do[1].shape == (1, 2, 40, 32)
    torch.testing.assert_close(probe.do[1], expected[:1], rtol=0, atol=0)
    assert probe.do[1].abs().max() > 0 and probe.outputs == {}


def test_attention_probe_restores_observers_after_an_exception(gen):
    model = tiny()
    previous = [lambda *a: None, None]
    for layer, obs in zip(model.attention_layers(), previous):
        layer.observer = obs
    with pytest.raises(RuntimeError, match="boom"):
        with AttentionProbe(model):
            assert all(layer.observer is not obs for layer, obs in zip(model.attention_layers(), previous))
            raise RuntimeError("boom")
    assert [layer.observer for layer in model.attention_layers()] == previous
    with pytest.raises(RuntimeError, match="no forward pass"):
        AttentionProbe(model).row_stats()
    with pytest.raises(ValueError, match="grad_layers"):
        AttentionProbe(model, grad_layers=(2,))
    with pytest.raises(ValueError, match="n_seq=0"):
        AttentionProbe(model, n_seq=0)


# ----------------------------------------------------------------------------- probe_record

def test_probe_record_is_json_and_consistent(gen):
    model = tiny()
    x, y = tokens(gen, b=4, t=64)
    rec = probe_record(model, x, y, n_seq=2, delta_layers=(1,))
    text = json.dumps(rec, allow_nan=False)
    assert set(rec) == {"n_seq", "seq_len", "spectral", "row", "delta"} and rec["n_seq"] == 2
    assert set(rec["delta"]) == {"1"} and rec["delta"]["1"]["tokens"] == 64
    assert rec["spectral"] == weight_spectra(model)
    with AttentionProbe(model, n_seq=2, grad_layers=(1,)) as probe:
        _, loss = model(x[:2], y[:2])
        torch.autograd.grad(loss, probe.outputs[1])
    assert rec["row"] == probe.row_stats()
    assert rec["delta"]["1"] == json.loads(json.dumps(delta_summary(probe.q[1], probe.k[1], probe.v[1],
                                                                     probe.do[1], policy="paper")))
    assert len(text) < 20000


def test_probe_record_leaves_grads_rng_and_parameters_alone(gen):
    model = tiny(dropout=0.1)
    model.train()
    x, y = tokens(gen, b=3, t=64)
    params = list(model.parameters())
    for i, p in enumerate(params):                       # some grads set, some None
        p.grad = torch.randn(p.shape, generator=gen) if i % 2 else None
    grads = [p.grad for p in params]
    grad_values = [None if g is None else g.clone() for g in grads]
    weights = [p.detach().clone() for p in params]
    # a stochastic-rounding δ policy draws from the global RNG: it must be restored all the same
    policy = PrecisionPolicy.preset("paper").replace(acc="bf16:stochastic")
    torch.manual_seed(123)
    rng = torch.get_rng_state()
    probe_record(model, x, y, delta_layers=(0, 1), delta_policy=policy, delta_rule="tie-shift")
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(m.training for m in model.modules())
    for p, g, value, w in zip(params, grads, grad_values, weights):
        assert p.grad is g
        assert (value is None and p.grad is None) or torch.equal(p.grad, value)
        assert torch.equal(p.detach(), w)
    # a dropout step after a probe is bit for bit the step without it
    torch.manual_seed(7)
    probe_record(model, x, y, delta_layers=(0,))
    _, with_probe = model(x, y)
    torch.manual_seed(7)
    _, without = model(x, y)
    assert torch.equal(with_probe, without)


def test_probe_record_restores_state_after_an_error(gen):
    model = tiny()
    x, y = tokens(gen)
    with pytest.raises(ValueError, match="delta_layers"):
        probe_record(model, x, y, delta_layers=(5,))
    with pytest.raises(ValueError, match="y=None"):
        probe_record(model, x, None, delta_layers=(0,))
    with pytest.raises(ValueError, match="policy='bf16'"):
        probe_record(model, x, y, delta_layers=(0,), delta_policy="bf16")
    for p in model.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match="do not require grad"):
        probe_record(model, x, y, delta_layers=(0,))
    assert all(layer.observer is None for layer in model.attention_layers())
    assert model.training and all(p.grad is None for p in model.parameters())
    rec = probe_record(model, x, None)                   # without δ, frozen weights are fine
    assert rec["delta"] == {}


def test_probe_record_under_autocast_and_its_cost(gen):
    model = tiny()
    x, y = tokens(gen, b=8, t=64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        rec = probe_record(model, x, y, delta_layers=(1,))
    json.dumps(rec, allow_nan=False)
    assert rec["delta"]["1"]["policy"] == "paper"
    start = time.perf_counter()
    probe_record(model, x, y, delta_layers=(1,))
    assert time.perf_counter() - start < 2.0               # ~0.06 s on 2 CPU cores


def test_sinks_on_the_first_key_are_counted_over_rows_that_see_two_keys():
    """Key 0 scores highest for every row (a sink); in head 1 key 3 ties with it. Causal: row 0 sees
    key 0 alone and is left out, rows 1-2 have the sink alone, rows 3+ of head 1 a tied sink."""
    n, d = 10, 4
    q = torch.zeros(1, 2, n, d)
    q[..., 0] = 1.0
    k = torch.zeros(1, 2, n, d)
    k[:, :, 0, 0] = 2.0
    k[:, 1, 3, 0] = 2.0
    st = row_max_stats(q, k, causal=True, scale=1.0)
    assert st["sink_frac"].tolist() == [1.0, 1.0]
    assert st["sink_repeated_frac"].tolist() == pytest.approx([0.0, 7 / 9])
    k[:, 0, 5, 0] = 3.0                               # head 0: key 5 beats the sink from row 5 on
    st = row_max_stats(q, k, causal=True, scale=1.0)
    assert st["sink_frac"].tolist() == pytest.approx([4 / 9, 1.0])
    st = row_max_stats(q, k, causal=False, scale=1.0)  # every row sees every key
    assert st["sink_frac"].tolist() == [0.0, 1.0] and st["sink_repeated_frac"].tolist() == [0.0, 1.0]


def test_a_model_probe_reports_sinks_per_layer_and_head(gen):
    from stableflash.model.presets import build_model, model_config
    model = build_model(model_config("llama-tiny"))
    x = torch.randint(0, 256, (2, 32), generator=gen)
    with AttentionProbe(model, n_seq=2) as probe:
        model(x)
    stats = probe.row_stats()
    assert len(stats["sink_frac"]) == 2 and len(stats["sink_frac"][0]) == 4          # layers × heads
    assert all(0.0 <= f <= 1.0 for layer in stats["sink_frac"] for f in layer)
    assert all(r <= f for lr, lf in zip(stats["sink_repeated_frac"], stats["sink_frac"]) for r, f in zip(lr, lf))
