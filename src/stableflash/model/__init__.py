"""GPT-2 with a per-layer choice of attention backend, rule and precision policy."""
from stableflash.model.gpt import GPT, MODEL_PRESETS, CausalSelfAttention, GPTConfig, model_config
from stableflash.model.spec import AttentionChoice, AttentionSpec, as_attention_spec, parse_attention_spec

__all__ = ["GPT", "GPTConfig", "MODEL_PRESETS", "model_config", "CausalSelfAttention", "AttentionChoice",
           "AttentionSpec", "parse_attention_spec", "as_attention_spec"]
