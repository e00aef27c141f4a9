"""Losses against a float64 NumPy reference written per token with explicit branches.

JAX runs in float32 here: values are compared with rtol 1e-5, atol 1e-6.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marljax.rl import losses as L
from marljax.rl.losses import LossConfig

TOL = dict(rtol=1e-5, atol=1e-6)
CFG = LossConfig()  # clip 0.2 / 0.28, dual clip 3.0, seq_mean_token_mean, k3


def ref_token_pg(logp, old, adv, low=0.2, high=0.28, c=3.0):
    """PPO dual-clip per token, written by cases: A>0 → −A·min(r, 1+high); A<0 → −A·min(max(r, 1−low), c)."""
    out = np.zeros_like(logp)
    for b, t in np.ndindex(logp.shape):
        r, a = np.exp(logp[b, t] - old[b, t]), adv[b]
        if a > 0:
            out[b, t] = -a * min(r, 1 + high)
        elif a < 0:
            out[b, t] = -a * (min(max(r, 1 - low), c) if c is not None else max(r, 1 - low))
    return out


def ref_k3(logp, ref):
    x = np.clip(ref - logp, -20, 20)
    return np.clip(np.exp(x) - x - 1, -10, 10)


def ref_aggregate(loss, mask, mode):
    rows = [b for b in range(loss.shape[0]) if mask[b].sum() > 0]
    if mode == "seq_mean_token_mean":
        return np.mean([(loss[b] * mask[b]).sum() / mask[b].sum() for b in rows])
    if mode == "seq_mean_token_sum":
        return np.mean([(loss[b] * mask[b]).sum() for b in rows])
    if mode == "token_mean":
        return (loss * mask).sum() / mask.sum()
    raise ValueError(mode)


def random_batch(seed=0, b=6, t=7):
    rng = np.random.default_rng(seed)
    old = rng.uniform(-3, -0.1, (b, t))
    logp = old + rng.normal(0, 0.8, (b, t))  # ratios ~0.1 to ~10: seed 0 hits every branch
    ref = old + rng.normal(0, 0.5, (b, t))
    adv = rng.normal(0, 1, b)
    lengths = rng.integers(1, t + 1, b)
    mask = (np.arange(t)[None] < lengths[:, None]).astype(np.float64)
    mask[-1] = 0  # one padding row
    return logp, old, ref, adv, mask


def f32(*xs):
    return [jnp.asarray(x, jnp.float32) for x in xs]


def test_branches_each_hit_with_exact_values_and_indicators():
    # tokens: (A, r) = (+1, 1.1) unclipped, (+1, 1.5) clip-high, (+1, 0.5) unclipped,
    #         (−1, 0.5) clip-low, (−1, 0.9) unclipped, (−1, 2.0) unclipped, (−1, 4.0) dual clip
    ratio = np.array([[1.1, 1.5, 0.5, 1.0], [0.5, 0.9, 2.0, 4.0]])
    adv = np.array([1.0, -1.0])
    mask = np.array([[1, 1, 1, 0], [1, 1, 1, 1]], float)
    old = np.full_like(ratio, -1.0)
    logp = old + np.log(ratio)
    pg_bt, ind = L.ppo_clip(*f32(logp, old, adv), CFG)
    expected = np.array([[-1.1, -1.28, -0.5, -1.0], [0.8, 0.9, 2.0, 3.0]])
    np.testing.assert_allclose(pg_bt, expected, **TOL)
    np.testing.assert_allclose(pg_bt, ref_token_pg(logp, old, adv), **TOL)
    assert np.asarray(ind["clip_frac_high"]).tolist() == [[False, True, False, False]] + [[False] * 4]
    assert np.asarray(ind["clip_frac_low"]).tolist() == [[False] * 4, [True, False, False, False]]
    assert np.asarray(ind["dual_clip_frac"]).tolist() == [[False] * 4, [False, False, False, True]]
    _, m = L.policy_loss(*f32(logp, old, adv, mask), CFG)
    np.testing.assert_allclose([m["clip_frac_high"], m["clip_frac_low"], m["clip_frac"], m["dual_clip_frac"]],
                               [1 / 7, 1 / 7, 2 / 7, 1 / 7], **TOL)
    no_dual, _ = L.ppo_clip(*f32(logp, old, adv), LossConfig(dual_clip=None))
    assert float(no_dual[1, 3]) == pytest.approx(4.0, rel=1e-6)


@pytest.mark.parametrize("mode", ["seq_mean_token_mean", "token_mean", "seq_mean_token_sum"])
def test_loss_matches_reference_for_each_aggregation(mode):
    logp, old, ref, adv, mask = random_batch()
    cfg = LossConfig(agg=mode)
    beta = np.array([0.0, 0.1, 0.5, 0.0, 1.0, 0.3])
    loss, m = L.policy_loss(*f32(logp, old, adv, mask), cfg, *f32(ref, beta))
    pg = ref_token_pg(logp, old, adv)
    kl = ref_k3(logp, ref)
    np.testing.assert_allclose(loss, ref_aggregate(pg + beta[:, None] * kl, mask, mode), **TOL)
    np.testing.assert_allclose(m["pg_loss"], ref_aggregate(pg, mask, mode), **TOL)
    np.testing.assert_allclose(m["kl_loss"], ref_aggregate(beta[:, None] * kl, mask, mode), **TOL)
    np.testing.assert_allclose(m["kl_ref"], (kl * mask).sum() / mask.sum(), **TOL)
    lr = logp - old
    np.testing.assert_allclose(m["ppo_kl"], (-lr * mask).sum() / mask.sum(), **TOL)
    np.testing.assert_allclose(m["approx_kl"], ((np.exp(lr) - 1 - lr) * mask).sum() / mask.sum(), **TOL)
    # every branch occurs in this batch (guards the reference comparison against a trivial batch)
    r, valid = np.exp(lr), mask > 0
    a = adv[:, None] * np.ones_like(r)
    for branch in [(a > 0) & (r > 1.28), (a < 0) & (r < 0.8), (a < 0) & (r > 3), (a > 0) & (r < 1.28)]:
        assert (branch & valid).any()


def test_aggregation_decomposes_over_sub_batches():
    """sum(seq_b)/denom of a mixed batch = per-role seq sums over the summed denominators (the trainer's contract)."""
    logp, old, _, adv, mask = random_batch(seed=1)
    for mode in ["seq_mean_token_mean", "token_mean", "seq_mean_token_sum"]:
        cfg = LossConfig(agg=mode)
        full, denom, _ = L.sequence_losses(*f32(logp, old, adv, mask), cfg)
        parts = [L.sequence_losses(*f32(logp[s], old[s], adv[s], mask[s]), cfg) for s in (slice(0, 2), slice(2, 6))]
        mixed = sum(float(jnp.sum(p[0])) for p in parts) / sum(float(p[1]) for p in parts)
        np.testing.assert_allclose(mixed, float(jnp.sum(full) / denom), **TOL)
        loss, _ = L.policy_loss(*f32(logp, old, adv, mask), cfg)
        np.testing.assert_allclose(loss, jnp.sum(full) / denom, **TOL)
        np.testing.assert_allclose(denom, {"token_mean": mask.sum()}.get(mode, 5), **TOL)  # padding row not counted


def test_k3_values_and_clamps():
    logp = np.array([[-1.0, -2.0, -1.5, -30.0]])
    ref = np.array([[-2.0, -1.0, -1.5, 0.0]])
    kl = L.kl_k3(*f32(logp, ref))
    np.testing.assert_allclose(kl, [[np.exp(-1.0), np.e - 2.0, 0.0, 10.0]], **TOL)
    assert L.get_kl_estimator("low_var_kl") is L.kl_k3
    np.testing.assert_allclose(L.kl_k1(*f32(logp, ref)), logp - ref, **TOL)
    np.testing.assert_allclose(L.kl_k2(*f32(logp, ref)), 0.5 * (logp - ref) ** 2, **TOL)


def test_gradient_matches_hand_derivation():
    """dL/dlogp_bt = m_bt / (n_seq·len_b) · (−A_b·r_bt·[unclipped branch] + β_b·(1 − exp(ref − logp)))."""
    ratio = np.array([[1.1, 1.5, 0.5], [0.5, 0.9, 4.0]])
    adv = np.array([0.7, -1.3])
    mask = np.array([[1, 1, 0], [1, 1, 1]], float)
    old = np.array([[-1.0, -2.0, -0.5], [-1.5, -0.7, -3.0]])
    logp = old + np.log(ratio)
    ref = logp + np.array([[0.3, -0.2, 0.1], [0.0, 0.4, -0.5]])
    beta = np.array([0.2, 0.05])
    grad = jax.grad(lambda lp: L.policy_loss(lp, *f32(old, adv, mask), CFG, *f32(ref, beta))[0])(f32(logp)[0])
    active = np.array([[1, 0, 1], [0, 1, 0]])  # 1.5 > 1.28 clipped; 0.5 < 0.8 clipped (A<0); 4 > 3 dual
    n_seq, length = 2, mask.sum(1, keepdims=True)
    hand = mask / (n_seq * length) * (-adv[:, None] * ratio * active + beta[:, None] * (1 - np.exp(ref - logp)))
    np.testing.assert_allclose(grad, hand, **TOL)


def test_jit_padding_and_errors():
    logp, old, ref, adv, mask = random_batch(seed=2)
    args = f32(logp, old, adv, mask)
    eager, _ = L.policy_loss(*args, CFG)
    jitted, _ = jax.jit(L.policy_loss, static_argnames="cfg")(*args, cfg=CFG)
    np.testing.assert_allclose(jitted, eager, **TOL)
    padded = [jnp.concatenate([x, jnp.zeros((3,) + x.shape[1:], x.dtype)]) for x in args]
    np.testing.assert_allclose(L.policy_loss(*padded, CFG)[0], eager, **TOL)  # all-masked rows are ignored
    empty = [x[:0] for x in args]
    assert float(L.policy_loss(*empty, CFG)[0]) == 0.0
    _, m0 = L.policy_loss(*args, CFG, ref_logp_bt=jnp.asarray(ref, jnp.float32))
    assert float(m0["kl_loss"]) == 0.0 and float(m0["kl_ref"]) > 0  # β absent: KL logged, not applied
    with pytest.raises(ValueError, match="without ref_logp_bt"):
        L.policy_loss(*args, CFG, kl_beta_b=jnp.ones(6))
    with pytest.raises(KeyError, match="unknown loss aggregation 'mean'"):
        L.policy_loss(*args, LossConfig(agg="mean"))
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        LossConfig(dual_clip=0.5)
    with pytest.raises(ValueError, match="already registered"):
        L.register_aggregation("token_mean")(L.token_mean)
