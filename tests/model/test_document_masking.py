"""GPT and Llama with attn_mask_type="block_causal": packed documents attend only within themselves,
through the varlen attention, with each layer's attention choice."""
import dataclasses

import pytest
import torch

from stableflash.model import GPT, GPTConfig, Llama, LlamaConfig

EOT, V, TOL = 3, 40, 2e-5


def _models(family: str, attention: str):
    """(block_causal model, the same weights under plain causal attention)."""
    if family == "gpt":
        cfg = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=V, attn_mask_type="block_causal",
                        eot_token=EOT)
        cls = GPT
    else:                                  # grouped-query attention: 4 query heads over 2 K/V heads
        cfg = LlamaConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=32, block_size=32, vocab_size=V,
                          multiple_of=16, attn_mask_type="block_causal", eot_token=EOT)
        cls = Llama
    torch.manual_seed(0)
    docs = cls(cfg, attention).eval()
    dense = cls(dataclasses.replace(cfg, attn_mask_type="causal", eot_token=None), attention).eval()
    dense.load_state_dict(docs.state_dict())
    return docs, dense


def _doc(gen, n: int, end: bool) -> torch.Tensor:
    """n token ids without EOT, the last one EOT when ``end``."""
    ids = torch.randint(EOT + 1, V, (n,), generator=gen)
    if end:
        ids[-1] = EOT
    return ids


@pytest.mark.parametrize("family", ["gpt", "llama"])
@pytest.mark.parametrize("attention", ["reference", "emulated policy=paper", "sdpa; 1: emulated policy=paper"])
@torch.no_grad()
def test_packed_documents_match_each_document_alone(family, attention, gen):
    docs, dense = _models(family, attention)
    first, second = _doc(gen, 9, end=True), _doc(gen, 7, end=False)
    other = _doc(gen, 9, end=True)                         # another first document of the same length
    rows = torch.stack([torch.cat([first, second]), torch.cat([other, second])])
    logits, _ = docs(rows)                                 # both rows in one batch: rows stay apart too
    # the first document: what it gives alone (the same positions 0..8), under plain causal attention
    alone, _ = dense(first[None])
    torch.testing.assert_close(logits[0, :9], alone[0], atol=TOL, rtol=TOL)
    # the second document sees nothing of the first: the same logits after either first document
    torch.testing.assert_close(logits[0, 9:], logits[1, 9:], atol=TOL, rtol=TOL)
    if family == "llama" and attention == "reference":
        # rotary positions: its attention is what it would be at the start of a row (in exact
        # arithmetic: a low-precision policy rounds the rotated q and k differently)
        alone, _ = dense(second[None])
        torch.testing.assert_close(logits[0, 9:], alone[0], atol=1e-4, rtol=1e-4)
    # under plain causal attention the second document does see the first
    crossed, _ = dense(rows)
    assert (crossed[0, 9:] - logits[0, 9:]).abs().max() > 100 * TOL
    torch.testing.assert_close(crossed[:, :9], logits[:, :9], atol=TOL, rtol=TOL)


@torch.no_grad()
def test_the_layers_choice_applies_under_the_mask(gen):
    """Layer 0's attention output under the emulated bf16 policy "paper" is ~3e-3 (relative) from
    the exact one; the document path gives the dense path's result for that choice to 1e-6, so it
    ran that choice."""
    rows = torch.stack([_doc(gen, 16, end=False), _doc(gen, 16, end=False)])
    paper, dense_paper = _models("gpt", "emulated policy=paper")
    exact, _ = _models("gpt", "reference")
    outputs = []
    for model in (paper, dense_paper, exact):
        model.transformer.h[0].attn.observer = lambda module, x, q, k, v, y: outputs.append(y)
        model(rows)
    assert all(y.shape == (2, 2, 16, 16) for y in outputs)          # (B, H, T, d) on both paths
    got, dense, want = outputs
    scale = want.abs().max()
    assert (got - dense).abs().max() / scale < 1e-6
    assert (got - want).abs().max() / scale > 1e-3


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_rows_without_an_end_of_text_token_train_as_before(family, gen):
    """One document per row: the logits and the gradients of plain causal attention."""
    docs, dense = _models(family, "reference")
    x = torch.randint(EOT + 1, V, (2, 12), generator=gen)
    y = torch.randint(0, V, (2, 12), generator=gen)
    grads = []
    for model in (docs, dense):
        model.zero_grad()
        logits, loss = model(x, y)
        loss.backward()
        grads.append((logits.detach(), [p.grad.clone() for p in model.parameters()]))
    torch.testing.assert_close(grads[0][0], grads[1][0], atol=TOL, rtol=TOL)
    for a, b in zip(grads[0][1], grads[1][1]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("kwargs, match", [
    (dict(attn_mask_type="document"), "attn_mask_type='document' is invalid; accepted: causal, block_causal"),
    (dict(attn_mask_type="block_causal"), "eot_token=None is invalid for attn_mask_type='block_causal'"),
    (dict(attn_mask_type="block_causal", eot_token=V), f"0 <= eot_token < vocab_size={V}"),
    (dict(eot_token=1), "eot_token=1 takes effect only with attn_mask_type='block_causal'"),
])
@pytest.mark.parametrize("cls", [GPTConfig, LlamaConfig])
def test_invalid_model_settings_are_named(cls, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cls(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=V, **kwargs)


@torch.no_grad()
def test_packed_documents_keep_the_q_and_k_norm(gen):
    """With qk_norm, the document path normalizes q and k as the dense path does: the first document's
    logits equal its logits alone under plain causal attention (the norm's weights made unequal to 1,
    so that leaving it out would show)."""
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=V, attn_mask_type="block_causal",
                    eot_token=EOT, qk_norm=True)
    torch.manual_seed(0)
    docs = GPT(cfg, "reference").eval()
    for block in docs.transformer.h:
        for norm in (block.attn.q_norm, block.attn.k_norm):
            norm.weight.uniform_(2.0, 4.0)
    dense = GPT(dataclasses.replace(cfg, attn_mask_type="causal", eot_token=None), "reference").eval()
    dense.load_state_dict(docs.state_dict())
    first, second = _doc(gen, 9, end=True), _doc(gen, 7, end=False)
    logits, _ = docs(torch.cat([first, second])[None])
    alone, _ = dense(first[None])
    torch.testing.assert_close(logits[0, :9], alone[0], atol=TOL, rtol=TOL)
