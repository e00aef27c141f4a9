"""Log-probabilities of target tokens without holding [B, R, V] logits at once.

Response log-probs need logsumexp over the vocabulary at every response position; at the paper's
lengths (R = 5,120, Qwen3's 151,936-token vocabulary) the float32 logits of one row are 3 GB, and their
backward as much again. Over chunks of `chunk` positions, each rematerialised in the backward pass,
the peak is [B, chunk, V]. Shape suffixes: the legend in marljax/models/decoder.py.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

LOGPROB_CHUNK = 256  # response positions per chunk (R ≤ this: one pass, as without chunking)


def target_logprobs(logits_fn, h_bre, target_br, temperature: float = 1.0, chunk: int | None = None):
    """log softmax(logits_fn(h) / temperature)[target] [B, R] float32; `logits_fn` maps hidden states
    [..., E] (in the compute dtype) to logits [..., V] (the decoder's `logits`: float32); the tempered
    logits and their log-sum-exp are float32 whatever the compute dtype. `chunk` defaults to
    LOGPROB_CHUNK."""
    chunk = LOGPROB_CHUNK if chunk is None else chunk
    if chunk < 1:
        raise ValueError(f"chunk={chunk}: log-probs need at least one position per chunk.")

    def logprobs(h_bce, target_bc):
        logits_bcv = logits_fn(h_bce).astype(jnp.float32) / temperature
        target_logit_bc = jnp.take_along_axis(logits_bcv, target_bc[:, :, None], axis=-1)[:, :, 0]
        return target_logit_bc - jax.nn.logsumexp(logits_bcv, axis=-1)  # no [B, R, V] log_softmax

    B, R, E = h_bre.shape
    if R <= chunk:
        return logprobs(h_bre, target_br)
    pad = -R % chunk
    h_nbce = jnp.pad(h_bre, ((0, 0), (0, pad), (0, 0))).reshape(B, -1, chunk, E).swapaxes(0, 1)
    target_nbc = jnp.pad(target_br, ((0, 0), (0, pad))).reshape(B, -1, chunk).swapaxes(0, 1)
    out_nbc = jax.lax.map(jax.checkpoint(lambda xs: logprobs(*xs)), (h_nbce, target_nbc))
    return out_nbc.swapaxes(0, 1).reshape(B, R + pad)[:, :R]
