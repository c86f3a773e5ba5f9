"""transformers models run on stableflash attention: tiny random GPT-2 and Llama, no download."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from stableflash.integrations import hf  # noqa: E402
from tests.conftest import DEVICE, readme_python_blocks  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


@pytest.fixture
def fixed_config(monkeypatch):
    """The fused kernels without autotuning (the Triton tests take it)."""
    pytest.importorskip("triton")
    from stableflash.attention.triton import op as triton_op
    monkeypatch.setattr(triton_op, "AUTOTUNE", False)


def readme_hf_example() -> str:
    found = [b for b in readme_python_blocks() if "attn_implementation" in b]
    assert len(found) == 1, "the README should hold one Python example with attn_implementation"
    return found[0]


@pytest.mark.filterwarnings("ignore:backend=.auto. chose")
def test_readme_example_builds_and_trains_a_model():
    namespace: dict = {}
    exec(compile(readme_hf_example(), "README.md", "exec"), namespace)
    model = namespace["model"]
    assert model.config._attn_implementation == hf.DEFAULT_NAME
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    out = model(ids, labels=ids)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_names_containing_flash_are_refused():
    with pytest.raises(ValueError, match="name='stableflash' is invalid"):
        hf.register("stableflash")


def tiny(kind: str, attn: str):
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=97, n_positions=64, n_embd=64, n_layer=2, n_head=2, attn_pdrop=0.0,
                                      bos_token_id=0, eos_token_id=0)
        model = transformers.GPT2LMHeadModel(cfg)
    else:                                            # Llama with grouped-query attention
        cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
        model = transformers.LlamaForCausalLM(cfg)
    model.config._attn_implementation = attn
    model.set_attn_implementation(attn) if hasattr(model, "set_attn_implementation") else None
    return model.to(DEVICE, torch.bfloat16).eval()


@pytest.mark.usefixtures("fixed_config")
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_model_matches_sdpa_and_trains(kind):
    name = hf.register(backend="triton")
    ids = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    ref = tiny(kind, "sdpa")
    ours = tiny(kind, name)
    ours.load_state_dict(ref.state_dict())
    with torch.no_grad():
        want = ref(ids).logits.float()
        got = ours(ids).logits.float()
    assert ((got - want).norm() / want.norm()).item() < 2e-2
    out = ours(ids, labels=ids)
    out.loss.backward()
    grads = [p.grad for p in ours.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)


@pytest.mark.usefixtures("fixed_config")
def test_padding_mask_is_refused_clearly():
    name = hf.register(backend="triton")
    model = tiny("gpt2", name)
    ids = torch.randint(0, 97, (2, 8)).to(DEVICE)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with pytest.raises(ValueError, match="takes no attention mask"):
        model(ids, attention_mask=mask)


@pytest.mark.usefixtures("fixed_config")
def test_attention_dropout_in_training_is_refused():
    name = hf.register(backend="triton")
    model = tiny("gpt2", name)
    for module in model.modules():
        if hasattr(module, "attn_dropout"):
            module.attn_dropout.p = 0.1
    model.config.attn_pdrop = 0.1
    model.train()
    ids = torch.randint(0, 97, (1, 8)).to(DEVICE)
    with pytest.raises(ValueError, match="dropout=0.1 is not supported in training"):
        model(ids)


def test_bad_options_fail_at_registration():
    with pytest.raises(ValueError, match="beta=1.0"):
        hf.register(beta=1.0)
    with pytest.raises(ValueError, match="backend='cuda'"):
        hf.register(backend="cuda")
