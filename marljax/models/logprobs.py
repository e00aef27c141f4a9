"""Log-probabilities of target tokens without holding [n, R, vocab] logits at once.

Response log-probs need logsumexp over the vocabulary at every response position; at the paper's
lengths (R = 5,120, Qwen3's 151,936-token vocabulary) the float32 logits of one row are 3 GB, and their
backward as much again. Over chunks of `chunk` positions, each rematerialised in the backward pass,
the peak is [n, chunk, vocab].
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

LOGPROB_CHUNK = 256  # response positions per chunk (R ≤ this: one pass, as without chunking)


def target_logprobs(logits_fn, h_nrd, target_nr, temperature: float = 1.0, chunk: int | None = None):
    """log softmax(logits_fn(h) / temperature)[target] [n, R] float32; `logits_fn` maps hidden states
    [..., D] (in the compute dtype) to logits [..., V] (the decoder's `logits`: float32); the tempered
    logits and their log-sum-exp are float32 whatever the compute dtype. `chunk` defaults to
    LOGPROB_CHUNK."""
    chunk = LOGPROB_CHUNK if chunk is None else chunk
    if chunk < 1:
        raise ValueError(f"chunk={chunk}: log-probs need at least one position per chunk.")

    def logprobs(h_ncd, target_nc):
        logits = logits_fn(h_ncd).astype(jnp.float32) / temperature
        target_logit = jnp.take_along_axis(logits, target_nc[:, :, None], axis=-1)[:, :, 0]
        return target_logit - jax.nn.logsumexp(logits, axis=-1)  # no [n, R, vocab] log_softmax

    n, R, D = h_nrd.shape
    if R <= chunk:
        return logprobs(h_nrd, target_nr)
    pad = -R % chunk
    h_knc = jnp.pad(h_nrd, ((0, 0), (0, pad), (0, 0))).reshape(n, -1, chunk, D).swapaxes(0, 1)
    t_knc = jnp.pad(target_nr, ((0, 0), (0, pad))).reshape(n, -1, chunk).swapaxes(0, 1)
    out_knc = jax.lax.map(jax.checkpoint(lambda xs: logprobs(*xs)), (h_knc, t_knc))
    return out_knc.swapaxes(0, 1).reshape(n, R + pad)[:, :R]
