"""Policy-gradient losses (jax.numpy, jit-able): PPO clip with asymmetric range and dual clip, loss
aggregation modes, and an optional per-sample KL penalty to a reference model.

Shapes: `_b` per sequence, `_bt` per token. `mask_bt` marks response tokens (bool or 0/1); rows with
no valid token are padding and count nowhere. Three registries make every piece swappable by name:
policy losses, aggregations and KL estimators.

Every aggregation is linear in the per-token loss, and returns `(seq_b, denom)` with
`loss = sum(seq_b) / denom`, so a trainer can reweight sequences or roles and keep one normaliser
(the mixed-batch loss is the sum of all roles' `seq_b` over the batch's `denom`).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from marljax.rl.registry import Registry

Array = jax.Array
# (logp_bt, old_logp_bt, adv_b, cfg) -> (loss_bt, {name: indicator_bt}); the indicators become metrics.
PolicyLossFn = Callable[[Array, Array, Array, "LossConfig"], tuple[Array, dict[str, Array]]]
AggregationFn = Callable[[Array, Array], tuple[Array, Array]]  # (loss_bt, mask_bt) -> (seq_b, denom)
KLFn = Callable[[Array, Array], Array]  # (logp_bt, ref_logp_bt) -> kl_bt

_POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss")
_AGGREGATIONS: Registry[AggregationFn] = Registry("loss aggregation")
_KL_ESTIMATORS: Registry[KLFn] = Registry("KL estimator")


def register_policy_loss(name: str):
    """Decorator: `fn(logp_bt, old_logp_bt, adv_b, cfg) -> (loss_bt, indicators_bt)`."""
    return _POLICY_LOSSES.register(name)


def get_policy_loss(name: str) -> PolicyLossFn:
    return _POLICY_LOSSES.get(name)


def register_aggregation(name: str):
    """Decorator: `fn(loss_bt, mask_bt) -> (seq_b, denom)`; must be linear in `loss_bt`."""
    return _AGGREGATIONS.register(name)


def get_aggregation(name: str) -> AggregationFn:
    return _AGGREGATIONS.get(name)


def register_kl_estimator(*names: str):
    """Decorator: `fn(logp_bt, ref_logp_bt) -> kl_bt`, an estimate of KL(π‖ref) on samples of π."""
    return _KL_ESTIMATORS.register(*names)


def get_kl_estimator(name: str) -> KLFn:
    return _KL_ESTIMATORS.get(name)


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """Paper defaults: PPO clip 0.2 / 0.28, dual clip 3.0, token-mean per sequence then sequence mean.

    `log_ratio_clamp` bounds log(π/π_old) before exp, as verl does (no gradient beyond it).
    """

    policy_loss: str = "ppo"
    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip: float | None = 3.0  # None disables; applies to negative advantages only
    agg: str = "seq_mean_token_mean"
    kl_estimator: str = "k3"  # used only when a reference log-prob is given
    log_ratio_clamp: float = 20.0

    def __post_init__(self):
        if not 0.0 <= self.clip_low < 1.0:
            raise ValueError(f"clip_low must be in [0, 1), got {self.clip_low}")
        if self.clip_high < 0.0:
            raise ValueError(f"clip_high must be ≥ 0, got {self.clip_high}")
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1 (or None), got {self.dual_clip}")


@register_policy_loss("ppo")
def ppo_clip(logp_bt, old_logp_bt, adv_b, cfg: LossConfig):
    """max(−A·r, −A·clip(r, 1−clip_low, 1+clip_high)); for A < 0 also capped at −A·dual_clip."""
    log_ratio = jnp.clip(logp_bt - old_logp_bt, -cfg.log_ratio_clamp, cfg.log_ratio_clamp)
    ratio = jnp.exp(log_ratio)
    adv = adv_b[:, None]
    loss = jnp.maximum(-adv * ratio, -adv * jnp.clip(ratio, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high))
    neg = adv < 0
    high, low = (adv > 0) & (ratio > 1.0 + cfg.clip_high), neg & (ratio < 1.0 - cfg.clip_low)
    stats = {"clip_frac": high | low, "clip_frac_high": high, "clip_frac_low": low}
    if cfg.dual_clip is not None:
        loss = jnp.where(neg, jnp.minimum(loss, -adv * cfg.dual_clip), loss)
        stats["dual_clip_frac"] = neg & (ratio > cfg.dual_clip)
    return loss, stats


def _seq_count(mask_bt):
    return jnp.sum(jnp.any(mask_bt > 0, axis=-1)).astype(mask_bt.dtype)


@register_aggregation("seq_mean_token_mean")
def seq_mean_token_mean(loss_bt, mask_bt):
    """Mean over each sequence's tokens, then over sequences (the paper; verl seq-mean-token-mean)."""
    n_tok_b = jnp.sum(mask_bt, axis=-1)
    return jnp.sum(loss_bt * mask_bt, axis=-1) / jnp.maximum(n_tok_b, 1.0), _seq_count(mask_bt)


@register_aggregation("token_mean")
def token_mean(loss_bt, mask_bt):
    """Mean over all tokens of the batch (long sequences weigh more)."""
    return jnp.sum(loss_bt * mask_bt, axis=-1), jnp.sum(mask_bt)


@register_aggregation("seq_mean_token_sum")
def seq_mean_token_sum(loss_bt, mask_bt):
    """Sum over each sequence's tokens, then mean over sequences."""
    return jnp.sum(loss_bt * mask_bt, axis=-1), _seq_count(mask_bt)


@register_kl_estimator("k1")
def kl_k1(logp_bt, ref_logp_bt):
    """log π − log ref (unbiased, high variance, can be negative)."""
    return logp_bt - ref_logp_bt


@register_kl_estimator("k2")
def kl_k2(logp_bt, ref_logp_bt):
    """½(log π − log ref)²."""
    return 0.5 * jnp.square(logp_bt - ref_logp_bt)


@register_kl_estimator("k3", "low_var_kl")
def kl_k3(logp_bt, ref_logp_bt):
    """exp(x) − x − 1 with x = log ref − log π clamped to ±20, result clamped to ±10 (verl low_var_kl)."""
    x = jnp.clip(ref_logp_bt - logp_bt, -20.0, 20.0)
    return jnp.clip(jnp.exp(x) - x - 1.0, -10.0, 10.0)


def aggregate(loss_bt: Array, mask_bt: Array, mode: str = "seq_mean_token_mean") -> tuple[Array, Array]:
    """Per-sequence contributions `seq_b` and normaliser `denom`: loss = sum(seq_b) / denom."""
    mask_bt = mask_bt.astype(loss_bt.dtype)
    return get_aggregation(mode)(loss_bt, mask_bt)


def _masked_mean(x_bt, mask_bt):
    return jnp.sum(x_bt * mask_bt) / jnp.maximum(jnp.sum(mask_bt), 1.0)


# `sequence_losses`' metrics that are normalised like the loss (by the aggregation's denominator); the
# others are means over the response tokens.
_LOSS_NORMALISED = frozenset({"pg_loss", "kl_loss"})


def metric_weight(name: str, n_tokens, denom):
    """What `sequence_losses`' metric `name` is an average over (`n_tokens` response tokens, or the
    aggregation's `denom`), so that metrics of several micro-batches combine into the whole batch's."""
    return denom if name in _LOSS_NORMALISED else n_tokens


def sequence_losses(logp_bt: Array, old_logp_bt: Array, adv_b: Array, mask_bt: Array,
                    cfg: LossConfig = LossConfig(), ref_logp_bt: Array | None = None,
                    kl_beta_b: Array | None = None) -> tuple[Array, Array, dict[str, Array]]:
    """Per-sequence loss contributions, normaliser and metrics; loss = sum(seq_b) / max(denom, 1).

    Per token: policy loss + β_b·KL(π‖ref) when `ref_logp_bt` is given (β per sequence, so a per-role β
    is the caller's choice; `kl_beta_b=None` means β = 0 and only logs the KL). `old_logp_bt`,
    `ref_logp_bt` and `adv_b` are treated as constants. Metrics: the policy loss's indicators as token
    means over valid tokens (`ppo`: `clip_frac` = `clip_frac_high` + `clip_frac_low`, `dual_clip_frac`),
    `pg_loss` (aggregated like the loss), token means `ppo_kl` (k1 of π_old‖π) and `approx_kl` (k3 of
    π_old‖π), and with a reference `kl_ref` (token-mean KL estimate) and `kl_loss` (aggregated β·KL).
    """
    old_logp_bt, adv_b = jax.lax.stop_gradient(old_logp_bt), jax.lax.stop_gradient(adv_b)
    mask_bt = mask_bt.astype(logp_bt.dtype)
    pg_bt, indicators = get_policy_loss(cfg.policy_loss)(logp_bt, old_logp_bt, adv_b, cfg)
    pg_seq_b, denom = aggregate(pg_bt, mask_bt, cfg.agg)
    norm = jnp.maximum(denom, 1.0)
    seq_b = pg_seq_b
    log_ratio = jnp.clip(logp_bt - old_logp_bt, -cfg.log_ratio_clamp, cfg.log_ratio_clamp)
    metrics = {name: _masked_mean(ind.astype(mask_bt.dtype), mask_bt) for name, ind in indicators.items()}
    metrics["pg_loss"] = jnp.sum(pg_seq_b) / norm
    metrics["ppo_kl"] = _masked_mean(-log_ratio, mask_bt)
    metrics["approx_kl"] = _masked_mean(jnp.expm1(log_ratio) - log_ratio, mask_bt)

    if ref_logp_bt is not None:
        kl_bt = get_kl_estimator(cfg.kl_estimator)(logp_bt, jax.lax.stop_gradient(ref_logp_bt))
        beta_b = jnp.zeros_like(adv_b) if kl_beta_b is None else jnp.asarray(kl_beta_b, logp_bt.dtype)
        kl_seq_b, _ = aggregate(beta_b[:, None] * kl_bt, mask_bt, cfg.agg)
        seq_b = seq_b + kl_seq_b
        metrics["kl_ref"] = _masked_mean(kl_bt, mask_bt)
        metrics["kl_loss"] = jnp.sum(kl_seq_b) / norm
    elif kl_beta_b is not None:
        raise ValueError("kl_beta_b was given without ref_logp_bt; pass the reference log-probs.")
    return seq_b, denom, metrics


def policy_loss(logp_bt: Array, old_logp_bt: Array, adv_b: Array, mask_bt: Array,
                cfg: LossConfig = LossConfig(), ref_logp_bt: Array | None = None,
                kl_beta_b: Array | None = None) -> tuple[Array, dict[str, Array]]:
    """Scalar loss (to minimise) and metrics; see `sequence_losses`. Use with `jax.grad(..., has_aux=True)`."""
    seq_b, denom, metrics = sequence_losses(logp_bt, old_logp_bt, adv_b, mask_bt, cfg, ref_logp_bt, kl_beta_b)
    loss = jnp.sum(seq_b) / jnp.maximum(denom, 1.0)
    return loss, {"loss": loss, **metrics}
