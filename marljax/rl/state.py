"""The trainer's state: one pytree that the jitted step threads through and Orbax saves as it is."""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct


@struct.dataclass
class TrainState:
    """Everything an update reads and writes.

    params     {set: trainable parameters}: the LoRA adapter, or the whole model under full fine-tuning
    opt_state  {set: optax state of that set's optimizer}
    ema        {role: EMA of the role's gradient}, laid out like its set's parameters; empty without
               coherence damping (`rl.damping_lambda` 0)
    step       int32 []: training steps whose updates the parameters carry (a rollback to the peak of
               step k brings back k)
    """

    params: dict[str, Any]
    opt_state: dict[str, Any]
    ema: dict[str, Any]
    step: jax.Array

    @classmethod
    def create(cls, params: dict, optimizer: optax.GradientTransformation, ema_roles: dict[str, str]
               ) -> TrainState:
        """Step 0: fresh optimizer states, and a zero EMA per damped role (`ema_roles`: {role: its set})."""
        return cls(params=params, opt_state={s: optimizer.init(p) for s, p in params.items()},
                   ema={r: jax.tree.map(jnp.zeros_like, params[s]) for r, s in ema_roles.items()},
                   step=jnp.zeros((), jnp.int32))


def with_learning_rate(opt_state, lr):
    """`opt_state` with the learning rate of its `optax.inject_hyperparams` stage set to `lr` (by name, so
    the optimizer's chain may change shape)."""
    return optax.tree_utils.tree_set(opt_state, learning_rate=lr)
