"""transformers models on stableflash attention, built as a user builds them: ``from_config`` /
``from_pretrained(..., attn_implementation=register(...))`` on tiny random GPT-2, Llama (grouped-query
attention), Mistral (a sliding window shorter than the sequence) and Gemma 2 (soft-capping and a
window) configs, a fresh config per model, against transformers' own SDPA (eager for Gemma 2, whose
soft-capping SDPA does not apply) with dropout off. No download.
"""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from stableflash.integrations import hf  # noqa: E402
from tests.conftest import readme_python_blocks, rel_err  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:backend=.auto. chose", "ignore::RuntimeWarning",
                                        "ignore::FutureWarning", "ignore::UserWarning")

KINDS = ["gpt2", "llama", "mistral", "gemma2"]
REFERENCE = {"gpt2": "sdpa", "llama": "sdpa", "mistral": "sdpa", "gemma2": "eager"}
# the CPU backends, one model each on the defaults (backend="auto": the emulation on a CPU)
BACKEND = {"gpt2": "auto", "llama": "emulated", "mistral": "reference", "gemma2": "emulated"}
WINDOW = 4          # Mistral's and Gemma 2's sliding window, shorter than every sequence below
VOCAB = 61


def config(kind: str, **overrides):
    """A fresh tiny config of ``kind`` (dropout off unless overridden)."""
    if kind == "gpt2":
        args = dict(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=2, attn_pdrop=0.0,
                    resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        return transformers.GPT2Config(**{**args, **overrides})
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    if kind == "llama":
        return transformers.LlamaConfig(**{**common, **overrides})
    if kind == "mistral":
        return transformers.MistralConfig(**{**common, "sliding_window": WINDOW, **overrides})
    # Gemma 2: layers alternate sliding and full attention; a soft cap small enough to bend the scores
    return transformers.Gemma2Config(**{**common, "head_dim": 8, "sliding_window": WINDOW,
                                        "attn_logit_softcapping": 0.5, "query_pre_attn_scalar": 8, **overrides})


def reference_and_ours(kind: str, tmp_path, **options):
    """The reference model (from_config), saved, and loaded again with stableflash (from_pretrained)."""
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(config(kind), attn_implementation=REFERENCE[kind])
    ref.save_pretrained(tmp_path)
    name = hf.register(**{"backend": BACKEND[kind], **options})
    ours = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=name)
    assert ours.config._attn_implementation == name
    return ref.eval(), ours.eval()


def left_padded(batch=3, seq=10, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (batch, seq), generator=g)
    mask = torch.ones_like(ids)
    for b, pad in enumerate([0, 3, 6][:batch]):
        mask[b, :pad] = 0
        ids[b, :pad] = 0
    return ids, mask


def labels_for(ids, mask):
    """Labels on the tokens whose position and predecessor both hold a token (a padded position's
    output is 0 here, and whatever the reference makes of a row that sees no key there)."""
    before = torch.nn.functional.pad(mask[:, :-1], (1, 0), value=1)
    return ids.masked_fill((mask == 0) | (before == 0), -100)


def readme_hf_example() -> str:
    found = [b for b in readme_python_blocks() if "attn_implementation" in b]
    assert len(found) == 1, "the README should hold one Python example with attn_implementation"
    return found[0]


def test_readme_example_builds_and_trains_a_model_with_padding_and_dropout():
    namespace: dict = {}
    exec(compile(readme_hf_example(), "README.md", "exec"), namespace)
    model = namespace["model"]
    assert model.config._attn_implementation == hf.DEFAULT_NAME
    ids, mask = left_padded(2, 12)
    model.train()
    out = model(ids, attention_mask=mask, labels=labels_for(ids, mask))
    out.loss.backward()
    assert torch.isfinite(out.loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_names_containing_flash_are_refused_naming_the_default():
    with pytest.raises(ValueError, match="name='stableflash' is invalid.*'stable_attention'"):
        hf.register("stableflash")
    assert hf.register() == "stable_attention"


def test_bad_options_fail_at_registration():
    with pytest.raises(ValueError, match="beta=1.0"):
        hf.register(beta=1.0)
    with pytest.raises(ValueError, match="backend='cuda'"):
        hf.register(backend="cuda")


@pytest.mark.parametrize("kind", KINDS)
def test_padded_batch_logits_loss_and_gradients_match_reference(kind, tmp_path):
    ref, ours = reference_and_ours(kind, tmp_path)
    ids, mask = left_padded()
    mask[1] = mask[1].flip(0)                       # one row right-padded: no cache, any padding unpads
    labels = labels_for(ids, mask)
    keep = mask.bool()
    with torch.no_grad():
        want, got = ref(ids, attention_mask=mask).logits, ours(ids, attention_mask=mask).logits
    assert rel_err(got[keep], want[keep]) < 1e-4
    losses = []
    for model in (ref, ours):
        model.train()
        model.zero_grad()
        loss = model(ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        losses.append(loss.detach())
    assert rel_err(losses[1], losses[0]) < 1e-5
    grads = dict(ref.named_parameters())
    for n, p in ours.named_parameters():
        assert rel_err(p.grad, grads[n].grad, floor=1e-6) < 1e-4, n


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("kind", KINDS)
def test_left_padded_greedy_generation_matches_reference(kind, cache, tmp_path):
    """Greedy generate() of a left-padded batch (and, with a static cache, of an unpadded one, whose
    all-ones mask generate() drops, leaving the cache's unfilled slots to the mask function)."""
    ref, ours = reference_and_ours(kind, tmp_path)
    ids, mask = left_padded()
    prompts = [(ids, mask)] + ([(ids[:1], mask[:1])] if cache == "static" else [])
    for prompt, prompt_mask in prompts:
        args = dict(attention_mask=prompt_mask, max_new_tokens=6, do_sample=False, cache_implementation=cache,
                    pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        want, got = ref.generate(prompt, **args), ours.generate(prompt, **args)
        assert torch.equal(got.sequences, want.sequences)
        assert rel_err(torch.stack(got.logits), torch.stack(want.logits)) < 1e-4


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_prefill_continuing_a_cache_and_one_token_decode_match_reference(kind, tmp_path):
    """A second prefill of 4 tokens over a cache of 8 (bottom-right causal), then one token."""
    ref, ours = reference_and_ours(kind, tmp_path)
    ids, mask = left_padded(seq=13)
    outs = []
    for model in (ref, ours):
        cache = transformers.DynamicCache(config=model.config)
        with torch.no_grad():
            model(ids[:, :8], attention_mask=mask[:, :8], past_key_values=cache)
            second = model(ids[:, 8:12], attention_mask=mask[:, :12], past_key_values=cache).logits
            third = model(ids[:, 12:], attention_mask=mask, past_key_values=cache).logits
        outs.append((second, third))
    assert rel_err(outs[1][0], outs[0][0]) < 1e-4
    assert rel_err(outs[1][1], outs[0][1]) < 1e-4


def test_attention_dropout_from_the_config_trains_reproducibly():
    """GPT-2's default attn_pdrop 0.1 in training: a seeded step repeats exactly and differs from
    attention dropout off (the other dropouts off in both)."""
    name = hf.register()

    def step(attn_pdrop, seed):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config("gpt2", attn_pdrop=attn_pdrop),
                                                              attn_implementation=name)
        model.train()
        ids, mask = left_padded(2, 12)
        torch.manual_seed(seed)
        loss = model(ids, attention_mask=mask, labels=labels_for(ids, mask)).loss
        loss.backward()
        return loss.detach(), model.transformer.h[0].attn.c_attn.weight.grad

    loss, grad = step(0.1, seed=5)
    again_loss, again_grad = step(0.1, seed=5)
    other_loss, _ = step(0.1, seed=6)
    off_loss, off_grad = step(0.0, seed=5)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert torch.equal(loss, again_loss) and torch.equal(grad, again_grad)
    assert loss != other_loss
    assert loss != off_loss and not torch.allclose(grad, off_grad)


def test_packed_documents_match_each_document_alone(tmp_path):
    """Three documents packed in one row, found from position_ids and given as cu_seq_lens."""
    ref, ours = reference_and_ours("llama", tmp_path)
    lengths = [5, 1, 6]
    ids = torch.randint(1, VOCAB, (1, sum(lengths)), generator=torch.Generator().manual_seed(2))
    position_ids = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    with torch.no_grad():
        want = torch.cat([ref(doc).logits for doc in ids.split(lengths, dim=1)], dim=1)
        got = ours(ids, position_ids=position_ids).logits
        cu = torch.tensor([0, 5, 6, 12], dtype=torch.int32)
        given = ours(ids, position_ids=position_ids, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=6,
                     max_length_k=6).logits
    assert rel_err(got, want) < 1e-4
    assert rel_err(given, want) < 1e-4


def test_a_4d_mask_is_read_as_sdpa_reads_it(tmp_path):
    ref, ours = reference_and_ours("llama", tmp_path)
    ids, mask = left_padded(seq=8)
    n = ids.shape[1]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    mask4 = (causal & mask.bool()[:, None, None, :]) | torch.eye(n, dtype=torch.bool)    # no empty rows
    with torch.no_grad():
        want, got = ref(ids, attention_mask=mask4).logits, ours(ids, attention_mask=mask4).logits
    assert rel_err(got, want) < 1e-4


def test_a_custom_mask_overlay_is_refused_clearly():
    from transformers.masking_utils import create_causal_mask
    cfg = config("llama")
    cfg._attn_implementation = hf.register()
    embeds = torch.zeros(1, 4, 32)
    with pytest.raises(ValueError, match="custom mask overlay"):
        create_causal_mask(cfg, embeds, torch.ones(1, 4, dtype=torch.long), None,
                           and_mask_function=lambda b, h, q, k: k >= 0)


@pytest.mark.parametrize("dynamic", [False, True])
def test_compiled_one_layer_llama_has_no_graph_breaks(dynamic):
    """torch.compile(fullgraph=True) of a one-layer Llama on the default options: fullgraph raises at
    the first graph break."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config("llama", num_hidden_layers=1),
                                                          attn_implementation=hf.register()).eval()
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(3))
    torch._dynamo.reset()
    # dynamo finds graph breaks and traces symbolic shapes; aot_eager also traces the backward's graph
    compiled = torch.compile(lambda x: model(x).logits, fullgraph=True, backend="eager" if dynamic else "aot_eager",
                             dynamic=dynamic)
    with torch.no_grad():
        assert rel_err(compiled(ids), model(ids).logits) < 1e-5
