"""Log-probabilities of target tokens without holding [B, R, V] logits at once.

Response log-probs need logsumexp over the vocabulary at every response position; at the paper's
lengths (R = 5,120, Qwen3's 151,936-token vocabulary) the float32 logits of one row are 3 GB, and a
micro-batch of many short rows (a token budget bounds rows × positions, not rows) holds as much. The
logits are computed over chunks of positions, each rematerialised in the backward pass, sized so that
one chunk's float32 logits on one chip — rows per batch shard × positions × vocabulary × 4 bytes —
stay within a byte budget (`LOGPROB_BYTES`). The bound, per chip: one chunk's logits take at most
max(budget, rows per shard × V × 4) bytes (a chunk has at least one position). Shape suffixes: the
legend in marljax/models/decoder.py.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from marljax.core import sharding

# Float32 logits one chunk may hold per chip: 220 positions of one Qwen3 row (151,936 logits each; the former
# fixed 256-position chunk held 148 MiB), 682 of SmolLM2's (49,152). A response that fits is one pass.
LOGPROB_BYTES = 128 << 20


def chunk_positions(rows: int, length: int, vocab: int, budget: int | None = None) -> int:
    """Positions per chunk: at most what fits `budget` bytes (default LOGPROB_BYTES) of float32 logits over
    `rows` rows per chip, at least 1, evened out over the chunks `length` positions need (less padding)."""
    budget = LOGPROB_BYTES if budget is None else budget
    if budget < 1:
        raise ValueError(f"logprob budget {budget} bytes: log-probs need at least one position's logits.")
    most = max(1, budget // (4 * vocab * max(rows, 1)))
    return -(-length // -(-length // most)) if length > 0 else 1


def target_logprobs(logits_fn, h_bre, target_br, temperature: float = 1.0, budget: int | None = None):
    """log softmax(logits_fn(h) / temperature)[target] [B, R] float32; `logits_fn` maps hidden states
    [..., E] (in the compute dtype) to logits [..., V] (the decoder's `logits`: float32); the tempered
    logits and their log-sum-exp are float32 whatever the compute dtype. `budget`: bytes of float32 logits
    per chunk and chip (`chunk_positions`); the rows per chip are B over the active mesh's batch shards
    (`sharding.active_batch_ranks`)."""

    def logprobs(h_bce, target_bc):
        logits_bcv = logits_fn(h_bce).astype(jnp.float32) / temperature
        target_logit_bc = jnp.take_along_axis(logits_bcv, target_bc[:, :, None], axis=-1)[:, :, 0]
        return target_logit_bc - jax.nn.logsumexp(logits_bcv, axis=-1)  # no [B, R, V] log_softmax

    B, R, E = h_bre.shape
    vocab = jax.eval_shape(logits_fn, h_bre[:1, :1]).shape[-1]
    chunk = chunk_positions(-(-B // sharding.active_batch_ranks()), R, vocab, budget)
    if R <= chunk:
        return logprobs(h_bre, target_br)
    pad = -R % chunk
    h_nbce = jnp.pad(h_bre, ((0, 0), (0, pad), (0, 0))).reshape(B, -1, chunk, E).swapaxes(0, 1)
    target_nbc = jnp.pad(target_br, ((0, 0), (0, pad))).reshape(B, -1, chunk).swapaxes(0, 1)
    out_nbc = jax.lax.map(jax.checkpoint(lambda xs: logprobs(*xs)), (h_nbce, target_nbc))
    return out_nbc.swapaxes(0, 1).reshape(B, R + pad)[:, :R]
