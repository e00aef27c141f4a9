"""Model FLOPs of the decoder's work, counted from the config before anything runs: the useful work, not
what the implementation executes.

Counted: every layer matmul (2 FLOPs per multiply-add) on real tokens only (padding excluded); causal
attention, QKᵀ and the value product over the keys a query may see (position i sees i + 1 keys, so half
of T × T plus the diagonal; the implementation computes the whole masked square); the output head
(D × vocab) only where its logits are used. Elementwise work (norms, RoPE, softmax, SiLU) is not counted.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

from marljax.models.decoder import LINEAR_AXES


def layer_matmul_params(cfg) -> int:
    """Multiply-adds per token of all layers' linear maps (the head excluded)."""
    return cfg.num_layers * sum(math.prod(i) * math.prod(o) for i, o in map(cfg.linear_shape, LINEAR_AXES))


def lora_matmul_params(cfg, rank: int, layers: int | None = None) -> int:
    """Multiply-adds per token of rank-`rank` adapters on every linear map of the last `layers` layers."""
    n = cfg.num_layers if layers is None else layers
    return n * rank * sum(math.prod(i) + math.prod(o) for i, o in map(cfg.linear_shape, LINEAR_AXES))


def causal_pairs(length: int) -> int:
    """(query, key) pairs of causal attention over one sequence of `length` real tokens."""
    return length * (length + 1) // 2


def forward_flops(cfg, lengths: Sequence[int], head_tokens: int) -> int:
    """One forward pass over sequences of the given real lengths, with the head on `head_tokens` positions."""
    attention = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * sum(map(causal_pairs, lengths))
    return 2 * layer_matmul_params(cfg) * sum(lengths) + attention + 2 * cfg.hidden_size * cfg.vocab_size * head_tokens


def train_flops(cfg, prompt_lens: Sequence[int], response_lens: Sequence[int], *,
                lora_rank: int | None = None, lora_layers: int | None = None) -> int:
    """One training step's model FLOPs over rows of prompt + response real tokens, the head on response
    positions (where the trainer computes logits). Forward, plus the backward to the activations (the
    forward's cost again for the matmuls, twice it for attention), plus weight gradients: of every matmul
    and the head for full fine-tuning (`lora_rank` None), of the adapters only with LoRA (whose own
    forward and backward add 6 FLOPs per adapter multiply-add)."""
    lengths = [p + r for p, r in zip(prompt_lens, response_lens, strict=True)]
    tokens, head = sum(lengths), sum(response_lens)
    dense = 2 * layer_matmul_params(cfg) * tokens + 2 * cfg.hidden_size * cfg.vocab_size * head
    attention = forward_flops(cfg, lengths, 0) - 2 * layer_matmul_params(cfg) * tokens
    if lora_rank is None:
        return 3 * dense + 3 * attention
    return 2 * dense + 3 * attention + 6 * lora_matmul_params(cfg, lora_rank, lora_layers) * tokens


def prefill_flops(cfg, prompt_lens: Sequence[int]) -> int:
    """The sampler's prefill: every prompt token through the layers, the head on each last prompt position."""
    return forward_flops(cfg, prompt_lens, head_tokens=len(prompt_lens))


def decode_flops(cfg, prompt_len: int, new: int, rows: int) -> int:
    """`new` - 1 decode steps after the prefill's first token: each new token attends to the prompt and the
    tokens before it, the head on every new token."""
    contexts = range(prompt_len + 1, prompt_len + new)
    per_row = sum(2 * layer_matmul_params(cfg) + 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * c
                  + 2 * cfg.hidden_size * cfg.vocab_size for c in contexts)
    return rows * per_row
