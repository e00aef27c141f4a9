"""One jitted RL update over a batch partitioned by role, with per-role gradient diagnostics.

For every role r the step computes its loss L_r and gradient g_r w.r.t. its own parameter set
`params[route[r]]`, then for every set combines G = Σ_r c_r g_r with c_r = w_r · d_r:
  w_r  role weight: `count` (denominator share — Σ_r w_r L_r is then exactly the plain mixed-batch
       loss of the set), `equal` (1/R), or `inverse_norm` (∝ 1/‖g_r‖, equal mass per role);
       `same_role_scale` multiplies a role's count by 1/N for its N parallel same-role agents;
  d_r  coherence damping (the paper's I6): 1 − λ·clamp(cos(g_r, EMA(g_r)), 0, 1).
Then clip + AdamW per set (optax). Diagnostics, per mini-batch:
  `grad_norm`     ‖g_r‖, the role's own gradient (its loss alone, on its samples of the mini-batch);
  `grad_mass`     ‖c_r g_r‖, its weighted contribution to G;
  `grad_share`    mass_r / Σ_{r' on the set} mass_r': a share of weighted gradient *norms*, before
                  clipping and the optimizer (it ignores directions: two opposed roles both count);
  `update_share`  ⟨c_r g_r, U⟩ / ⟨G, U⟩ with U the set's applied update (after clip + AdamW, weight decay
                  included): a signed attribution of the step actually taken, summing to 1 over the set's
                  roles by linearity. Under plain SGD (U ∝ −G) it is ⟨c_r g_r, G⟩ / ‖G‖²; it differs from
                  `grad_share` when roles' gradients conflict (a role can take a negative share) and when
                  Adam rescales coordinates unequally;
  `cos/<r1>/<r2>` cos(g_r1, g_r2) between roles on one set.
`logp_gap` / `logp_gap_max`: mean / max |sampler logprob − trainer logprob| over a role's response
tokens that carry the sampler's logprob, both at the rollout's parameters (the trainer's current ones
with one mini-batch, its pre-update `old_logp_nr` with several) and the same tempered distribution: the
drift between how rollouts were sampled (LoRA folded into the weights) and how the trainer scores them.

`train_batch` cuts each set's samples into mini-batches — `paper`: one optimizer step per M samples, so a
set with 3× the samples takes 3× the steps (same-role amplification), after a seeded shuffle that deals
every role of the set evenly over its mini-batches; `balanced`: one step per set per training step — and
calls the jitted update once per mini-batch index. Per-role metrics are averaged over the mini-batches
holding the role.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from marljax.models.attention import check_attention
from marljax.models.decoder import REMAT, Decoder
from marljax.models.logprobs import target_logprobs
from marljax.rl.losses import LossConfig, sequence_losses
from marljax.sampling import bucket, bucket_rows

ROLE_WEIGHTINGS = ("count", "equal", "inverse_norm")
MINIBATCH_MODES = ("paper", "balanced")


class RoleBatch(NamedTuple):
    """One role's samples, right-padded: prompt + response tokens and the response window."""

    tokens_nt: jax.Array  # int32 [n, T]
    prompt_len_n: jax.Array  # int32 [n]
    resp_mask_nr: jax.Array  # float32 [n, R]; 1 on response tokens (all 0 on padding rows)
    adv_n: jax.Array  # float32 [n]
    old_logp_nr: jax.Array  # float32 [n, R]; used when the old policy differs from the current
    sampler_logp_nr: jax.Array  # float32 [n, R]; the sampler's logprobs of the response (0 where absent)
    has_sampler_n: jax.Array  # float32 [n]; 1 on rows that carry the sampler's logprobs


@dataclasses.dataclass(frozen=True)
class StepConfig:
    route: tuple[tuple[str, str], ...]  # (role, set) pairs
    loss: LossConfig = LossConfig()
    role_weighting: str = "count"
    role_scale: tuple[tuple[str, float], ...] = ()  # same_role_scale factors (role, 1/N)
    kl_beta: tuple[tuple[str, float], ...] = ()  # per-role β of the KL anchor to the base model
    damping_lambda: float = 0.0
    damping_ema: float = 0.9
    logprob_temperature: float = 1.0
    lora_scale: float | None = 1.0  # None: full fine-tuning (the set's state is the whole model)
    minibatch: str = "paper"
    minibatch_size: int = 512
    remat: str = "full"  # decoder.REMAT: full | dots | none
    attention: str = "auto"  # models.attention.ATTENTIONS: auto | dense | blockwise | cudnn | splash
    logprob_chunk: int | None = None  # response positions per log-prob chunk (None: LOGPROB_CHUNK)

    def __post_init__(self):
        if self.role_weighting not in ROLE_WEIGHTINGS:
            raise ValueError(f"rl.role_weighting={self.role_weighting!r}; choose from {ROLE_WEIGHTINGS}.")
        if self.minibatch not in MINIBATCH_MODES:
            raise ValueError(f"rl.minibatch={self.minibatch!r}; choose from {MINIBATCH_MODES}.")
        if self.remat not in REMAT:
            raise ValueError(f"rl.remat={self.remat!r}; choose from {sorted(REMAT)}.")
        check_attention(self.attention)
        if not 0.0 <= self.damping_lambda <= 1.0:
            raise ValueError(f"rl.damping_lambda={self.damping_lambda} must be in [0, 1].")

    @property
    def roles(self) -> tuple[str, ...]:
        return tuple(r for r, _ in self.route)

    @property
    def sets(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(s for _, s in self.route))

    def set_of(self, role: str) -> str:
        return dict(self.route)[role]


def make_optimizer(*, weight_decay=0.01, b1=0.9, b2=0.999, grad_clip=1.0):
    """Clip + AdamW; the learning rate is injected per call so the schedule follows training steps."""
    return optax.chain(
        optax.clip_by_global_norm(grad_clip),
        optax.inject_hyperparams(optax.adamw)(learning_rate=0.0, b1=b1, b2=b2,
                                              weight_decay=weight_decay))


def _tree_dot(a, b):
    return sum(jnp.vdot(x.astype(jnp.float32), y.astype(jnp.float32))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _scale(tree, c):
    return jax.tree.map(lambda x: (x * c).astype(x.dtype), tree)


def _update_shares(weighted_grads: dict, update) -> dict[str, jax.Array]:
    """Signed share of the applied update U per role: ⟨c_r g_r, U⟩ / Σ_r' ⟨c_r' g_r', U⟩ (= ⟨G, U⟩);
    sums to 1 over the set's roles (0 for all when ⟨G, U⟩ = 0)."""
    dots = {r: _tree_dot(g, update) for r, g in weighted_grads.items()}
    total = sum(dots.values())
    safe = jnp.where(total != 0, total, 1.0)
    return {r: jnp.where(total != 0, d / safe, 0.0) for r, d in dots.items()}


class Trainer:
    """Holds the frozen base, the step config and the optimizer; `update` is the jitted step."""

    def __init__(self, model: Decoder, cfg: StepConfig, optimizer: optax.GradientTransformation, *,
                 out_shardings=None):
        """`out_shardings`: shardings of `update`'s (params, opt_states, ema, metrics) on a device
        mesh (see `marljax.sharding`), so the state stays where it was placed."""
        self.graphdef, self.base_state = nnx.split(model)
        self.cfg = cfg
        self.optimizer = optimizer
        # The frozen base is a jit argument: a closed-over array would be inlined as a constant.
        extra = {} if out_shardings is None else {"out_shardings": out_shardings}
        self._update_jit = jax.jit(self._update, static_argnames=("recompute_old",),
                                   donate_argnums=(1, 2, 3), **extra)
        self._logprobs_jit = jax.jit(self._all_logprobs)

    def update(self, params, opt_states, ema, batches: dict[str, RoleBatch], lr, *, recompute_old):
        """The jitted step (donates params, opt_states and ema); see the module docstring."""
        return self._update_jit(self.base_state, params, opt_states, ema, batches, lr,
                                recompute_old=recompute_old)

    def logprobs(self, params, batches: dict[str, RoleBatch]):
        """Jitted response log-probs of every role under its set's current parameters."""
        return self._logprobs_jit(self.base_state, params, batches)

    # ---- forward -----------------------------------------------------------------------------
    def response_logprobs(self, trainable, batch: RoleBatch, *, use_base: bool = False, base=None):
        """log π(response token) [n, R] at the configured temperature; `use_base`: the frozen base
        (`base`: its state, default the one the trainer was built with)."""
        cfg = self.cfg
        base = self.base_state if base is None else base
        if cfg.lora_scale is None:
            model = nnx.merge(self.graphdef, base if use_base else trainable)
            lora = None
        else:
            model = nnx.merge(self.graphdef, base)
            lora = None if use_base else trainable
        h_ntd, _ = model.hidden(batch.tokens_nt, lora=lora, lora_scale=cfg.lora_scale or 1.0,
                                remat=cfg.remat, attention_impl=cfg.attention)
        T, R = batch.tokens_nt.shape[1], batch.resp_mask_nr.shape[1]
        idx_nr = jnp.minimum(batch.prompt_len_n[:, None] - 1 + jnp.arange(R), T - 2)
        h_nrd = jnp.take_along_axis(h_ntd, idx_nr[:, :, None], axis=1)
        target_nr = jnp.take_along_axis(batch.tokens_nt, idx_nr + 1, axis=1)
        return target_logprobs(model.logits, h_nrd, target_nr, cfg.logprob_temperature, cfg.logprob_chunk)

    def _all_logprobs(self, base, params, batches: dict[str, RoleBatch]):
        return {r: self.response_logprobs(params[self.cfg.set_of(r)], b, base=base)
                for r, b in batches.items()}

    def role_loss(self, trainable, batch: RoleBatch, role: str, recompute_old: bool, base=None):
        logp = self.response_logprobs(trainable, batch, base=base)
        old = batch.old_logp_nr if recompute_old else jax.lax.stop_gradient(logp)
        beta = dict(self.cfg.kl_beta).get(role, 0.0)
        ref = kl_b = None
        if beta > 0:
            ref = self.response_logprobs(trainable, batch, use_base=True, base=base)
            kl_b = jnp.full(batch.adv_n.shape, beta, jnp.float32)
        seq_b, denom, metrics = sequence_losses(logp, old, batch.adv_n, batch.resp_mask_nr,
                                                self.cfg.loss, ref, kl_b)
        loss = jnp.sum(seq_b) / jnp.maximum(denom, 1.0)
        return loss, (denom, {**metrics, **logp_gap(jax.lax.stop_gradient(old), batch)})

    # ---- the step ----------------------------------------------------------------------------
    def _update(self, base, params, opt_states, ema, batches: dict[str, RoleBatch], lr, *,
                recompute_old):
        cfg = self.cfg
        scale = dict(cfg.role_scale)
        out: dict[str, jax.Array] = {}
        grads, denoms, losses, norms = {}, {}, {}, {}
        for role, batch in batches.items():
            trainable = params[cfg.set_of(role)]
            (loss, (denom, metrics)), g = jax.value_and_grad(self.role_loss, has_aux=True)(
                trainable, batch, role, recompute_old, base)
            grads[role], denoms[role], losses[role] = g, denom, loss
            norms[role] = optax.tree.norm(g)
            out[f"role/{role}/loss"] = loss
            out[f"role/{role}/grad_norm"] = norms[role]
            out[f"role/{role}/n_seq"] = denom
            for k, v in metrics.items():
                out[f"role/{role}/{k}"] = v

        new_params, new_opt, new_ema = dict(params), dict(opt_states), dict(ema)
        for set_name in cfg.sets:
            roles = [r for r in batches if cfg.set_of(r) == set_name]
            if not roles:
                continue
            present = {r: (denoms[r] > 0).astype(jnp.float32) for r in roles}
            if cfg.role_weighting == "count":
                raw = {r: denoms[r] * scale.get(r, 1.0) for r in roles}
            elif cfg.role_weighting == "equal":
                raw = {r: present[r] for r in roles}
            else:  # inverse_norm
                raw = {r: present[r] / jnp.maximum(norms[r], 1e-12) for r in roles}
            total = sum(raw.values())
            weights = {r: raw[r] / jnp.maximum(total, 1e-12) for r in roles}
            coeffs = {}
            for r in roles:
                damp = jnp.float32(1.0)
                if cfg.damping_lambda > 0:
                    cos = _tree_dot(grads[r], ema[r]) / jnp.maximum(
                        norms[r] * optax.tree.norm(ema[r]), 1e-12)
                    damp = 1.0 - cfg.damping_lambda * jnp.clip(cos, 0.0, 1.0)
                    mix = jnp.where(denoms[r] > 0, cfg.damping_ema, 1.0)  # absent role: keep EMA
                    new_ema[r] = jax.tree.map(lambda e, g: mix * e + (1 - mix) * g, ema[r], grads[r])
                    out[f"role/{r}/damping"] = damp
                coeffs[r] = weights[r] * damp
            masses = {r: coeffs[r] * norms[r] for r in roles}
            mass_total = sum(masses.values())
            for r in roles:
                out[f"role/{r}/weight"] = weights[r]
                out[f"role/{r}/grad_mass"] = masses[r]
                out[f"role/{r}/grad_share"] = masses[r] / jnp.maximum(mass_total, 1e-12)
            for a, b in itertools.combinations(roles, 2):
                out[f"cos/{a}/{b}"] = _tree_dot(grads[a], grads[b]) / jnp.maximum(norms[a] * norms[b],
                                                                                   1e-12)
            weighted = {r: _scale(grads[r], coeffs[r]) for r in roles}
            g_set = functools.reduce(lambda x, y: jax.tree.map(jnp.add, x, y), weighted.values())
            finite = jnp.all(jnp.stack([jnp.isfinite(losses[r]) & jnp.isfinite(norms[r]) for r in roles]))
            active = (total > 0) & finite  # a non-finite loss or gradient skips the update
            out[f"set/{set_name}/nonfinite"] = (~finite).astype(jnp.float32)
            opt_state = new_opt[set_name]
            opt_state[1].hyperparams["learning_rate"] = lr
            updates, opt_state = self.optimizer.update(g_set, opt_state, params[set_name])
            updated = optax.apply_updates(params[set_name], updates)
            new_params[set_name] = jax.tree.map(lambda n, o: jnp.where(active, n, o), updated,
                                                params[set_name])
            new_opt[set_name] = jax.tree.map(lambda n, o: jnp.where(active, n, o), opt_state,
                                             new_opt[set_name])
            for r, share in _update_shares(weighted, updates).items():
                out[f"role/{r}/update_share"] = jnp.where(active, share, 0.0)
            out[f"set/{set_name}/grad_norm"] = optax.tree.norm(g_set)
            out[f"set/{set_name}/update_norm"] = jnp.where(active, optax.tree.norm(updates), 0.0)
            out[f"set/{set_name}/loss"] = sum(weights[r] * losses[r] for r in roles)
            out[f"set/{set_name}/active"] = active.astype(jnp.float32)
        return new_params, new_opt, new_ema, out


def logp_gap(trainer_logp_nr, batch: RoleBatch) -> dict[str, jax.Array]:
    """Mean and max |sampler − trainer| logprob over the response tokens of rows that carry sampler
    logprobs (prompt and padding positions excluded; both 0 when no row carries them)."""
    mask_nr = batch.resp_mask_nr * batch.has_sampler_n[:, None]
    gap_nr = jnp.abs(batch.sampler_logp_nr - trainer_logp_nr) * mask_nr
    return {"logp_gap": jnp.sum(gap_nr) / jnp.maximum(jnp.sum(mask_nr), 1.0), "logp_gap_max": jnp.max(gap_nr)}


# ---- host side: packing and mini-batching ---------------------------------------------------------
@dataclasses.dataclass
class Sample:
    """One role call as the trainer sees it."""

    role: str
    prompt: list[int]
    response: list[int]
    advantage: float
    old_logprobs: list[float] | None = None
    sampler_logprobs: list[float] | None = None  # the sampler's, per response token (for `logp_gap`)


def length_bucket(n: int) -> int:
    """n rounded up to a multiple of a quarter of its power of two (≤ 25% padding, few shapes)."""
    step = max(16, bucket(n) // 4)
    return -(-n // step) * step


def pack(samples: list[Sample], *, n_bucket: int | None = None) -> RoleBatch:
    """Right-pad samples of one role into bucketed arrays (rows beyond len(samples) are padding)."""
    n = n_bucket or bucket_rows(max(len(samples), 1))
    T = length_bucket(max([len(s.prompt) + len(s.response) for s in samples] + [2]) + 1)
    R = bucket(max([len(s.response) for s in samples] + [1]), 8)
    tokens = np.zeros((n, T), np.int32)
    plen = np.ones((n,), np.int32)
    mask = np.zeros((n, R), np.float32)
    adv = np.zeros((n,), np.float32)
    old = np.zeros((n, R), np.float32)
    sampler = np.zeros((n, R), np.float32)
    has_sampler = np.zeros((n,), np.float32)
    for i, s in enumerate(samples):
        seq = list(s.prompt) + list(s.response)
        tokens[i, : len(seq)] = seq
        plen[i] = len(s.prompt)
        mask[i, : len(s.response)] = 1.0
        adv[i] = s.advantage
        if s.old_logprobs is not None:
            old[i, : len(s.response)] = s.old_logprobs
        if s.sampler_logprobs is not None:
            if len(s.sampler_logprobs) != len(s.response):
                raise ValueError(f"a {s.role!r} sample has {len(s.sampler_logprobs)} sampler logprobs for "
                                 f"{len(s.response)} response tokens; give one per response token.")
            sampler[i, : len(s.response)] = s.sampler_logprobs
            has_sampler[i] = 1.0
    return RoleBatch(jnp.asarray(tokens), jnp.asarray(plen), jnp.asarray(mask), jnp.asarray(adv),
                     jnp.asarray(old), jnp.asarray(sampler), jnp.asarray(has_sampler))


def _mixed_chunks(items: list[Sample], k: int) -> list[list[Sample]]:
    """`k` chunks, each holding 1/k of every role's samples (±1), in the order given: exact shares, so
    every mini-batch packs to about the same rows per role (one compiled shape, not one per draw)."""
    n_role = collections.Counter(s.role for s in items)
    seen: collections.Counter = collections.Counter()
    chunks: list[list[Sample]] = [[] for _ in range(k)]
    for s in items:
        chunks[seen[s.role] * k // n_role[s.role]].append(s)
        seen[s.role] += 1
    return chunks


def minibatches(samples: list[Sample], cfg: StepConfig, *, seed: int | None = None
                ) -> list[dict[str, list[Sample]]]:
    """Cut every set's samples into mini-batches; entry k holds the k-th of each set.

    `paper`: a set with n samples takes ceil(n_eff / M) mini-batches, n_eff counting a sample of a role
    with same-role scale s as s samples; `balanced`: one mini-batch per set. `seed` (paper mode): each
    set's samples are shuffled by a permutation from `numpy.random.default_rng(seed)` and every role's
    samples are then dealt evenly over the k mini-batches, so each carries every role of the set in its
    share (rollouts list calls stage by stage: cut in that order, a shared Voting set would train on
    generator-only, then aggregator-only mini-batches). `seed=None` cuts in rollout order (no shuffle);
    the trainer always passes one.
    """
    scale = dict(cfg.role_scale)
    per_set: dict[str, list[Sample]] = {s: [] for s in cfg.sets}
    for s in samples:
        per_set[cfg.set_of(s.role)].append(s)
    rng = np.random.default_rng(seed) if seed is not None and cfg.minibatch == "paper" else None
    chunks_per_set = {}
    for set_name, items in per_set.items():
        if not items:
            chunks_per_set[set_name] = []
            continue
        if cfg.minibatch == "balanced":
            k = 1
        else:
            n_eff = sum(scale.get(s.role, 1.0) for s in items)
            k = max(1, math.ceil(n_eff / cfg.minibatch_size - 1e-9))
        if rng is None:
            bounds = np.linspace(0, len(items), k + 1).round().astype(int)
            chunks_per_set[set_name] = [items[bounds[i]: bounds[i + 1]] for i in range(k)]
        else:
            chunks_per_set[set_name] = _mixed_chunks([items[i] for i in rng.permutation(len(items))], k)
    n_mb = max((len(c) for c in chunks_per_set.values()), default=0)
    out = []
    for i in range(n_mb):
        mb: dict[str, list[Sample]] = {}
        for chunks in chunks_per_set.values():
            if i < len(chunks):
                for s in chunks[i]:
                    mb.setdefault(s.role, []).append(s)
        out.append(mb)
    return out


def train_batch(trainer: Trainer, params, opt_states, ema, samples: list[Sample], lr: float, *,
                seed: int | None = None):
    """All optimizer steps of one training step. Returns new state and averaged metrics. `seed`: the
    mini-batch shuffle (see `minibatches`); derive it from (run seed, step) so a resumed run repeats it."""
    cfg = trainer.cfg
    mbs = minibatches(samples, cfg, seed=seed)
    roles_present = sorted({s.role for s in samples})
    packed = []
    for mb in mbs:
        # every role appears in every call (empty → one all-masked row) so one compilation serves all
        packed.append({r: pack(mb.get(r, [])) for r in roles_present})
    recompute_old = len(packed) > 1
    if recompute_old:  # old log-probs under the parameters before the first update (PPO semantics)
        packed = [{r: b._replace(old_logp_nr=lp) for (r, b), lp in
                   zip(mb.items(), trainer.logprobs(params, mb).values())} for mb in packed]
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    opt_steps = {s: 0 for s in cfg.sets}
    for mb in packed:
        params, opt_states, ema, m = trainer.update(params, opt_states, ema, mb, jnp.float32(lr),
                                                    recompute_old=recompute_old)
        m = jax.device_get(m)
        for s in cfg.sets:
            opt_steps[s] += int(m.get(f"set/{s}/active", 0.0) > 0)
        for k, v in m.items():
            if k.startswith("set/") and k.endswith("/active"):
                continue
            if k.endswith("/nonfinite") or k.endswith("/logp_gap_max"):  # the worst mini-batch
                sums[k] = max(sums.get(k, 0.0), float(v))
                counts[k] = 1
                continue
            if k.startswith("role/") and float(m.get(f"role/{k.split('/')[1]}/n_seq", 1.0)) == 0:
                continue  # a role absent from this mini-batch does not dilute its averages
            sums[k] = sums.get(k, 0.0) + float(v)
            counts[k] = counts.get(k, 0) + 1
    metrics = {k: sums[k] / counts[k] for k in sums}
    for s, n in opt_steps.items():
        metrics[f"set/{s}/opt_steps"] = n
    return params, opt_states, ema, metrics
