"""GGUF files (llama.cpp): their tensor names onto HF names, their metadata onto a ModelConfig.

`read_gguf` gives the config and the tensors, under HF names in HF layout (dequantized, Q/K rows in
rotate-half order), for `marljax.models.loading` to assemble.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np

from marljax.models.decoder import ModelConfig
from marljax.models.hf import LAYER_HF_NAMES, TOP_HF_NAMES, CheckpointError, Tensor

_GGUF_TOP = {"token_embd.weight": TOP_HF_NAMES["embed"],
             "output_norm.weight": TOP_HF_NAMES["final_norm"], "output.weight": TOP_HF_NAMES["lm_head"]}
_GGUF_LAYER = {"attn_norm": "attn_norm", "ffn_norm": "mlp_norm", "attn_q": "wq", "attn_k": "wk",
               "attn_v": "wv", "attn_output": "wo", "ffn_gate": "w_gate", "ffn_up": "w_up",
               "ffn_down": "w_down"}
_GGUF_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


def _gguf_hf_name(name: str) -> str:
    if name in _GGUF_TOP:
        return _GGUF_TOP[name]
    m = _GGUF_LAYER_RE.fullmatch(name)
    if m and m.group(2) in _GGUF_LAYER:
        return f"model.layers.{m.group(1)}.{LAYER_HF_NAMES[_GGUF_LAYER[m.group(2)]]}"
    return name  # reported as unexpected


def _unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order: per head it stores the rotary pairs interleaved (x0, x_half,
    x1, x_half+1, …); HF's rotate-half layout stores the two halves one after the other."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def config_from_gguf(reader, dtype: str = "float32") -> ModelConfig:
    """GGUF metadata (Llama architecture) -> ModelConfig, or CheckpointError naming the key."""
    def field(key, default=None):
        f = reader.fields.get(key)
        if f is None:
            if default is None:
                raise CheckpointError(f"GGUF metadata key {key!r} is missing.")
            return default
        return f.contents()

    arch = field("general.architecture")
    if arch != "llama":
        raise CheckpointError(f"GGUF general.architecture={arch!r} is not supported by marljax's "
                              "GGUF loader (supported: 'llama'); convert the model to a HF "
                              "safetensors checkpoint dir instead.")
    scaling = field("llama.rope.scaling.type", "none")
    if scaling != "none":
        raise CheckpointError(f"GGUF llama.rope.scaling.type={scaling!r} is not supported by "
                              "marljax's decoder (supported: 'none').")
    names = {t.name for t in reader.tensors}
    hidden, heads = int(field("llama.embedding_length")), int(field("llama.attention.head_count"))
    vocab = field("llama.vocab_size", 0) or len(field("tokenizer.ggml.tokens"))
    eps = float(field("llama.attention.layer_norm_rms_epsilon"))
    return ModelConfig(
        vocab_size=int(vocab), hidden_size=hidden,
        intermediate_size=int(field("llama.feed_forward_length")),
        num_layers=int(field("llama.block_count")), num_heads=heads,
        num_kv_heads=int(field("llama.attention.head_count_kv", heads)),
        head_dim=int(field("llama.attention.key_length", hidden // heads)),
        rope_theta=float(field("llama.rope.freq_base", 10_000.0)),
        rms_norm_eps=float(f"{eps:.6g}"),  # stored as float32: 9.9999997e-06 -> 1e-05
        tie_embeddings="output.weight" not in names, qk_norm=False,
        max_position=int(field("llama.context_length", 4096)), dtype=dtype)


def read_gguf(path: str | os.PathLike, dtype: str = "float32") -> tuple[ModelConfig, dict[str, Tensor]]:
    """A llama.cpp GGUF file (Llama architecture, any quantization `gguf` dequantizes) -> its config and
    its tensors under HF names, each dequantized when read."""
    import gguf

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} not found.")
    reader = gguf.GGUFReader(path)
    config = config_from_gguf(reader, dtype)

    def reader_of(t):
        def read():
            w = gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape)))
            if t.name.endswith("attn_q.weight"):
                w = _unpermute_rows(w, config.num_heads)
            elif t.name.endswith("attn_k.weight"):
                w = _unpermute_rows(w, config.num_kv_heads)
            return w
        return read

    return config, {_gguf_hf_name(t.name): Tensor(tuple(int(d) for d in reversed(t.shape)), reader_of(t))
                    for t in reader.tensors}
