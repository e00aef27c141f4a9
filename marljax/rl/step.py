"""One jitted RL update over a batch partitioned by role, with per-role gradient diagnostics.

`Trainer.update` takes a `TrainState` (marljax.rl.state) and returns the next one and a `StepMetrics`
(marljax.rl.step_metrics); its two parts are a role's loss and gradient (`_role_grad`) and a set's
combination of its roles' gradients and optimizer step (`_set_update`).

For every role r the step computes its loss L_r and gradient g_r w.r.t. its own parameter set
`params[route[r]]`, then for every set combines G = Σ_r c_r g_r with c_r = w_r · d_r:
  w_r  role weight: `count` (denominator share — Σ_r w_r L_r is then exactly the plain mixed-batch
       loss of the set), `equal` (1/R), or `inverse_norm` (∝ 1/‖g_r‖, equal mass per role);
       then × 1/N for a role of N parallel same-role agents under `same_role_scale` (after the
       normalisation: the same 1/N whether the role shares its set or not; the optimizer steps unchanged);
  d_r  coherence damping (the paper's I6): 1 − λ·clamp(cos(g_r, EMA(g_r)), 0, 1). The EMA tracks the
       undamped g_r (the authors' code tracks d_r·g_r): an EMA of damped gradients weighs each past step
       by the damping it caused, so the coherence estimate would feed on its own control; undamped, it
       measures the role's gradient direction alone. The paper's λ ≤ 0.3 keeps the two close.
Then clip + AdamW per set (optax). Diagnostics, per mini-batch (fields of `RoleMetrics`, `SetMetrics`):
  `grad_norm`     ‖g_r‖, the role's own gradient (its loss alone, on its samples of the mini-batch);
  `grad_mass`     ‖c_r g_r‖, its weighted contribution to G;
  `grad_share`    mass_r / Σ_{r' on the set} mass_r': a share of weighted gradient *norms*, before
                  clipping and the optimizer (it ignores directions: two opposed roles both count);
  `update_share`  ⟨c_r g_r, U⟩ / ⟨G, U⟩ with U the set's applied update (after clip + AdamW, weight decay
                  included): a signed attribution of the step actually taken, summing to 1 over the set's
                  roles by linearity. Under plain SGD (U ∝ −G) it is ⟨c_r g_r, G⟩ / ‖G‖²; it differs from
                  `grad_share` when roles' gradients conflict (a role can take a negative share) and when
                  Adam rescales coordinates unequally;
  `cos/<r1>/<r2>` cos(g_r1, g_r2) between roles on one set;
  `agent_grad_cos` mean pairwise cos between the gradients of a role's agents (`Sample.agent`: its voter /
                  worker slots), each the role's loss on that agent's samples alone; averaged over the
                  mini-batches where the role has ≥ 2 agents;
  `minibatch_grad_cos` mean pairwise cos between a role's g_r of the mini-batches of one training step
                  (each at the parameters its step started from), for a role in ≥ 2 mini-batches.
                  Both are `marljax.rl.coherence`; a role with one agent / one mini-batch has none.
`logp_gap` / `logp_gap_max`: mean / max |sampler logprob − trainer logprob| over a role's response
tokens that carry the sampler's logprob, both at the rollout's parameters (the trainer's current ones
with one mini-batch, its pre-update `old_logp_br` with several) and the same tempered distribution: the
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

from marljax.core.shapes import bucket, bucket_rows, length_bucket
from marljax.models.attention import check_attention
from marljax.models.decoder import REMAT, Decoder
from marljax.models.logprobs import target_logprobs
from marljax.rl.coherence import Coherence, mean_cos
from marljax.rl.coherence import add as coherence_add
from marljax.rl.losses import LossConfig, metric_weight, sequence_losses
from marljax.rl.state import TrainState, with_learning_rate
from marljax.rl.step_metrics import BatchMetrics, RoleMetrics, SetMetrics, StepMetrics, average

ROLE_WEIGHTINGS = ("count", "equal", "inverse_norm")
MINIBATCH_MODES = ("paper", "balanced")


class RoleBatch(NamedTuple):
    """One role's samples, right-padded: prompt + response tokens and the response window."""

    tokens_bt: jax.Array  # int32 [B, T]
    prompt_len_b: jax.Array  # int32 [B]
    resp_mask_br: jax.Array  # float32 [B, R]; 1 on response tokens (all 0 on padding rows)
    adv_b: jax.Array  # float32 [B]
    old_logp_br: jax.Array  # float32 [B, R]; used when the old policy differs from the current
    sampler_logp_br: jax.Array  # float32 [B, R]; the sampler's logprobs of the response (0 where absent)
    has_sampler_b: jax.Array  # float32 [B]; 1 on rows that carry the sampler's logprobs


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
    micro_batch_tokens: int = 0  # per data-parallel rank, rows × positions of one forward/backward; 0: off
    micro_batch_rows: int = 0  # per data-parallel rank, rows of one forward/backward (with micro_batch_tokens); 0: any
    logprob_bytes: int | None = None  # float32 logits per log-prob chunk and chip (None: LOGPROB_BYTES)

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
        if self.micro_batch_rows < 0:
            raise ValueError(f"rl.micro_batch_rows={self.micro_batch_rows} must be ≥ 0 (0: no cap on rows).")
        if self.micro_batch_tokens < 0:
            raise ValueError(f"rl.micro_batch_tokens={self.micro_batch_tokens} must be ≥ 0 (0: one forward/backward "
                             "per role and mini-batch).")

    @property
    def roles(self) -> tuple[str, ...]:
        return tuple(r for r, _ in self.route)

    @property
    def sets(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(s for _, s in self.route))

    def set_of(self, role: str) -> str:
        return dict(self.route)[role]


OPTIMIZERS = ("adamw", "sgd")  # `make_optimizer`'s names


def make_optimizer(name: str = "adamw", *, weight_decay=0.01, b1=0.9, b2=0.999, grad_clip=1.0):
    """Clip + AdamW (the paper's), or clip + plain SGD (no momentum, no weight decay: the control whose
    consecutive updates are correlated only through the gradients); the learning rate is injected per
    call so the schedule follows training steps."""
    if name == "sgd":
        inner = optax.inject_hyperparams(optax.sgd)(learning_rate=0.0)
    elif name == "adamw":
        inner = optax.inject_hyperparams(optax.adamw)(learning_rate=0.0, b1=b1, b2=b2, weight_decay=weight_decay)
    else:
        raise ValueError(f"unknown optimizer {name!r}; expected one of {OPTIMIZERS}.")
    return optax.chain(optax.clip_by_global_norm(grad_clip), inner)


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


class RoleGrad(NamedTuple):
    """One role's part of an update, before its set combines it: its loss, gradient and their metrics."""

    grad: dict  # g_r, laid out like the role's parameter set
    loss: jax.Array
    norm: jax.Array  # ‖g_r‖
    n_seq: jax.Array  # the loss's normaliser; 0 when the role has no samples in the mini-batch
    terms: dict[str, jax.Array]  # `sequence_losses`' metrics
    gap: dict[str, jax.Array]  # `logp_gap`


class RolePart(NamedTuple):
    """One role's sums over one micro-batch: `RoleGrad`'s quantities before normalisation, so that the
    micro-batches of a mini-batch add up to the whole mini-batch's `RoleGrad` (`finish`)."""

    grad: dict  # ∇ Σ_b seq_b
    seq_sum: jax.Array  # Σ_b seq_b
    n_seq: jax.Array  # the aggregation's normaliser over the micro-batch (it adds over rows)
    n_tok: jax.Array  # response tokens
    terms: dict[str, jax.Array]  # each `sequence_losses` metric × what it averages over (`metric_weight`)
    gap_sum: jax.Array  # Σ |sampler − trainer| logprob over tokens carrying the sampler's
    gap_tokens: jax.Array  # how many tokens that is
    gap_max: jax.Array

    def __add__(self, other: RolePart) -> RolePart:
        added = jax.tree.map(jnp.add, self._replace(gap_max=0.0), other._replace(gap_max=0.0))
        return added._replace(gap_max=jnp.maximum(self.gap_max, other.gap_max))

    def finish(self) -> RoleGrad:
        """The mini-batch's `RoleGrad`: gradient and loss over the total normaliser, metrics over theirs."""
        norm = jnp.maximum(self.n_seq, 1.0)
        grad = _scale(self.grad, 1.0 / norm)
        terms = {k: v / jnp.maximum(metric_weight(k, self.n_tok, self.n_seq), 1.0) for k, v in self.terms.items()}
        gap = {"logp_gap": self.gap_sum / jnp.maximum(self.gap_tokens, 1.0), "logp_gap_max": self.gap_max}
        return RoleGrad(grad, self.seq_sum / norm, optax.tree.norm(grad), self.n_seq, terms, gap)


class Trainer:
    """Holds the frozen base, the step config and the optimizer; `update` is the jitted step."""

    def __init__(self, model: Decoder, cfg: StepConfig, optimizer: optax.GradientTransformation, *,
                 out_shardings=None):
        """`out_shardings`: shardings of `update`'s (TrainState, StepMetrics) on a device mesh (see
        `marljax.core.sharding`), so the state stays where it was placed."""
        self.graphdef, self.base_state = nnx.split(model)
        self.cfg = cfg
        self.optimizer = optimizer
        # The frozen base is a jit argument: a closed-over array would be inlined as a constant.
        extra = {} if out_shardings is None else {"out_shardings": out_shardings}
        self._update_jit = jax.jit(self._update, static_argnames=("recompute_old",), donate_argnums=(1,),
                                   **extra)
        self._apply_jit = jax.jit(self._apply, donate_argnums=(0,), **extra)
        self._part_jit = jax.jit(self.role_part, static_argnames=("role", "recompute_old"))
        self._add_jit = jax.jit(RolePart.__add__, donate_argnums=(0,))
        self._finish_jit = jax.jit(RolePart.finish)
        self._agents_jit = jax.jit(self._agents_part, static_argnames=("role", "recompute_old"))
        self._logprobs_jit = jax.jit(self._all_logprobs)

    def init_state(self, params: dict) -> TrainState:
        """Step 0 for `params` ({set: trainable}): fresh optimizer states, a zero EMA per damped role."""
        ema_roles = dict(self.cfg.route) if self.cfg.damping_lambda > 0 else {}
        return TrainState.create(params, self.optimizer, ema_roles)

    def update(self, state: TrainState, batches: dict[str, RoleBatch], lr, *, recompute_old
               ) -> tuple[TrainState, StepMetrics]:
        """The jitted step (donates `state`); see the module docstring."""
        return self._update_jit(self.base_state, state, batches, lr, recompute_old=recompute_old)

    def lower_update(self, state: TrainState, batches: dict[str, RoleBatch], lr, *, recompute_old
                     ) -> jax.stages.Lowered:
        """`update` lowered for these arguments (arrays or `jax.ShapeDtypeStruct`s) without running it: its
        compiled program's memory and cost, for benchmarks."""
        return self._update_jit.lower(self.base_state, state, batches, lr, recompute_old=recompute_old)

    def accumulated_update(self, state: TrainState, micro: dict[str, list[RoleBatch]], lr, *, recompute_old
                           ) -> tuple[TrainState, StepMetrics]:
        """The same step as `update` with each role's mini-batch given as micro-batches (`micro_batches`):
        one jitted forward/backward per micro-batch adds into the role's sums, then one jitted call turns
        them into the roles' gradients and takes the optimizer steps. Donates `state`."""
        grads = {role: self._role_sum_over(state, role, batches, recompute_old) for role, batches in micro.items()}
        return self._apply_jit(state, grads, lr)

    def agent_update(self, state: TrainState, micro: dict[str, list[RoleBatch]], agents: dict[str, list[int]], lr,
                     *, recompute_old, coherence: dict[str, Coherence], fuse: bool = True
                     ) -> tuple[TrainState, StepMetrics, dict[str, float]]:
        """`accumulated_update` with each role's micro-batches labelled by agent (`agents`, parallel to `micro`;
        one agent's micro-batches adjacent): the roles' gradients and the step are the same, and it also
        returns the mean pairwise cosine between the agents' gradients per role with ≥ 2 agents
        (`agent_grad_cos`), and adds each role named in `coherence` to its running mini-batch cosine. `fuse`:
        one batch per agent runs as one program (off under micro-batching: a program then holds one
        micro-batch's activations, the shape `marljax.aot` proves)."""
        grads, agent_cos = {}, {}
        for role, batches in micro.items():
            labels = agents[role]
            trainable = state.params[self.cfg.set_of(role)]
            per_agent = Coherence.zeros_like(trainable) if len(set(labels)) > 1 else None
            if fuse and per_agent is not None and len(set(labels)) == len(labels):  # one batch per agent: one program
                total, per_agent = self._agents_jit(self.base_state, trainable, tuple(batches), per_agent,
                                                    role=role, recompute_old=recompute_old)
            else:  # micro-batches: one call each, so memory stays bounded
                total = None
                for agent in dict.fromkeys(labels):
                    part = self._role_sum_over(state, role, [b for b, a in zip(batches, labels) if a == agent],
                                               recompute_old)
                    if per_agent is not None:
                        per_agent = coherence_add(per_agent, part.grad)
                    total = part if total is None else self._add_jit(total, part)
            grads[role] = self._finish_jit(total)
            if per_agent is not None and (cos := mean_cos(per_agent)) is not None:
                agent_cos[role] = cos
            if role in coherence:
                coherence[role] = coherence_add(coherence[role], grads[role].grad)
        state, metrics = self._apply_jit(state, grads, lr)
        return state, metrics, agent_cos

    def _agents_part(self, base, trainable, batches: tuple[RoleBatch, ...], per_agent: Coherence, *, role: str,
                     recompute_old: bool) -> tuple[RolePart, Coherence]:
        """The role's `RolePart` over one batch per agent and `per_agent` with each agent's gradient added:
        one program, so the agents' forward/backward passes share its fixed costs (separate calls for 3
        voters cost ≈ 30% more than one call over all their rows; tiny-qwen3 on a CPU)."""
        parts = [self.role_part(base, trainable, b, role=role, recompute_old=recompute_old) for b in batches]
        for part in parts:
            per_agent = coherence_add(per_agent, part.grad)
        return functools.reduce(RolePart.__add__, parts), per_agent

    def _role_sum_over(self, state: TrainState, role: str, batches: list[RoleBatch], recompute_old) -> RolePart:
        """One role's `RolePart` summed over micro-batches: one jitted forward/backward each."""
        trainable = state.params[self.cfg.set_of(role)]
        total = None
        for batch in batches:
            part = self._part_jit(self.base_state, trainable, batch, role=role, recompute_old=recompute_old)
            total = part if total is None else self._add_jit(total, part)
        return total

    def logprobs(self, params, batches: dict[str, RoleBatch]):
        """Jitted response log-probs of every role under its set's current parameters."""
        return self._logprobs_jit(self.base_state, params, batches)

    # ---- forward -----------------------------------------------------------------------------
    def response_logprobs(self, trainable, batch: RoleBatch, *, use_base: bool = False, base=None):
        """log π(response token) [B, R] at the configured temperature; `use_base`: the frozen base
        (`base`: its state, default the one the trainer was built with)."""
        cfg = self.cfg
        base = self.base_state if base is None else base
        if cfg.lora_scale is None:
            model = nnx.merge(self.graphdef, base if use_base else trainable)
            lora = None
        else:
            model = nnx.merge(self.graphdef, base)
            lora = None if use_base else trainable
        h_bte, _ = model.hidden(batch.tokens_bt, lora=lora, lora_scale=cfg.lora_scale or 1.0,
                                remat=cfg.remat, attention_impl=cfg.attention)
        T, R = batch.tokens_bt.shape[1], batch.resp_mask_br.shape[1]
        idx_br = jnp.minimum(batch.prompt_len_b[:, None] - 1 + jnp.arange(R), T - 2)
        h_bre = jnp.take_along_axis(h_bte, idx_br[:, :, None], axis=1)
        target_br = jnp.take_along_axis(batch.tokens_bt, idx_br + 1, axis=1)
        return target_logprobs(model.logits, h_bre, target_br, cfg.logprob_temperature, cfg.logprob_bytes)

    def _all_logprobs(self, base, params, batches: dict[str, RoleBatch]):
        return {r: self.response_logprobs(params[self.cfg.set_of(r)], b, base=base)
                for r, b in batches.items()}

    def _role_terms(self, trainable, batch: RoleBatch, role: str, recompute_old: bool, base):
        """`sequence_losses` of the role's samples and the trainer-side log-probs they were scored with."""
        logp_br = self.response_logprobs(trainable, batch, base=base)
        old_br = batch.old_logp_br if recompute_old else jax.lax.stop_gradient(logp_br)
        beta = dict(self.cfg.kl_beta).get(role, 0.0)
        ref_br = kl_b = None
        if beta > 0:
            ref_br = self.response_logprobs(trainable, batch, use_base=True, base=base)
            kl_b = jnp.full(batch.adv_b.shape, beta, jnp.float32)
        seq_b, denom, terms = sequence_losses(logp_br, old_br, batch.adv_b, batch.resp_mask_br,
                                              self.cfg.loss, ref_br, kl_b)
        return seq_b, denom, terms, jax.lax.stop_gradient(old_br)

    def role_loss(self, trainable, batch: RoleBatch, role: str, recompute_old: bool, base=None):
        seq_b, denom, terms, old_br = self._role_terms(trainable, batch, role, recompute_old, base)
        loss = jnp.sum(seq_b) / jnp.maximum(denom, 1.0)
        return loss, (denom, terms, logp_gap(old_br, batch))

    def _role_sum(self, trainable, batch: RoleBatch, role: str, recompute_old: bool, base):
        """Σ_b seq_b of one micro-batch (differentiated) and its unnormalised metrics (`RolePart`)."""
        seq_b, denom, terms, old_br = self._role_terms(trainable, batch, role, recompute_old, base)
        n_tok = jnp.sum(batch.resp_mask_br)
        gap_mask_br = batch.resp_mask_br * batch.has_sampler_b[:, None]
        gap_br = jnp.abs(batch.sampler_logp_br - old_br) * gap_mask_br
        seq_sum = jnp.sum(seq_b)
        part = RolePart(None, seq_sum, denom, n_tok, {k: v * metric_weight(k, n_tok, denom) for k, v in terms.items()},
                        jnp.sum(gap_br), jnp.sum(gap_mask_br), jnp.max(gap_br))
        return seq_sum, part

    # ---- the step ----------------------------------------------------------------------------
    def _update(self, base, state: TrainState, batches: dict[str, RoleBatch], lr, *, recompute_old):
        grads = {role: self._role_grad(base, state.params[self.cfg.set_of(role)], batch, role, recompute_old)
                 for role, batch in batches.items()}
        return self._apply(state, grads, lr)

    def _apply(self, state: TrainState, grads: dict[str, RoleGrad | RolePart], lr) -> tuple[TrainState, StepMetrics]:
        """Every set's combine + optimizer step from its roles' gradients (`RolePart` sums are finished
        first)."""
        cfg = self.cfg
        grads = {r: g.finish() if isinstance(g, RolePart) else g for r, g in grads.items()}
        params, opt_state, ema = dict(state.params), dict(state.opt_state), dict(state.ema)
        roles: dict[str, RoleMetrics] = {}
        sets: dict[str, SetMetrics] = {}
        cos: dict[tuple[str, str], jax.Array] = {}
        for set_name in cfg.sets:
            on_set = {r: g for r, g in grads.items() if cfg.set_of(r) == set_name}
            if not on_set:
                continue
            params[set_name], opt_state[set_name], set_ema, role_m, sets[set_name], set_cos = self._set_update(
                on_set, state.params[set_name], state.opt_state[set_name], state.ema, lr)
            ema.update(set_ema)
            roles.update(role_m)
            cos.update(set_cos)
        return (TrainState(params, opt_state, ema, state.step),
                StepMetrics(roles={r: roles[r] for r in grads}, sets=sets, cos=cos))

    def _role_grad(self, base, trainable, batch: RoleBatch, role: str, recompute_old: bool) -> RoleGrad:
        """The role's loss on its samples and its gradient w.r.t. its own set's parameters."""
        (loss, (n_seq, terms, gap)), grad = jax.value_and_grad(self.role_loss, has_aux=True)(
            trainable, batch, role, recompute_old, base)
        return RoleGrad(grad, loss, optax.tree.norm(grad), n_seq, terms, gap)

    def role_part(self, base, trainable, batch: RoleBatch, *, role: str, recompute_old: bool) -> RolePart:
        """One micro-batch's `RolePart` of a role: its sums and the gradient of its Σ seq_b (traceable; what
        `accumulated_update` jits per micro-batch, and `marljax.aot` compiles)."""
        (_, part), grad = jax.value_and_grad(self._role_sum, has_aux=True)(trainable, batch, role, recompute_old, base)
        return part._replace(grad=grad)

    def _set_update(self, grads: dict[str, RoleGrad], params, opt_state, ema: dict, lr):
        """Combine the set's role gradients (weights × damping) into G and take one clip + AdamW step;
        skipped (parameters and optimizer state kept) when no role has samples or one is non-finite.
        Returns (params, optimizer state, {role: new EMA}, {role: RoleMetrics}, SetMetrics, {pair: cos})."""
        cfg = self.cfg
        roles = list(grads)
        weights, total = self._role_weights(grads)
        coeffs, damping, new_ema = {}, {}, {}
        for r in roles:
            damp = jnp.float32(1.0)
            if cfg.damping_lambda > 0:
                g = grads[r]
                cos_ema = _tree_dot(g.grad, ema[r]) / jnp.maximum(g.norm * optax.tree.norm(ema[r]), 1e-12)
                damp = 1.0 - cfg.damping_lambda * jnp.clip(cos_ema, 0.0, 1.0)
                mix = jnp.where(g.n_seq > 0, cfg.damping_ema, 1.0)  # absent role: keep EMA
                new_ema[r] = jax.tree.map(lambda e, x: mix * e + (1 - mix) * x, ema[r], g.grad)
                damping[r] = damp
            coeffs[r] = weights[r] * damp
        masses = {r: coeffs[r] * grads[r].norm for r in roles}
        mass_total = sum(masses.values())
        shares = {r: masses[r] / jnp.maximum(mass_total, 1e-12) for r in roles}
        cos = {(a, b): _tree_dot(grads[a].grad, grads[b].grad) / jnp.maximum(grads[a].norm * grads[b].norm, 1e-12)
               for a, b in itertools.combinations(roles, 2)}
        weighted = {r: _scale(grads[r].grad, coeffs[r]) for r in roles}
        g_set = functools.reduce(lambda x, y: jax.tree.map(jnp.add, x, y), weighted.values())
        finite = jnp.all(jnp.stack([jnp.isfinite(grads[r].loss) & jnp.isfinite(grads[r].norm) for r in roles]))
        active = (total > 0) & finite  # a non-finite loss or gradient skips the update
        opt_state = with_learning_rate(opt_state, lr)
        updates, stepped = self.optimizer.update(g_set, opt_state, params)
        updated = optax.apply_updates(params, updates)
        new_params = jax.tree.map(lambda n, o: jnp.where(active, n, o), updated, params)
        new_opt = jax.tree.map(lambda n, o: jnp.where(active, n, o), stepped, opt_state)
        update_shares = _update_shares(weighted, updates)
        role_m = {r: RoleMetrics(
            loss=grads[r].loss, grad_norm=grads[r].norm, n_seq=grads[r].n_seq, terms=grads[r].terms,
            logp_gap=grads[r].gap["logp_gap"], logp_gap_max=grads[r].gap["logp_gap_max"], weight=weights[r],
            grad_mass=masses[r], grad_share=shares[r], update_share=jnp.where(active, update_shares[r], 0.0),
            damping=damping.get(r)) for r in roles}
        set_m = SetMetrics(loss=sum(weights[r] * grads[r].loss for r in roles), grad_norm=optax.tree.norm(g_set),
                           update_norm=jnp.where(active, optax.tree.norm(updates), 0.0),
                           nonfinite=(~finite).astype(jnp.float32), applied=active.astype(jnp.float32))
        return new_params, new_opt, new_ema, role_m, set_m, cos

    def _role_weights(self, grads: dict[str, RoleGrad]) -> tuple[dict[str, jax.Array], jax.Array]:
        """w_r of the set's roles — the weighting normalised to sum to 1 over the set, then times the role's
        same-role scale (after normalising, so that a role alone on its set keeps it) — and the raw total
        (0: no role has samples)."""
        cfg, scale = self.cfg, dict(self.cfg.role_scale)
        present = {r: (g.n_seq > 0).astype(jnp.float32) for r, g in grads.items()}
        if cfg.role_weighting == "count":
            raw = {r: g.n_seq for r, g in grads.items()}
        elif cfg.role_weighting == "equal":
            raw = present
        else:  # inverse_norm
            raw = {r: present[r] / jnp.maximum(g.norm, 1e-12) for r, g in grads.items()}
        total = sum(raw.values())
        return {r: raw[r] / jnp.maximum(total, 1e-12) * scale.get(r, 1.0) for r in grads}, total


def logp_gap(trainer_logp_br, batch: RoleBatch) -> dict[str, jax.Array]:
    """Mean and max |sampler − trainer| logprob over the response tokens of rows that carry sampler
    logprobs (prompt and padding positions excluded; both 0 when no row carries them)."""
    mask_br = batch.resp_mask_br * batch.has_sampler_b[:, None]
    gap_br = jnp.abs(batch.sampler_logp_br - trainer_logp_br) * mask_br
    return {"logp_gap": jnp.sum(gap_br) / jnp.maximum(jnp.sum(mask_br), 1.0), "logp_gap_max": jnp.max(gap_br)}


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
    agent: int = 0  # which of the role's parallel same-role agents made it (the voter / worker slot)


def pack(samples: list[Sample], *, n_bucket: int | None = None) -> RoleBatch:
    """Right-pad samples of one role into bucketed arrays (rows beyond len(samples) are padding)."""
    B = n_bucket or bucket_rows(max(len(samples), 1))
    T = length_bucket(max([len(s.prompt) + len(s.response) for s in samples] + [2]) + 1)
    R = bucket(max([len(s.response) for s in samples] + [1]), 8)
    tokens = np.zeros((B, T), np.int32)
    plen = np.ones((B,), np.int32)
    mask = np.zeros((B, R), np.float32)
    adv = np.zeros((B,), np.float32)
    old = np.zeros((B, R), np.float32)
    sampler = np.zeros((B, R), np.float32)
    has_sampler = np.zeros((B,), np.float32)
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

    `paper`: a set with n samples takes ceil(n / M) mini-batches (same-role scale or not); `balanced`: one
    mini-batch per set. `seed` (paper mode): each
    set's samples are shuffled by a permutation from `numpy.random.default_rng(seed)` and every role's
    samples are then dealt evenly over the k mini-batches, so each carries every role of the set in its
    share (rollouts list calls stage by stage: cut in that order, a shared Voting set would train on
    generator-only, then aggregator-only mini-batches). `seed=None` cuts in rollout order (no shuffle);
    the trainer always passes one.
    """
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
            k = max(1, math.ceil(len(items) / cfg.minibatch_size))
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


def packed_tokens(samples: list[Sample]) -> int:
    """Rows × positions of `pack(samples)`: what one forward/backward over them holds in memory."""
    return bucket_rows(max(len(samples), 1)) * length_bucket(max([len(s.prompt) + len(s.response) for s in samples]
                                                                 + [2]) + 1)


def micro_batches(samples: list[Sample], budget: int, max_rows: int = 0) -> list[list[Sample]]:
    """One role's samples cut into micro-batches of at most `budget` packed tokens (`packed_tokens`) and, with
    `max_rows`, at most that many packed rows (`bucket_rows`: a token budget bounds rows × positions, not
    rows), longest first so each holds samples of similar length (little padding); a sample over the budget
    on its own is a micro-batch of one. `budget` 0: one micro-batch."""
    if budget <= 0 or not samples:
        return [samples]
    out: list[list[Sample]] = [[]]
    for s in sorted(samples, key=lambda s: len(s.prompt) + len(s.response), reverse=True):
        full = max_rows and bucket_rows(len(out[-1]) + 1) > max_rows
        if out[-1] and (full or packed_tokens(out[-1] + [s]) > budget):
            out.append([])
        out[-1].append(s)
    return out


def _with_old_logprobs(trainer: Trainer, params, mb: dict[str, list[RoleBatch]]) -> dict[str, list[RoleBatch]]:
    """`mb` with each batch's `old_logp_br` set to its log-probs under `params`: one call for the
    mini-batch when every role is one batch, one per micro-batch otherwise."""
    if all(len(bs) == 1 for bs in mb.values()):
        logp = trainer.logprobs(params, {r: bs[0] for r, bs in mb.items()})
        return {r: [bs[0]._replace(old_logp_br=logp[r])] for r, bs in mb.items()}
    return {r: [b._replace(old_logp_br=trainer.logprobs(params, {r: b})[r]) for b in bs] for r, bs in mb.items()}


def _pack_role(samples: list[Sample], by_agent: bool, budget: int, max_rows: int
               ) -> tuple[list[RoleBatch], list[int]]:
    """One role's samples of a mini-batch packed as micro-batches (`micro_batches`), each holding one agent's
    samples when `by_agent`, and the agent of each (0 when not split). No samples: one all-masked row."""
    groups: dict[int, list[Sample]] = {}
    for s in (sorted(samples, key=lambda s: s.agent) if by_agent else samples):
        groups.setdefault(s.agent if by_agent else 0, []).append(s)
    batches, agents = [], []
    for agent, group in (groups or {0: []}).items():
        for m in micro_batches(group, budget, max_rows):
            batches.append(pack(m))
            agents.append(agent)
    return batches, agents


def train_batch(trainer: Trainer, state: TrainState, samples: list[Sample], lr: float, *,
                seed: int | None = None, ranks: int = 1) -> tuple[TrainState, BatchMetrics]:
    """All optimizer steps of one training step: the new state (its `step` one higher) and the
    mini-batches' metrics averaged (`step_metrics.average`). `seed`: the mini-batch shuffle (see
    `minibatches`); derive it from (run seed, step) so a resumed run repeats it. With
    `rl.micro_batch_tokens`, each role's part of a mini-batch is cut into micro-batches of at most that many
    tokens (and `rl.micro_batch_rows` rows) per data-parallel rank (`ranks` of them share a micro-batch's
    rows) and their gradients add up (`Trainer.accumulated_update`): the same update, in bounded memory.
    A role with several agents (`Sample.agent`) or in several mini-batches is measured for gradient
    coherence (`marljax.rl.coherence`): its agents' samples then run as separate micro-batches
    (`Trainer.agent_update`), the same update and the same work, cut differently."""
    cfg = trainer.cfg
    mbs = minibatches(samples, cfg, seed=seed)
    roles_present = sorted({s.role for s in samples})
    split = {r for r in roles_present if len({s.agent for s in samples if s.role == r}) > 1}
    coherence = {r: Coherence.zeros_like(state.params[cfg.set_of(r)])
                 for r, k in collections.Counter(r for mb in mbs for r in mb).items() if k > 1}
    budget, rows = cfg.micro_batch_tokens * ranks, cfg.micro_batch_rows * ranks
    # every role appears in every call (empty → one all-masked row) so one compilation serves all
    cut = [{r: _pack_role(mb.get(r, []), r in split, budget, rows) for r in roles_present} for mb in mbs]
    packed = [{r: bs for r, (bs, _) in mb.items()} for mb in cut]
    recompute_old = len(packed) > 1
    if recompute_old:  # old log-probs under the parameters before the first update (PPO semantics)
        packed = [_with_old_logprobs(trainer, state.params, mb) for mb in packed]
    # a set stepping more than once keeps a copy of its parameters for its step delta (updates donate them)
    steps_of = collections.Counter(s for mb in mbs for s in {cfg.set_of(r) for r in mb})
    before = {s: jax.tree.map(jnp.copy, state.params[s]) for s, k in steps_of.items() if k > 1}
    per_mb, agent_cos = [], collections.defaultdict(list)
    for mb, labelled in zip(packed, cut):
        if split or coherence:
            state, m, cos = trainer.agent_update(state, mb, {r: a for r, (_, a) in labelled.items()},
                                                 jnp.float32(lr), recompute_old=recompute_old, coherence=coherence,
                                                 fuse=budget == 0)
            for r, v in cos.items():
                agent_cos[r].append(v)
        elif budget > 0:
            state, m = trainer.accumulated_update(state, mb, jnp.float32(lr), recompute_old=recompute_old)
        else:
            state, m = trainer.update(state, {r: bs[0] for r, bs in mb.items()}, jnp.float32(lr),
                                      recompute_old=recompute_old)
        per_mb.append(jax.device_get(m))
    out = average(per_mb, cfg.sets)
    out.step_delta = {s: float(_distance(state.params[s], before[s])) if s in before else  # else ≤ 1 update
                      sum(float(m.sets[s].update_norm) for m in per_mb if s in m.sets) for s in cfg.sets}
    out.agent_grad_cos = {r: float(np.mean(v)) for r, v in agent_cos.items()}
    out.minibatch_grad_cos = {r: c for r, acc in coherence.items() if (c := mean_cos(acc)) is not None}
    return state.replace(step=state.step + 1), out


@jax.jit
def _distance(a, b) -> jax.Array:
    return optax.tree.norm(jax.tree.map(jnp.subtract, a, b))
