"""Gradient coherence: the mean pairwise cosine of a stream of gradients, kept without keeping them.

The same-role amplification argument (SPEC "Findings": parallel same-role agents with the same advantage
add coherent gradients) is a claim about directions, so the step measures them: `agent_grad_cos` between
the gradients of a role's parallel agents (voter / worker slots) in one mini-batch, `minibatch_grad_cos`
between the role's gradients of the mini-batches of one training step (see `marljax.rl.step`).

For k unit vectors u_i, Σ_{i<j} ⟨u_i, u_j⟩ = Σ_j ⟨u_j, u_1 + … + u_{j−1}⟩: one running sum of unit vectors
(the size of one gradient, whatever k) and a scalar give the mean over the k(k−1)/2 pairs, with no
cancellation between large terms. A zero gradient (a mini-batch whose advantages are all 0) has no
direction and is left out; fewer than two directions give no value (None), not a made-up 1.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax


class Coherence(NamedTuple):
    """Running sums over the gradients seen so far (a pytree, updated by the jitted `add`)."""

    unit_sum: dict  # Σ_i g_i / ‖g_i‖, laid out like a gradient
    pair_sum: jax.Array  # Σ_{i<j} cos(g_i, g_j)
    count: jax.Array  # gradients with a direction (‖g‖ > 0)

    @classmethod
    def zeros_like(cls, grad) -> Coherence:
        """Empty sums, each placed like its gradient leaf (sharded as the parameters are, on every host)."""
        zeros = jax.tree.map(lambda x: jnp.zeros_like(x, dtype=jnp.float32), grad)
        return cls(zeros, jnp.float32(0.0), jnp.float32(0.0))


@jax.jit
def add(acc: Coherence, grad) -> Coherence:
    """`acc` with one more gradient: its cosines with every earlier one added to the pair sum."""
    norm = optax.tree.norm(grad)
    has_direction = norm > 0
    unit = jax.tree.map(lambda x: x.astype(jnp.float32) / jnp.where(has_direction, norm, 1.0), grad)
    dot = sum(jnp.vdot(u, s) for u, s in zip(jax.tree.leaves(unit), jax.tree.leaves(acc.unit_sum)))
    return Coherence(jax.tree.map(lambda s, u: s + jnp.where(has_direction, u, 0.0), acc.unit_sum, unit),
                     acc.pair_sum + jnp.where(has_direction, dot, 0.0),
                     acc.count + has_direction.astype(jnp.float32))


def mean_cos(acc: Coherence) -> float | None:
    """The mean pairwise cosine of the gradients added; None with fewer than two that have a direction."""
    k = int(acc.count)
    return float(acc.pair_sum) / (k * (k - 1) / 2) if k >= 2 else None

