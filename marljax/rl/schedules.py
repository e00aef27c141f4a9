"""Learning-rate schedules by name (the config's `optim.schedule`): a linear warm-up, then the named
schedule, indexed by training step (1-based). Register another with `@SCHEDULES.register(name)`."""
from __future__ import annotations

import math
from collections.abc import Callable

from marljax.rl.registry import Registry

ScheduleFn = Callable[[float, int, int, int], float]  # (peak lr, step, warmup_steps, total_steps) -> lr
SCHEDULES: Registry[ScheduleFn] = Registry("learning-rate schedule")


@SCHEDULES.register("cosine")
def cosine(lr: float, step: int, warmup_steps: int, total_steps: int) -> float:
    """Cosine from `lr` after the warm-up to 0 at `total_steps` (and 0 beyond)."""
    span = max(total_steps - warmup_steps, 1)
    return lr * 0.5 * (1 + math.cos(math.pi * min(step - warmup_steps, span) / span))


@SCHEDULES.register("constant")
def constant(lr: float, step: int, warmup_steps: int, total_steps: int) -> float:
    return lr


def lr_at(schedule: str, lr: float, step: int, warmup_steps: int, total_steps: int) -> float:
    """The learning rate of training step `step`: `lr · step / warmup_steps` during the warm-up, else
    the schedule's."""
    if warmup_steps > 0 and step <= warmup_steps:
        return lr * step / warmup_steps
    return SCHEDULES.get(schedule)(lr, step, warmup_steps, total_steps)
