"""Attention kernels (`marljax.models.attention`) against a float64 numpy attention and each other, value
and gradient: the dense kernel, the blockwise, cuDNN/XLA and splash (interpret) entries; `auto`'s choice, the
config key, the decoder's uncached pass, and the blockwise backward's memory (linear in T)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from marljax.config import DEMO_CONFIG, load_config
from marljax.models.attention import (DENSE_MAX_LENGTH, _needed, attention, blockwise_attention, causal_attention,
                                      resolve_attention, segmented_attention)
from marljax.models.decoder import Decoder
from marljax.models.presets import PRESETS
from marljax.rl.step import StepConfig

B, T, H, K, DH = 2, 7, 6, 2, 8


def reference(q, k, v, mask, w):
    """Float64 grouped-query attention (k, v as [B, S, K, Dh]), and the gradient of sum(out · w)."""
    G = H // K
    kh, vh = np.repeat(k, G, axis=2), np.repeat(v, G, axis=2)  # [B, S, H, Dh]
    s = np.einsum("bthd,bshd->bhts", q, kh) / np.sqrt(DH)
    s = np.where(mask[:, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = np.einsum("bhts,bshd->bthd", p, vh)
    dp = np.einsum("bthd,bshd->bhts", w, vh)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True)) / np.sqrt(DH)
    dq = np.einsum("bhts,bshd->bthd", ds, kh)
    S = k.shape[1]
    dk = np.einsum("bhts,bthd->bshd", ds, q).reshape(B, S, K, G, DH).sum(3)
    dv = np.einsum("bhts,bthd->bshd", p, w).reshape(B, S, K, G, DH).sum(3)
    return out, (dq, dk, dv)


# keys/values [B, S, K, Dh] -> the dense kernel's keys [B, K, Dh, S] and values [B, K, S, Dh]
KEYS, VALUES = (0, 2, 3, 1), (0, 2, 1, 3)


def test_attention_matches_float64():
    rng = np.random.default_rng(0)
    q, w = rng.normal(size=(2, B, T, H, DH))
    k, v = rng.normal(size=(2, B, T, K, DH))
    mask = np.tril(np.ones((T, T), bool))[None].repeat(B, 0)
    mask[1, :, 5:] = False  # padded keys in row 1
    out_ref, grads_ref = reference(q, k, v, mask, w)

    def loss(q, k, v):
        out = attention(q, k.transpose(KEYS), v.transpose(VALUES), jnp.asarray(mask))
        return jnp.sum(out * w), out

    f32 = [jnp.asarray(x, jnp.float32) for x in (q, k, v)]
    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(*f32)
    # float32 against float64 on values of size ≤ 5.2: observed max error 2.7e-7 (value) and 5.4e-7
    # (gradient), a few float32 ulps; 1e-5 leaves room for other backends' summation orders while a
    # wrong layout or transpose (errors of order 1) still fails.
    np.testing.assert_allclose(out, out_ref, rtol=0, atol=1e-5)
    for name, g, g_ref in zip("qkv", grads, grads_ref):
        np.testing.assert_allclose(g, g_ref, rtol=0, atol=1e-5, err_msg=f"d{name}")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_segmented_attention_equals_attention_over_the_concatenated_keys(dtype):
    """Keys and values split at column 4 into two segments with their own masks (the rollout engine's
    dense cache and chunk buffer): the float64 attention over the whole, and in bfloat16 the one-segment
    `attention` over the concatenation (one softmax: the segments must not be normalised apart)."""
    rng = np.random.default_rng(1)
    q, w = rng.normal(size=(2, B, T, H, DH))
    k, v = rng.normal(size=(2, B, T, K, DH))
    mask = np.tril(np.ones((T, T), bool))[None].repeat(B, 0)
    mask[1, :, 2:4] = False  # a hole in row 1's first segment
    dt = jnp.dtype(dtype)
    k_l = jnp.asarray(k.transpose(KEYS), dt)
    v_l = jnp.asarray(v.transpose(VALUES), dt)
    segments = [(k_l[..., part], v_l[:, :, part], jnp.asarray(mask[..., part])) for part in (slice(0, 4), slice(4, T))]
    q_l = jnp.asarray(q, dt)
    out = jax.jit(segmented_attention)(q_l, segments)
    whole = jax.jit(attention)(q_l, k_l, v_l, jnp.asarray(mask))
    if dtype == "float32":  # as test_attention_matches_float64: a few ulps observed, 1e-5 allowed
        np.testing.assert_allclose(out, reference(q, k, v, mask, w)[0], rtol=0, atol=1e-5)
        np.testing.assert_allclose(out, whole, rtol=0, atol=1e-6)
    else:  # the same rounded probabilities, the value products summed in float32 in another order, rounded
        # once: at most one bfloat16 ulp apart (2^-7 relative at |out| < 2: 1.6e-2)
        np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(whole, np.float32), rtol=0, atol=1.6e-2)
        assert np.mean(np.asarray(out) == np.asarray(whole)) > 0.95


# ---- the uncached entry: blockwise and cuDNN/XLA against float64 and dense --------------------------
def _inputs(T, seed=0):
    rng = np.random.default_rng(seed)
    q, w = rng.normal(size=(2, B, T, H, DH))
    k, v = rng.normal(size=(2, B, T, K, DH))
    return q, k, v, w


def _run(fn, q, k, v, w):
    def loss(q, k, v):
        out = fn(q, k, v)
        return jnp.sum(out * w), out
    f32 = [jnp.asarray(x, jnp.float32) for x in (q, k, v)]
    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(*f32)
    return out, grads


@pytest.mark.parametrize("T, block", [(7, 4), (16, 4), (37, 8), (9, 16)])  # T a multiple or not; one chunk
def test_blockwise_matches_float64_and_dense(T, block):
    """Causal + right padding (row 1's last 3 keys), grouped queries; value and gradient."""
    q, k, v, w = _inputs(T)
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    kv_mask = np.ones((B, T), bool)
    kv_mask[1, T - 3:] = False
    mask = np.tril(np.ones((T, T), bool))[None] & kv_mask[:, None, :]
    out_ref, grads_ref = reference(q, k, v, mask, w)
    out, grads = _run(lambda q, k, v: blockwise_attention(q, k, v, pos, jnp.asarray(kv_mask), block), q, k, v, w)
    out_d, grads_d = _run(lambda q, k, v: causal_attention(q, k, v, pos, jnp.asarray(kv_mask), "dense"), q, k, v, w)
    # float32 vs float64: observed ≤ 1e-6 on values ≤ 5 (value and gradient); a wrong mask or chunk is O(1)
    np.testing.assert_allclose(out, out_ref, rtol=0, atol=1e-5)
    np.testing.assert_allclose(out, out_d, rtol=0, atol=1e-5)
    for name, g, g_ref, g_d in zip("qkv", grads, grads_ref, grads_d):
        np.testing.assert_allclose(g, g_ref, rtol=0, atol=1e-5, err_msg=f"d{name} T={T}")
        np.testing.assert_allclose(g, g_d, rtol=0, atol=1e-5, err_msg=f"d{name} T={T} vs dense")


def test_blockwise_general_positions_and_unseeing_rows():
    """The mask comes from positions (here per-row offsets and a repeated position), not from the index;
    a query that sees no key (its keys all padding) gives 0 and a zero gradient, never NaN."""
    T = 11
    q, k, v, w = _inputs(T, seed=1)
    pos = np.stack([np.arange(T) + 5, np.r_[0, 0, np.arange(1, T - 1)]]).astype(np.int32)
    kv_mask = np.ones((B, T), bool)
    kv_mask[0, :4] = False  # row 0's first 4 keys: its first 4 queries see nothing
    mask = (pos[:, None, :] <= pos[:, :, None]) & kv_mask[:, None, :]
    seeing = mask.any(-1)  # [B, T]
    # the reference's unseeing rows see every key instead (no 0/0) with a zero cotangent: they add nothing
    out_ref, grads_ref = reference(q, k, v, mask | ~seeing[:, :, None], w * seeing[:, :, None, None])
    out, grads = _run(lambda q, k, v: blockwise_attention(q, k, v, jnp.asarray(pos), jnp.asarray(kv_mask), 3),
                      q, k, v, w * seeing[:, :, None, None])
    np.testing.assert_allclose(np.asarray(out)[seeing], out_ref[seeing], rtol=0, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(out)[~seeing], 0.0)
    for name, g, g_ref in zip("qkv", grads, grads_ref):
        np.testing.assert_allclose(g, g_ref, rtol=0, atol=1e-5, err_msg=f"d{name}")


def test_blockwise_skips_the_causal_upper_half():
    pos = jnp.broadcast_to(jnp.arange(12, dtype=jnp.int32), (2, 12))
    np.testing.assert_array_equal(_needed(pos, pos, 4), np.tril(np.ones((3, 3), bool)))


def test_cudnn_entry_matches_float64():
    """`cudnn` (here: jax.nn.dot_product_attention's XLA implementation on CPU) with right padding."""
    T = 9
    q, k, v, w = _inputs(T, seed=2)
    lengths = np.array([T, 6])
    kv_mask = np.arange(T)[None] < lengths[:, None]
    mask = np.tril(np.ones((T, T), bool))[None] & kv_mask[:, None, :]
    out_ref, grads_ref = reference(q, k, v, mask, w)
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    out, grads = _run(lambda q, k, v: causal_attention(q, k, v, pos, jnp.asarray(kv_mask), "cudnn"), q, k, v, w)
    np.testing.assert_allclose(out, out_ref, rtol=0, atol=1e-5)
    for name, g, g_ref in zip("qkv", grads, grads_ref):
        np.testing.assert_allclose(g, g_ref, rtol=0, atol=1e-5, err_msg=f"d{name}")


def test_splash_matches_float64_in_interpret_mode():
    """`splash` (Pallas splash attention, in interpret mode off a TPU), T = 130 padded to 256, right padding
    in row 1; rows beyond a row's keys are padding (segment 0) and not compared."""
    T = 130
    q, k, v, w = _inputs(T, seed=4)
    kv_mask = np.ones((B, T), bool)
    kv_mask[1, 100:] = False
    w = w * kv_mask[:, :, None, None]
    mask = np.tril(np.ones((T, T), bool))[None] & kv_mask[:, None, :]
    out_ref, grads_ref = reference(q, k, v, mask | ~kv_mask[:, :, None], w)
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    out, grads = _run(lambda q, k, v: causal_attention(q, k, v, pos, jnp.asarray(kv_mask), "splash"), q, k, v, w)
    np.testing.assert_allclose(np.asarray(out)[kv_mask], out_ref[kv_mask], rtol=0, atol=1e-5)
    for name, g, g_ref in zip("qkv", grads, grads_ref):
        np.testing.assert_allclose(g, g_ref, rtol=0, atol=1e-5, err_msg=f"d{name}")


# ---- choosing, config, decoder --------------------------------------------------------------------
def test_auto_is_dense_for_short_sequences_on_cpu():
    """The default run (configs/default.yaml: ≤ 32-token responses, prompts ≤ ~250 tokens, T ≤ 320) keeps
    today's dense kernel; long sequences go blockwise; half precision on a GPU goes to cuDNN."""
    cfg = load_config(str(DEMO_CONFIG))
    assert cfg.rl.attention == "auto"
    assert resolve_attention(cfg.rl.attention, 320, jnp.float32, "cpu") == "dense"
    assert resolve_attention("auto", DENSE_MAX_LENGTH, jnp.float32, "cpu") == "dense"
    assert resolve_attention("auto", DENSE_MAX_LENGTH + 1, jnp.float32, "cpu") == "blockwise"
    assert resolve_attention("auto", 4096, jnp.bfloat16, "gpu") == "cudnn"
    assert resolve_attention("auto", 4096, jnp.float32, "gpu") == "blockwise"
    assert resolve_attention("auto", 4096, jnp.float32, "tpu") == "splash"
    assert resolve_attention("dense", 1 << 16, jnp.float32, "cpu") == "dense"


def test_unknown_attention_is_refused():
    with pytest.raises(ValueError, match=r"rl.attention='flash'.*choose from .*blockwise"):
        StepConfig(route=(("solver", "shared"),), attention="flash")
    with pytest.raises(ValueError, match="resolve 'auto'"):
        causal_attention(*(jnp.zeros((1, 2, 2, 4)),) * 3, jnp.zeros((1, 2), jnp.int32), None, "auto")


def _tiny_decoder(layers=2):
    cfg = dataclasses.replace(PRESETS["tiny-qwen3"], vocab_size=256, num_layers=layers)
    return Decoder(cfg, rngs=nnx.Rngs(0))


def test_decoder_blockwise_equals_dense():
    """Logits and the gradient of the hidden states w.r.t. every parameter, T = 300 (3 chunks, padded)."""
    model = _tiny_decoder()
    graphdef, state = nnx.split(model)
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, 256, (2, 300)), jnp.int32)

    def run(impl):
        def loss(state):
            h, _ = nnx.merge(graphdef, state).hidden(tokens, remat="full", attention_impl=impl)
            return jnp.sum(jnp.sin(h)), h
        return jax.jit(jax.value_and_grad(loss, has_aux=True))(state)

    (_, h_b), g_b = run("blockwise")
    (_, h_d), g_d = run("dense")
    np.testing.assert_allclose(h_b, h_d, rtol=0, atol=1e-5)
    for a, b in zip(jax.tree.leaves(g_b), jax.tree.leaves(g_d)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * float(jnp.abs(b).max()))


def _temp_bytes(impl, T):
    graphdef, state = nnx.split(_tiny_decoder(1))
    grad = jax.jit(jax.grad(lambda s, t: jnp.sum(jnp.sin(
        nnx.merge(graphdef, s).hidden(t, remat="full", attention_impl=impl)[0]))))
    compiled = grad.lower(state, jax.ShapeDtypeStruct((1, T), jnp.int32)).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_blockwise_backward_memory_is_linear_in_length():
    """Compiled temp bytes of the decoder's gradient (layers under lax.scan + remat) at T and 2T: under
    2.25× for blockwise; dense, which holds T×T scores, more than triples."""
    T = 1024
    small, large = _temp_bytes("blockwise", T), _temp_bytes("blockwise", 2 * T)
    assert large < 2.25 * small, (small, large)
    dense_small, dense_large = _temp_bytes("dense", T // 2), _temp_bytes("dense", T)
    assert dense_large > 3 * dense_small, (dense_small, dense_large)
