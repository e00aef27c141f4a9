"""What one RL update measures, as typed pytrees: per role, per parameter set, per pair of roles on a set.

The jitted step (`marljax.rl.step.Trainer.update`) returns a `StepMetrics` of scalar arrays; `average`
folds the mini-batches of one training step into a `BatchMetrics` of floats; code that decides (skip a
non-finite update, track the dominant role) reads their fields, and `BatchMetrics.record` makes the
flat `role/<r>/<name>`, `set/<s>/<name>`, `cos/<a>/<b>` strings at the logging edge. See
`marljax.rl.step`'s docstring for what each quantity means.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from flax import struct


@struct.dataclass
class RoleMetrics:
    """One role's share of an update (scalars)."""

    loss: jax.Array  # the role's own loss on its samples
    grad_norm: jax.Array  # ‖g_r‖
    n_seq: jax.Array  # the loss's normaliser (sequences or tokens); 0: the role is absent
    terms: dict[str, jax.Array]  # `losses.sequence_losses`' metrics (pg_loss, ppo_kl, clip_frac, …)
    logp_gap: jax.Array  # mean |sampler − trainer| logprob
    logp_gap_max: jax.Array  # max of the same
    weight: jax.Array  # w_r
    grad_mass: jax.Array  # ‖c_r g_r‖
    grad_share: jax.Array  # mass_r / Σ mass over the set
    update_share: jax.Array  # ⟨c_r g_r, U⟩ / ⟨G, U⟩ (0 when the set applied no update)
    damping: jax.Array | None = None  # d_r; None without coherence damping


@struct.dataclass
class SetMetrics:
    """One parameter set's update (scalars)."""

    loss: jax.Array  # Σ_r w_r L_r
    grad_norm: jax.Array  # ‖G‖
    update_norm: jax.Array  # ‖U‖ (0 when skipped)
    nonfinite: jax.Array  # 1 when a role's loss or gradient was not finite (the update was skipped)
    applied: jax.Array  # 1 when the optimizer step was applied


@struct.dataclass
class StepMetrics:
    """One jitted update: roles of the mini-batch, sets they train, cos(g_a, g_b) of roles sharing a set."""

    roles: dict[str, RoleMetrics]
    sets: dict[str, SetMetrics]
    cos: dict[tuple[str, str], jax.Array]


@dataclasses.dataclass
class BatchMetrics:
    """A training step's updates, averaged over its mini-batches (floats; see `average`)."""

    roles: dict[str, RoleMetrics]
    sets: dict[str, SetMetrics]
    cos: dict[tuple[str, str], float]
    opt_steps: dict[str, int]  # optimizer steps applied per set (every set of the policy, 0 if none)
    step_delta: dict[str, float] = dataclasses.field(default_factory=dict)  # ‖θ_after − θ_before‖ per set
    # mean pairwise cos between a role's agents' gradients in a mini-batch (averaged over mini-batches), and
    # between its mini-batches' gradients in the step (`marljax.rl.coherence`); only roles with ≥ 2 of them
    agent_grad_cos: dict[str, float] = dataclasses.field(default_factory=dict)
    minibatch_grad_cos: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def loss(self) -> float:
        """The step's loss: the mean over the sets that trained (the policy's order: `opt_steps`) of each
        set's loss; NaN when none did."""
        losses = [self.sets[s].loss for s in self.opt_steps if s in self.sets]
        return float(np.mean(losses)) if losses else float("nan")

    @property
    def grad_norm(self) -> float:
        """√(Σ over the policy's sets of ‖G_s‖²), a set that did not train counting 0."""
        return float(np.sqrt(sum((self.sets[s].grad_norm if s in self.sets else 0.0) ** 2 for s in self.opt_steps)))

    @property
    def nonfinite(self) -> bool:
        """The update was skipped somewhere: a non-finite loss, or a set whose loss or gradient was not finite."""
        return not math.isfinite(self.loss) or any(bool(m.nonfinite) for m in self.sets.values())

    def record(self) -> dict:
        """The flat metrics record: `role/<r>/<name>` (the coherence cosines too), `set/<s>/<name>`,
        `cos/<a>/<b>` in sorted order, then `set/<s>/opt_steps` and `set/<s>/step_delta` per set."""
        flat = {}
        for r, m in self.roles.items():
            fields = {f.name: getattr(m, f.name) for f in dataclasses.fields(m) if f.name != "terms"}
            for name, v in {**fields, **m.terms}.items():
                if v is not None:
                    flat[f"role/{r}/{name}"] = v
        for s, m in self.sets.items():
            flat.update({f"set/{s}/{f.name}": getattr(m, f.name) for f in dataclasses.fields(m)
                         if f.name != "applied"})
        flat.update({f"cos/{a}/{b}": v for (a, b), v in self.cos.items()})
        for name in ("agent_grad_cos", "minibatch_grad_cos"):
            flat.update({f"role/{r}/{name}": v for r, v in getattr(self, name).items()})
        return {**dict(sorted(flat.items())), **{f"set/{s}/opt_steps": n for s, n in self.opt_steps.items()},
                **{f"set/{s}/step_delta": d for s, d in self.step_delta.items()}}


def _mean(values) -> float:
    total = 0.0
    for v in values:
        total += float(v)
    return total / len(values)


def _worst(values) -> float:
    worst = 0.0
    for v in values:
        worst = max(worst, float(v))
    return worst


def average(steps: list[StepMetrics], sets: tuple[str, ...]) -> BatchMetrics:
    """Mini-batch means of host-side `StepMetrics` (`sets`: every set of the policy). A role's means run
    over the mini-batches that hold it (`n_seq` > 0), a set's over those it took part in (its update
    applied, or skipped as non-finite): an absent role or set does not dilute them; `logp_gap_max` and a
    set's `nonfinite` take the worst mini-batch; `opt_steps` counts the applied updates."""
    roles = {}
    for r in dict.fromkeys(r for m in steps for r in m.roles):
        every = [m.roles[r] for m in steps if r in m.roles]
        held = [m for m in every if float(m.n_seq) != 0]
        if held:
            roles[r] = jax.tree.map(lambda *v: _mean(v), *held).replace(
                logp_gap_max=_worst(m.logp_gap_max for m in every))
    out_sets = {}
    for s in dict.fromkeys(s for m in steps for s in m.sets):
        every = [m.sets[s] for m in steps if s in m.sets]
        held = [m for m in every if float(m.applied) > 0 or float(m.nonfinite) > 0] or every
        out_sets[s] = jax.tree.map(lambda *v: _mean(v), *held).replace(
            nonfinite=_worst(m.nonfinite for m in every))
    cos = {pair: _mean([m.cos[pair] for m in steps if pair in m.cos])
           for pair in dict.fromkeys(p for m in steps for p in m.cos)}
    opt_steps = {s: sum(int(m.sets[s].applied > 0) for m in steps if s in m.sets) for s in sets}
    return BatchMetrics(roles, out_sets, cos, opt_steps)


@dataclasses.dataclass(frozen=True)
class StepTimes:
    """Wall seconds of one training step: its rollout, its update, the whole step."""

    rollout_s: float
    update_s: float
    step_s: float


@dataclasses.dataclass
class TrainRecord:
    """One training step, typed: the loop decides on its fields, and `record` makes the flat log record.

    `rollout` and `advantages` are flat already (`marljax.workflows.metrics.rollout_metrics`,
    `rl.advantages.Advantages.metrics`): the workflow layer's own logging edge."""

    step: int
    lr: float
    rollout: dict[str, float]
    advantages: dict[str, float]
    update: BatchMetrics
    n_samples: dict[str, int]  # per workflow role: its calls in the batch (empty responses too)
    response_tokens: int  # response tokens the update trained on
    times: StepTimes
    dominant_share: float  # `DominanceTracker.index()`
    dominant_role: str | None
    length_drift: dict[str, float]  # per role with calls: mean response length / its first (`LengthDrift`)

    def record(self) -> dict:
        """`step`, `lr`, the rollout's and the advantages' metrics, the update's (`BatchMetrics.record`),
        `role/<r>/n_samples`, `loss`, `grad_norm`, `time/…`, `throughput/response_tok_s`,
        `diag/dominant_share` (and `diag/dominant_role` when one dominates), `role/<r>/length_drift`."""
        t = self.times
        out = {"step": self.step, "lr": self.lr, **self.rollout, **self.advantages, **self.update.record()}
        out.update({f"role/{r}/n_samples": n for r, n in self.n_samples.items()})
        out.update({"loss": self.update.loss, "grad_norm": self.update.grad_norm,
                    "time/rollout_s": t.rollout_s, "time/update_s": t.update_s, "time/step_s": t.step_s,
                    "throughput/response_tok_s": self.response_tokens / max(t.step_s, 1e-9),
                    "diag/dominant_share": self.dominant_share})
        if self.dominant_role is not None:
            out["diag/dominant_role"] = self.dominant_role
        out.update({f"role/{r}/length_drift": v for r, v in self.length_drift.items()})
        return out
