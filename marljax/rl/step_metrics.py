"""What one RL update measures, as typed pytrees: per role, per parameter set, per pair of roles on a set.

The jitted step (`marljax.rl.step.Trainer.update`) returns a `StepMetrics` of scalar arrays; `average`
folds the mini-batches of one training step into a `BatchMetrics` of floats; code that decides (skip a
non-finite update, track the dominant role) reads their fields, and `BatchMetrics.record` makes the
flat `role/<r>/<name>`, `set/<s>/<name>`, `cos/<a>/<b>` strings at the logging edge. See
`marljax.rl.step`'s docstring for what each quantity means.
"""
from __future__ import annotations

import dataclasses

import jax
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
