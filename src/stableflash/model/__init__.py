"""GPT-2 and a Llama-style decoder, with a per-layer choice of attention backend, rule and precision policy."""
from stableflash.model.gpt import GPT, CausalSelfAttention, GPTConfig
from stableflash.model.llama import Llama, LlamaAttention, LlamaConfig
from stableflash.model.presets import MODEL_PRESETS, build_model, model_config
from stableflash.model.spec import AttentionChoice, AttentionSpec, as_attention_spec, parse_attention_spec

__all__ = ["GPT", "GPTConfig", "Llama", "LlamaConfig", "LlamaAttention", "MODEL_PRESETS", "model_config",
           "build_model", "CausalSelfAttention", "AttentionChoice", "AttentionSpec", "parse_attention_spec",
           "as_attention_spec"]
