"""`attention.attention` in both kv layouts against a float64 numpy attention: value and gradient."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marljax.models.attention import ATTENTION_LAYOUTS, attention

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
    dk = np.einsum("bhts,bthd->bshd", ds, q).reshape(B, T, K, G, DH).sum(3)
    dv = np.einsum("bhts,bthd->bshd", p, w).reshape(B, T, K, G, DH).sum(3)
    return out, (dq, dk, dv)


# keys/values [B, S, K, Dh] -> the layout's [B, K, S, Dh] or [B, K, Dh, S]
TO_LAYOUT = {"bksd": (0, 2, 1, 3), "bkds": (0, 2, 3, 1)}


@pytest.mark.parametrize("layout", sorted(ATTENTION_LAYOUTS))
def test_attention_layouts_match_float64(layout):
    rng = np.random.default_rng(0)
    q, w = rng.normal(size=(2, B, T, H, DH))
    k, v = rng.normal(size=(2, B, T, K, DH))
    mask = np.tril(np.ones((T, T), bool))[None].repeat(B, 0)
    mask[1, :, 5:] = False  # padded keys in row 1
    out_ref, grads_ref = reference(q, k, v, mask, w)
    k_spec, v_spec = (spec.split(",")[1].split("-")[0] for spec in ATTENTION_LAYOUTS[layout])

    def loss(q, k, v):
        k_l, v_l = k.transpose(TO_LAYOUT[k_spec]), v.transpose(TO_LAYOUT[v_spec])
        out = attention(q, k_l, v_l, jnp.asarray(mask), layout)
        return jnp.sum(out * w), out

    f32 = [jnp.asarray(x, jnp.float32) for x in (q, k, v)]
    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(*f32)
    # float32 against float64 on values of size ≤ 5.2: observed max error 2.7e-7 (value) and 5.4e-7
    # (gradient), a few float32 ulps; 1e-5 leaves room for other backends' summation orders while a
    # wrong layout or transpose (errors of order 1) still fails.
    np.testing.assert_allclose(out, out_ref, rtol=0, atol=1e-5)
    for name, g, g_ref in zip("qkv", grads, grads_ref):
        np.testing.assert_allclose(g, g_ref, rtol=0, atol=1e-5, err_msg=f"d{name} ({layout})")
