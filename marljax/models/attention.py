"""Attention for the uncached pass (training and scoring): the dense kernel, and kernels that never
materialise T×T scores.

`causal_attention` is the one entry, chosen by `ATTENTIONS` name:
  dense      `attention` (keys [B, K, D, S], values [B, K, S, D]) over a [B, T, T] mask (the CPU's fastest
             at short T; its float32 scores and probabilities are B·H·T² each); the rollout engine reads
             its pages through the same `attention` (`marljax.sampling.engine.paged_attention`)
  blockwise  query-chunk × key-chunk online softmax (flash-style) in pure JAX, with a custom VJP that
             recomputes the scores chunk by chunk: memory linear in T, forward and backward; chunk
             pairs with no visible key are skipped (the causal upper half)
  cudnn      `jax.nn.dot_product_attention`: cuDNN flash on a GPU for bfloat16/float16, else its XLA
             implementation
  splash     Pallas splash attention (TPU; elsewhere in Pallas interpret mode, slow: for tests)
  auto       by backend, dtype and length (`resolve_attention`)
The mask is the decoder's: query t sees key s iff positions[s] ≤ positions[t] and kv_mask[s]. Rows
that see no key at all give 0 (dense gives the mean of all values there: both are padding).
Shapes: q [B, T, H, D], k and v [B, T, K, D], H = K·G (grouped-query), positions [B, T] (the letters:
the legend in marljax/models/decoder.py).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from marljax.models.precision import dot_f32

ATTENTIONS = ("auto", "dense", "blockwise", "cudnn", "splash")
# `auto` on CPU: dense up to this length, blockwise above (measured in docs/scale_out.md).
DENSE_MAX_LENGTH = 512
BLOCK = 128  # query and key chunk length of `blockwise` (measured on CPU, docs/scale_out.md)


def check_attention(name: str) -> str:
    """`name` if it is one of `ATTENTIONS`, else a ValueError naming the choices."""
    if name not in ATTENTIONS:
        raise ValueError(f"rl.attention={name!r} is not an attention implementation; choose from "
                         f"{ATTENTIONS} (auto picks by backend and sequence length).")
    return name


def target_backend() -> str:
    """The platform the code being traced will run on: the devices of the mesh set by `jax.set_mesh`
    (an ahead-of-time compile for a TPU topology traces on a CPU host), else JAX's default backend."""
    device = jax.sharding.get_abstract_mesh().abstract_device
    return jax.default_backend() if device is None else device.platform


def resolve_attention(name: str, length: int, dtype, backend: str | None = None) -> str:
    """The implementation `name` runs as for sequences of `length` tokens of `dtype` on `backend`
    (default: `target_backend()`): `auto` takes splash on a TPU, cuDNN on a GPU for half precision,
    else dense up to `DENSE_MAX_LENGTH` tokens and blockwise above."""
    if check_attention(name) != "auto":
        return name
    backend = backend or target_backend()
    if backend == "tpu":
        return "splash"
    if backend == "gpu" and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16):
        return "cudnn"
    return "dense" if length <= DENSE_MAX_LENGTH else "blockwise"


def causal_attention(q_bthd, k_btkd, v_btkd, positions_bt, kv_mask_bt, impl: str):
    """Masked grouped-query attention [B, T, H, D] by implementation `impl` (not `auto`: resolve it
    first). `kv_mask_bt` (or None) marks real keys; `cudnn` and `splash` read it as right padding
    (a prefix of ones per row) and the positions as increasing along each row."""
    if impl == "dense":
        mask_btt = positions_bt[:, None, :] <= positions_bt[:, :, None]
        if kv_mask_bt is not None:
            mask_btt = mask_btt & kv_mask_bt[:, None, :]
        return attention(q_bthd, k_btkd.transpose(0, 2, 3, 1), v_btkd.transpose(0, 2, 1, 3), mask_btt)
    if impl == "blockwise":
        kv_mask_bt = jnp.ones(positions_bt.shape, bool) if kv_mask_bt is None else kv_mask_bt
        return blockwise_attention(q_bthd, k_btkd, v_btkd, positions_bt, kv_mask_bt)
    if impl == "cudnn":
        return cudnn_attention(q_bthd, k_btkd, v_btkd, kv_mask_bt)
    if impl == "splash":
        return splash_attention(q_bthd, k_btkd, v_btkd, kv_mask_bt)
    raise ValueError(f"attention implementation {impl!r}; choose from {ATTENTIONS[1:]} "
                     "(resolve 'auto' with resolve_attention first).")


# ---- dense -------------------------------------------------------------------------------------
# Keys [B, K, D, S] and values [B, K, S, D] (the dense kernel's one layout): each (b, k) is one
# [G·T, D] @ [D, S] and one [G·T, S] @ [S, D] matmul, the forms XLA CPU runs fastest, in the uncached pass
# (0.94 vs 1.0 of the LoRA step time with remat=full against keys [B, K, S, D]) and in decode (T = 1: 30
# layers at 128 rows × 432 columns, 171 vs 282 ms per step; docs/benchmarks.md "Decode KV layout").
SCORES_SPEC, OUT_SPEC = "bkgtd,bkds->bkgts", "bkgts,bksd->bkgtd"


def attention(q_bthd, k_bkds, v_bksd, mask_bts):
    """Grouped-query softmax attention with a boolean mask; softmax in float32."""
    return segmented_attention(q_bthd, [(k_bkds, v_bksd, mask_bts)])


def segmented_attention(q_bthd, segments):
    """`attention` over key/value segments [(k [B, K, D, S], v [B, K, S, D], mask_bts), …] (each with its
    own mask and length S) as if concatenated along their positions, without concatenating them: one
    softmax over all the segments' scores, the value products summed. The rollout engine's decode chunk
    attends a read-only dense cache and the chunk's own new keys as two segments, so a step writes a small
    buffer, not the cache (`marljax.sampling.engine.paged_attention.chunk_cache_attention`)."""
    B, T, H, D = q_bthd.shape
    K = segments[0][0].shape[1]
    q = q_bthd.reshape(B, T, K, H // K, D).transpose(0, 2, 3, 1, 4)
    scores = []
    for k, _, mask_bts in segments:
        s = dot_f32(SCORES_SPEC, q, k) * (D ** -0.5)  # float32; its backward in the compute dtype
        # A finite floor (not -inf) keeps fully masked padding rows NaN-free in value and gradient.
        scores.append(jnp.where(mask_bts[:, None, None], s, jnp.finfo(jnp.float32).min))
    probs = jax.nn.softmax(jnp.concatenate(scores, axis=-1) if len(scores) > 1 else scores[0], axis=-1)
    ends = np.cumsum([s.shape[-1] for s in scores])
    out = None
    for (_, v, _), start, end in zip(segments, [0, *ends[:-1]], ends):
        o = dot_f32(OUT_SPEC, probs[..., start:end].astype(v.dtype), v)
        out = o if out is None else out + o
    out = out.astype(segments[0][1].dtype)  # rounded once (models/precision.py)
    return out.transpose(0, 3, 1, 2, 4).reshape(B, T, H, D)


# ---- cuDNN (GPU) -------------------------------------------------------------------------------
def cudnn_attention(q_bthd, k_btkd, v_btkd, kv_mask_bt=None):
    """`jax.nn.dot_product_attention`, causal by index; right padding as key lengths. cuDNN's flash
    kernel on a GPU for half precision (it takes no float32), XLA's implementation otherwise."""
    half = q_bthd.dtype in (jnp.bfloat16, jnp.float16)
    impl = "cudnn" if target_backend() == "gpu" and half else "xla"
    lengths = None if kv_mask_bt is None else jnp.sum(kv_mask_bt, axis=1, dtype=jnp.int32)
    return jax.nn.dot_product_attention(q_bthd, k_btkd, v_btkd, is_causal=True,
                                        key_value_seq_lengths=lengths, implementation=impl)


# ---- splash (TPU) -------------------------------------------------------------------------------
SPLASH_BLOCK = 128  # the TPU kernel's tile; T is padded to a multiple


def splash_attention(q_bthd, k_btkd, v_btkd, kv_mask_bt=None, *, interpret: bool | None = None):
    """Pallas splash attention, causal by index; right padding as segment ids (padding keys are
    segment 0, unseen by real queries). One multi-query kernel per (row, KV head) over its G query
    heads. `interpret` (default: unless `target_backend()` is a TPU) runs the kernel in Pallas'
    interpreter. On a mesh (`sharding.use_mesh`) the kernel runs per shard: rows split like the
    batch, heads like `act_heads` when the KV heads split the same way (else heads replicated)."""
    from marljax.core import sharding

    real_bt = jnp.ones(q_bthd.shape[:2], bool) if kv_mask_bt is None else kv_mask_bt
    interpret = target_backend() != "tpu" if interpret is None else interpret
    heads = "act_heads"
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and "tensor" in mesh.axis_names and mesh.shape["tensor"] > 1 and (
            k_btkd.shape[2] % mesh.shape["tensor"]):
        heads = None  # fewer KV heads than tensor ranks: every shard takes all heads
    qkv_axes = ("batch", "length", heads, "head_dim")
    return sharding.shard_map_logical(functools.partial(_splash, interpret=interpret),
                                      (q_bthd, k_btkd, v_btkd, real_bt),
                                      (qkv_axes, qkv_axes, qkv_axes, ("batch", "length")), qkv_axes)


def _splash(q_bthd, k_btkd, v_btkd, real_bt, *, interpret: bool):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    B, T, H, D = q_bthd.shape
    K, G = k_btkd.shape[2], H // k_btkd.shape[2]
    pad = -T % SPLASH_BLOCK
    Tp = T + pad
    b = SPLASH_BLOCK
    blocks = splash.BlockSizes(block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b, block_kv_dkv=b,
                               block_kv_dkv_compute=b, block_q_dq=b, block_kv_dq=b)
    kernel = splash.make_splash_mqa_single_device(masks.MultiHeadMask([masks.CausalMask((Tp, Tp))] * G),
                                                  block_sizes=blocks, interpret=interpret)
    segment_bt = jnp.pad(real_bt, ((0, 0), (0, pad))).astype(jnp.int32)
    along_t = ((0, 0), (0, pad), (0, 0), (0, 0))
    q = jnp.pad(q_bthd * jnp.asarray(D ** -0.5, q_bthd.dtype), along_t)  # the kernel does not scale
    q = q.reshape(B, Tp, K, G, D).transpose(0, 2, 3, 1, 4)  # [B, K, G, T, D]
    k, v = (jnp.pad(x, along_t).transpose(0, 2, 1, 3) for x in (k_btkd, v_btkd))  # [B, K, T, D]
    per_row = jax.vmap(kernel, in_axes=(0, 0, 0, None))  # over KV heads
    out = jax.vmap(per_row)(q, k, v, splash.SegmentIds(q=segment_bt, kv=segment_bt))
    return out.transpose(0, 3, 1, 2, 4).reshape(B, Tp, H, D)[:, :T]


# ---- blockwise ---------------------------------------------------------------------------------
def blockwise_attention(q_bthd, k_btkd, v_btkd, positions_bt, kv_mask_bt, block: int = BLOCK):
    """The blockwise implementation (see the module docstring); T need not be a multiple of `block`."""
    B, T, H, D = q_bthd.shape
    K = k_btkd.shape[2]
    c = min(block, T)
    pad = -T % c

    def padded(x, value=0):  # along T, to whole chunks
        return jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), constant_values=value)

    # [B, K, G, T, D] queries and [B, K, T, D] keys/values: one (b, k) matmul of G·c rows per chunk
    q = padded(q_bthd).reshape(B, T + pad, K, H // K, D).transpose(0, 2, 3, 1, 4)
    k, v = (padded(x).transpose(0, 2, 1, 3) for x in (k_btkd, v_btkd))
    qpos_bt = padded(positions_bt, -1)  # padded queries see nothing
    kpos_bt = jnp.where(padded(kv_mask_bt, False), padded(positions_bt), jnp.iinfo(jnp.int32).max)
    out = _flash(q, k, v, qpos_bt.astype(jnp.int32), kpos_bt.astype(jnp.int32), c)
    return out.transpose(0, 3, 1, 2, 4).reshape(B, T + pad, H, D)[:, :T]


def _chunk(x, i, c, axis):
    return jax.lax.dynamic_slice_in_dim(x, i * c, c, axis)


def _visible(qpos_bt, kpos_bt, i, j, c):
    """[B, 1, 1, c, c] mask of query chunk i × key chunk j (masked keys carry the int32 maximum)."""
    return (_chunk(kpos_bt, j, c, 1)[:, None, :] <= _chunk(qpos_bt, i, c, 1)[:, :, None])[:, None, None]


def _needed(qpos_bt, kpos_bt, c):
    """[nq, nk] bool: chunk pairs with at least one visible key (the others are skipped)."""
    B, T = qpos_bt.shape
    qmax_bn = qpos_bt.reshape(B, T // c, c).max(-1)
    kmin_bn = kpos_bt.reshape(B, T // c, c).min(-1)
    return jnp.any(kmin_bn[:, None, :] <= qmax_bn[:, :, None], axis=0)


def _scores(q_i, k_j):
    scale = q_i.shape[-1] ** -0.5
    return jnp.einsum("bkgqd,bksd->bkgqs", q_i, k_j, preferred_element_type=jnp.float32) * scale


def _loop(n: int, body, carry):
    """carry = body(i, carry) for i = 0 … n − 1, as a while loop. Inside a differentiated `lax.scan`
    (the decoder's layers) JAX linearises even a custom VJP's forward pass, and a `fori_loop` (a scan)
    would then stack every chunk pair's scores as residuals: T² memory. A while loop keeps none."""
    return jax.lax.while_loop(lambda ic: ic[0] < n, lambda ic: (ic[0] + 1, body(*ic)),
                              (jnp.int32(0), carry))[1]


def _forward(q, k, v, qpos_bt, kpos_bt, c):
    """Output [B, K, G, T, D] and log-sum-exp [B, K, G, T] (+inf on rows that see no key)."""
    need = _needed(qpos_bt, kpos_bt, c)
    n = q.shape[3] // c

    def query_chunk(i, out_lse):
        q_i = _chunk(q, i, c, 3)

        def visit(j, carry):
            m, l, acc = carry
            vis = _visible(qpos_bt, kpos_bt, i, j, c)
            s = jnp.where(vis, _scores(q_i, _chunk(k, j, c, 2)), -jnp.inf)
            m_new = jnp.maximum(m, s.max(-1))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            p = jnp.exp(s - m_safe[..., None])
            alpha = jnp.exp(m - m_safe)
            pv = jnp.einsum("bkgqs,bksd->bkgqd", p.astype(v.dtype), _chunk(v, j, c, 2),
                            preferred_element_type=jnp.float32)
            return m_new, l * alpha + p.sum(-1), acc * alpha[..., None] + pv

        def step(j, carry):
            return jax.lax.cond(need[i, j], visit, lambda j, carry: carry, j, carry)

        init = (jnp.full(q_i.shape[:-1], -jnp.inf), jnp.zeros(q_i.shape[:-1]),
                jnp.zeros(q_i.shape, jnp.float32))
        m, l, acc = _loop(n, step, init)
        l_safe = jnp.where(l > 0, l, 1.0)
        out_i = jnp.where(l[..., None] > 0, acc / l_safe[..., None], 0.0).astype(q.dtype)
        lse_i = jnp.where(l > 0, m + jnp.log(l_safe), jnp.inf)
        return tuple(jax.lax.dynamic_update_slice_in_dim(a, a_i, i * c, 3)
                     for a, a_i in zip(out_lse, (out_i, lse_i)))

    return _loop(n, query_chunk, (jnp.zeros(q.shape, q.dtype), jnp.zeros(q.shape[:-1], jnp.float32)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _flash(q, k, v, qpos_bt, kpos_bt, c):
    return _forward(q, k, v, qpos_bt, kpos_bt, c)[0]


def _flash_fwd(q, k, v, qpos_bt, kpos_bt, c):
    out, lse = _forward(q, k, v, qpos_bt, kpos_bt, c)
    return out, (q, k, v, qpos_bt, kpos_bt, out, lse)


def _flash_bwd(c, res, dout):
    """FlashAttention-2's backward: per key chunk, its dk, dv over the query chunks that see it, and
    each query chunk's share of dq, from probabilities recomputed with the saved log-sum-exp."""
    q, k, v, qpos_bt, kpos_bt, out, lse = res
    need = _needed(qpos_bt, kpos_bt, c)
    n = q.shape[3] // c
    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # [B, K, G, T]
    scale = q.shape[-1] ** -0.5

    def key_chunk(j, grads):
        dq, dk, dv = grads
        k_j, v_j = _chunk(k, j, c, 2), _chunk(v, j, c, 2)

        def visit(i, carry):
            dq, dk_j, dv_j = carry
            q_i, do_i = _chunk(q, i, c, 3), _chunk(dout, i, c, 3)
            vis = _visible(qpos_bt, kpos_bt, i, j, c)
            p = jnp.where(vis, jnp.exp(_scores(q_i, k_j) - _chunk(lse, i, c, 3)[..., None]), 0.0)
            dv_j += jnp.einsum("bkgqs,bkgqd->bksd", p.astype(do_i.dtype), do_i,
                               preferred_element_type=jnp.float32)
            dp = jnp.einsum("bkgqd,bksd->bkgqs", do_i, v_j, preferred_element_type=jnp.float32)
            ds = p * (dp - _chunk(delta, i, c, 3)[..., None]) * scale
            dq_i = jnp.einsum("bkgqs,bksd->bkgqd", ds.astype(k_j.dtype), k_j,
                              preferred_element_type=jnp.float32)
            dq = jax.lax.dynamic_update_slice_in_dim(dq, _chunk(dq, i, c, 3) + dq_i, i * c, 3)
            dk_j += jnp.einsum("bkgqs,bkgqd->bksd", ds.astype(q_i.dtype), q_i,
                               preferred_element_type=jnp.float32)
            return dq, dk_j, dv_j

        def step(i, carry):
            return jax.lax.cond(need[i, j], visit, lambda i, carry: carry, i, carry)

        zeros = jnp.zeros(k_j.shape, jnp.float32)
        dq, dk_j, dv_j = _loop(n, step, (dq, zeros, zeros))
        return (dq, jax.lax.dynamic_update_slice_in_dim(dk, dk_j.astype(k.dtype), j * c, 2),
                jax.lax.dynamic_update_slice_in_dim(dv, dv_j.astype(v.dtype), j * c, 2))

    dq, dk, dv = _loop(n, key_chunk, (jnp.zeros(q.shape, jnp.float32), jnp.zeros_like(k),
                                      jnp.zeros_like(v)))
    return dq.astype(q.dtype), dk, dv, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)
