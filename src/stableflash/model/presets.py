"""Named model shapes (GPT-2 and Llama-style), and building a model from one."""
from __future__ import annotations

from dataclasses import fields, replace

from stableflash.model.gpt import GPT, GPTConfig
from stableflash.model.llama import Llama, LlamaConfig
from stableflash.model.spec import AttentionChoice, AttentionSpec

MODEL_PRESETS: dict[str, GPTConfig | LlamaConfig] = {
    # trains on 2 CPU cores in seconds
    "tiny": GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=64, vocab_size=256),
    "mini": GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=256, vocab_size=256),
    # byte-level model of the first reproduction runs
    "small": GPTConfig(n_layer=6, n_head=6, n_embd=384, block_size=512, vocab_size=256),
    # the paper's GPT-2 (124M); vocab 50257 padded to a multiple of 64, as nanoGPT does
    "gpt2-small": GPTConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50304),
    "gpt2-medium": GPTConfig(n_layer=24, n_head=16, n_embd=1024, block_size=1024, vocab_size=50304),
    # Llama-style (RoPE, RMSNorm, SwiGLU, no biases) with grouped-query attention, the same sizes
    "llama-tiny": LlamaConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=64, block_size=64, vocab_size=256),
    "llama-small": LlamaConfig(n_layer=6, n_head=6, n_kv_head=2, n_embd=384, block_size=512, vocab_size=256),
    "llama-small-qknorm": LlamaConfig(n_layer=6, n_head=6, n_kv_head=2, n_embd=384, block_size=512, vocab_size=256,
                                      qk_norm=True),
}


def model_config(name: str, **overrides) -> GPTConfig | LlamaConfig:
    """The preset ``name`` of MODEL_PRESETS with some fields replaced (validated again)."""
    if name not in MODEL_PRESETS:
        raise ValueError(f"model preset {name!r} is unknown; accepted: {', '.join(MODEL_PRESETS)}")
    preset = MODEL_PRESETS[name]
    known = [f.name for f in fields(preset)]
    unknown = [k for k in overrides if k not in known]
    if unknown:
        raise TypeError(f"model_config: unknown field(s) {', '.join(unknown)} for {type(preset).__name__} "
                        f"preset {name!r}; accepted: {', '.join(known)}")
    return replace(preset, **overrides)


def build_model(config: GPTConfig | LlamaConfig, attention: AttentionSpec | AttentionChoice | str = "sdpa"):
    """GPT for a GPTConfig, Llama for a LlamaConfig."""
    if isinstance(config, LlamaConfig):
        return Llama(config, attention)
    if isinstance(config, GPTConfig):
        return GPT(config, attention)
    raise TypeError(f"config={config!r} is invalid; accepted: a GPTConfig or LlamaConfig (see model_config)")
