"""The Llama-style model: rotary positions, grouped-query attention, QK-norm, causality, training
through the same harness, the diagnostics on it, and the errors at its boundary."""
import math

import pytest
import torch

from stableflash.diagnostics.probes import probe_record
from stableflash.model import Llama, LlamaConfig, build_model, model_config
from stableflash.model.llama import apply_rope, rope_tables
from stableflash.train.config import make_config
from stableflash.train.loop import train
from stableflash.train.metrics import read_metrics

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def llama(attention="sdpa", dtype=torch.float32, seed=0, **overrides) -> Llama:
    torch.manual_seed(seed)
    return build_model(model_config("llama-tiny", **overrides), attention).to(dtype)


def test_shapes_loss_at_init_and_parameter_count(gen):
    model = llama()
    idx = torch.randint(0, 256, (2, 40), generator=gen)
    logits, loss = model(idx, idx)
    assert logits.shape == (2, 40, 256)
    assert abs(loss.item() - math.log(256)) < 0.1                  # near-uniform at initialisation
    c = model.config                                              # no biases; K, V at 2 of 4 heads
    per_layer = 2 * c.n_embd * c.n_embd + 2 * c.n_embd * c.n_embd // 2 + 3 * c.n_embd * c.ffn_hidden + 2 * c.n_embd
    assert model.num_params(non_embedding=False) == 2 * 256 * c.n_embd + c.n_layer * per_layer + c.n_embd
    assert c.ffn_hidden == 192                                     # 8/3·64 rounded up to a multiple of 64


def test_rope_is_a_rotation_by_position_and_scores_depend_on_offsets_only(gen):
    d, n = 16, 40
    cos, sin = rope_tables(d, n, 10000.0)
    x = torch.randn(1, 1, n, d, generator=gen, dtype=torch.float64)
    got = apply_rope(x, cos.double(), sin.double())
    # complex reference: pair (x_i, x_{i+d/2}) is the number x_i + i·x_{i+d/2}, turned by pos·θ_i
    theta = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    z = torch.complex(x[..., : d // 2], x[..., d // 2:]) * torch.polar(torch.ones(n, d // 2, dtype=torch.float64),
                                                                        torch.outer(torch.arange(n).double(), theta))
    torch.testing.assert_close(got, torch.cat([z.real, z.imag], dim=-1), rtol=1e-6, atol=1e-6)
    q, k = torch.randn(d, generator=gen), torch.randn(d, generator=gen)
    def score(i, j):
        qs = apply_rope(q.expand(1, 1, n, d), cos, sin)[0, 0, i]
        ks = apply_rope(k.expand(1, 1, n, d), cos, sin)[0, 0, j]
        return (qs @ ks).item()
    assert score(7, 3) == pytest.approx(score(30, 26), rel=1e-5)   # same offset, same score
    assert score(7, 3) != pytest.approx(score(7, 5), rel=1e-3)


def test_grouped_query_attention_equals_repeated_heads(gen):
    """K/V heads shared by groups of query heads give what full multi-head attention gives with
    each K/V head's weights repeated for its group."""
    gqa = llama(dtype=torch.float64)
    mha = llama(dtype=torch.float64, n_kv_head=4)
    state = gqa.state_dict()
    hd = gqa.config.head_dim
    for key, w in list(state.items()):
        if key.endswith(("attn.wk.weight", "attn.wv.weight")):       # (2·hd, C) → (4·hd, C), head h ← h // 2
            state[key] = w.view(2, hd, -1).repeat_interleave(2, dim=0).reshape(4 * hd, -1)
    mha.load_state_dict(state)
    idx = torch.randint(0, 256, (2, 33), generator=gen)
    torch.testing.assert_close(gqa(idx)[0], mha(idx)[0], rtol=1e-10, atol=1e-10)


def test_qk_norm_gives_unit_rms_per_head(gen):
    model = llama(qk_norm=True)
    seen = {}
    model.attention_layers()[0].observer = lambda mod, x, q, k, v, y: seen.update(q=q, k=k)
    model(torch.randint(0, 256, (2, 20), generator=gen))
    for t in (seen["q"], seen["k"]):    # the rotation keeps each pair's length; the norm's eps (1e-5)
        torch.testing.assert_close(t.pow(2).mean(-1), torch.ones(t.shape[:-1]), rtol=0, atol=2e-3)
    assert llama().layers[0].attn.q_norm is None                  # off unless asked for


def test_future_tokens_do_not_change_earlier_logits(gen):
    model = llama(dtype=torch.float64)
    idx = torch.randint(0, 256, (1, 30), generator=gen)
    changed = idx.clone()
    changed[0, 20:] = (changed[0, 20:] + 1) % 256
    torch.testing.assert_close(model(idx)[0][:, :20], model(changed)[0][:, :20], rtol=0, atol=1e-12)
    assert not torch.allclose(model(idx)[0][:, 20:], model(changed)[0][:, 20:])


def test_every_backend_agrees_and_layers_can_differ(gen):
    idx = torch.randint(0, 256, (2, 24), generator=gen)
    want = llama("reference", torch.float64)(idx)[0]
    for spec in ("sdpa", "emulated policy=fp64", "sdpa; 1: emulated policy=fp64 stabilize=tie-shift"):
        got = llama(spec, torch.float64)(idx)[0]
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    model = llama("sdpa; 1: emulated policy=paper")
    assert [str(m.choice) for m in model.attention_layers()][1].startswith("emulated")
    model.set_attention("reference")
    assert all(str(m.choice) == "reference" for m in model.attention_layers())


def test_probes_read_grouped_query_heads(gen):
    model = llama()
    x = torch.randint(0, 256, (2, 32), generator=gen)
    rec = probe_record(model, x, x, n_seq=2, delta_layers=[1], delta_policy="paper")
    assert len(rec["spectral"]["q"][0]) == 4 and len(rec["spectral"]["k"][0]) == 2    # K/V: 2 heads
    assert len(rec["row"]["repeated_max_frac"][0]) == 4
    assert rec["delta"]["1"]["sum_over_tokens"] is not None


def test_trains_through_the_harness_and_resumes_bit_for_bit(data_dir, tmp_path):
    cfg = make_config("tiny", overrides=[f"data={data_dir}", "model=llama-tiny", "max_iters=120",
                                         "lr_decay_iters=120", "ckpt_every=60"])
    summary = train(cfg, tmp_path / "run", progress=False)
    losses = [r["loss"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "event" not in r]
    assert summary["status"] == "finished" and len(losses) == 120
    assert sum(losses[-10:]) / 10 < losses[0] - 1.5              # it learns the byte-level corpus
    half = make_config("tiny", overrides=[f"data={data_dir}", "model=llama-tiny", "max_iters=60",
                                          "lr_decay_iters=120", "ckpt_every=60"])
    train(half, tmp_path / "resumed", progress=False)
    train(cfg, tmp_path / "resumed", progress=False, resume=True)
    again = [r["loss"] for r in read_metrics(tmp_path / "resumed" / "metrics.jsonl") if "event" not in r]
    assert again == losses


@pytest.mark.parametrize("kw, exc, match", [
    ({"n_kv_head": 3}, ValueError, r"n_kv_head=3 is invalid; accepted: None or a positive divisor of n_head=4"),
    ({"n_embd": 76}, ValueError, r"n_embd=76 must be n_head=4 times an even head_dim"),
    ({"rope_theta": 0.5}, ValueError, r"rope_theta=0.5 is invalid"),
    ({"qk_norm": 1}, TypeError, r"qk_norm=1 is invalid; accepted: True or False"),
])
def test_bad_configs_are_named(kw, exc, match):
    with pytest.raises(exc, match=match):
        model_config("llama-tiny", **kw)


def test_a_gpt_only_field_is_rejected_by_name():
    with pytest.raises(TypeError, match=r"unknown field\(s\) bias for LlamaConfig preset 'llama-tiny'"):
        model_config("llama-tiny", bias=True)
    with pytest.raises(TypeError, match=r"unknown field\(s\) bias for LlamaConfig"):     # at config time
        make_config("tiny", overrides=["model=llama-tiny", "bias=true"])
    with pytest.raises(TypeError, match="accepted: a LlamaConfig"):
        Llama(model_config("tiny"))
    assert isinstance(model_config("llama-small-qknorm"), LlamaConfig) and model_config("llama-small-qknorm").qk_norm
