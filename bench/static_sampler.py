"""The static-batch KV-cache sampler, frozen here as a benchmark contender: prefill + `lax.while_loop`
decode over one padded batch.

What `marljax.sampling.generate` was before the rollout engine; it left the package when the engine became
its one sampler (issue #47) and stays here, unchanged but for reading public marljax names only, as the
"static" contender of bench/rollout.py, "before" of bench/rollout_step.py and a profile of
bench/profile_ops.py. Its dense KV cache (`init_cache`, read and written through the decoder's
`cache_attention` hook `dense_cache_attention`) is the cache bench/decode_roof.py and bench/lora_rows.py
time a decode step over.

Prompts are right-padded into one [B, P] block and every row writes its KV cache at columns equal to its
own positions, so a prompt's output does not depend on what else is in the batch; every row decodes until
the longest one ends, over a [B, P + max_new] cache. Shapes are bucketed (`bucket_rows` for the batch,
powers of two for the prompt length). One random draw per step for the whole batch (so seeded samples
differ from the engine's per-request streams; greedy ones are the same). Shape suffixes: the legend in
marljax/models/decoder.py.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from marljax.core.shapes import bucket, bucket_rows
from marljax.core.sharding import replicate
from marljax.models.attention import attention
from marljax.models.decoder import Decoder, ModelConfig
from marljax.sampling.engine.draw import SampleOutput, SamplingParams, choose, logprob_of
from marljax.sampling.engine.paged_attention import init_dense, write_dense


def init_cache(config: ModelConfig, batch: int, length: int, dtype=None) -> list[dict[str, Any]]:
    """Zeroed dense KV cache, per layer {"k": [B, K, D, S], "v": [B, K, S, D]} (the forms `attention` reads
    in place), S = `length` columns; sharded on a mesh."""
    return init_dense(config, batch, length, dtype or config.jnp_dtype)


def dense_cache_attention(q_bthd, k_btkd, v_btkd, kv, positions_bt):
    """The decoder's `cache_attention` hook over one layer's dense cache: row b's new keys and values go to
    columns positions_bt[b] (column = position, so right-padded prompts need no extra mask), then every
    query attends the columns ≤ its own position."""
    kv = write_dense(kv, k_btkd, v_btkd, positions_bt)
    mask_bts = jnp.arange(kv["v"].shape[2], dtype=jnp.int32)[None, None, :] <= positions_bt[:, :, None]
    return attention(q_bthd, kv["k"], kv["v"], mask_bts), kv


def generate_static(model: Decoder, prompts: list[list[int]], params: SamplingParams, *, lora=None,
                    lora_scale: float = 1.0, layers: list[dict] | None = None) -> SampleOutput:
    """Sample a continuation of every prompt in one static batch; see the module docstring.

    The decode loop reads per-layer weights (`layer_weights`); without `layers` they are sliced out of
    the stacked parameters on every call (one copy of the weights). Callers that sample repeatedly
    from the same weights make them once and pass them.
    """
    if not prompts:
        return SampleOutput([], [], [])
    if any(len(p) == 0 for p in prompts):
        raise ValueError("generate() got an empty prompt; every prompt needs at least one token.")
    lengths = [len(p) for p in prompts]
    max_pos = max(lengths) + params.max_new_tokens
    if max_pos > model.config.max_position:
        raise ValueError(f"prompt ({max(lengths)} tokens) + max_new_tokens ({params.max_new_tokens}) "
                         f"exceeds the model's max_position {model.config.max_position}.")
    B, P = bucket_rows(len(prompts)), bucket(max(lengths), 16)
    tokens_bp = np.zeros((B, P), np.int32)
    for i, p in enumerate(prompts):
        tokens_bp[i, : len(p)] = p
    lengths_b = np.ones((B,), np.int32)
    lengths_b[: len(prompts)] = lengths
    live_b = np.arange(B) < len(prompts)
    graphdef, state = nnx.split(model)
    stops = tuple(sorted(set(params.stop_token_ids))) or (-1,)
    out_tokens, out_logprobs, n_out, finished = _sample(
        graphdef, state, layers, lora, jnp.asarray(tokens_bp), jnp.asarray(lengths_b), jnp.asarray(live_b),
        jax.random.key(params.seed), jnp.float32(lora_scale),
        max_new=params.max_new_tokens, temperature=float(params.temperature),
        top_p=float(params.top_p), top_k=int(params.top_k), stops=stops)
    out_tokens, out_logprobs = np.asarray(out_tokens), np.asarray(out_logprobs)
    n_out, finished = np.asarray(n_out), np.asarray(finished)
    n = len(prompts)
    return SampleOutput(
        tokens=[out_tokens[i, : n_out[i]].tolist() for i in range(n)],
        logprobs=[out_logprobs[i, : n_out[i]].tolist() for i in range(n)],
        finished=[bool(finished[i]) for i in range(n)])


@struct.dataclass
class DecodeState:
    """The decode loop's carry: the step to write next and, per row, what was generated so far."""

    step: jax.Array  # int32 []: the output column the next token goes to
    tokens: jax.Array  # int32 [B, max_new]: generated ids (0 after a row is done)
    logprobs: jax.Array  # float32 [B, max_new]: their logprobs
    n_out: jax.Array  # int32 [B]: tokens generated per row
    done: jax.Array  # bool [B]: a stop token was hit, or a padding row
    hit: jax.Array  # bool [B]: a stop token was hit
    cache: Any  # the KV cache (`init_cache`)
    last: jax.Array  # int32 [B]: the token generated last, the next step's input


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("max_new", "temperature", "top_p", "top_k", "stops"))
def _sample(graphdef, state, layers, lora, tokens_bp, lengths_b, live_b, key, lora_scale, *, max_new,
            temperature, top_p, top_k, stops):
    model = nnx.merge(graphdef, state)
    B, P = tokens_bp.shape
    cache = init_cache(model.config, B, P + max_new)
    stop_ids = jnp.asarray(stops, jnp.int32)
    hidden = functools.partial(model.hidden, cache_attention=dense_cache_attention, lora=lora, lora_scale=lora_scale)

    def pick(h_be, step, key):
        logits_bv = model.logits(h_be)
        tok_b = choose(logits_bv, jax.random.fold_in(key, step), temperature, top_p, top_k)
        return tok_b, logprob_of(logits_bv, tok_b, temperature)

    if layers is None:
        layers = model.layer_list()  # sliced once here, not on every decode step
    h_bpe, cache = hidden(tokens_bp, cache=cache, layers=layers)
    last_be = jnp.take_along_axis(h_bpe, (lengths_b - 1)[:, None, None], axis=1)[:, 0]
    tok_b, logp_b = pick(last_be, 0, key)
    hit_b = jnp.isin(tok_b, stop_ids)
    start = DecodeState(
        step=jnp.int32(1), tokens=jnp.zeros((B, max_new), jnp.int32).at[:, 0].set(tok_b),
        logprobs=jnp.zeros((B, max_new), jnp.float32).at[:, 0].set(logp_b), n_out=jnp.where(live_b, 1, 0),
        done=~live_b | hit_b, hit=hit_b, cache=cache, last=tok_b)

    def cond(s: DecodeState):
        return (s.step < max_new) & ~jnp.all(s.done)

    def body(s: DecodeState) -> DecodeState:
        pos_b1 = (lengths_b + s.step - 1)[:, None]
        h, cache = hidden(s.last[:, None], pos_b1, cache=s.cache, layers=layers)
        new_tok, new_logp = pick(h[:, 0], s.step, key)
        new_tok = jnp.where(s.done, 0, new_tok)
        new_hit = ~s.done & jnp.isin(new_tok, stop_ids)
        return DecodeState(step=s.step + 1, tokens=s.tokens.at[:, s.step].set(new_tok),
                           logprobs=s.logprobs.at[:, s.step].set(jnp.where(s.done, 0.0, new_logp)),
                           n_out=s.n_out + jnp.where(s.done, 0, 1), done=s.done | new_hit, hit=s.hit | new_hit,
                           cache=cache, last=new_tok)

    end = jax.lax.while_loop(cond, body, start)
    return replicate((end.tokens, end.logprobs, end.n_out, end.hit))  # readable on every host of a mesh
