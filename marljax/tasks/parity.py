"""Parity: a pipeline smoke-test task for random models, not a benchmark.

The reward is 1 iff the final answer text has an even number of characters, a property a seeded random
model (`tiny-qwen3`) meets about half the time. On `arith` such a model earns 0 on every problem, so every
advantage, loss and gradient of an end-to-end test is exactly 0 and "equal after resume" compares zeros;
on `parity` GRPO groups disagree, gradients are non-zero and the adapters move. The problems are math
problems (`kind="math"`: the workflows' math prompts) whose question asks for an even-length answer.
"""
from __future__ import annotations

import dataclasses
import random

from marljax.tasks.problem import Problem

_WORDS = ("red", "blue", "green", "stone", "river", "cloud", "seven", "lamp", "orbit", "maple")


@dataclasses.dataclass(frozen=True)
class ParityProblem(Problem):
    """A Problem whose reward is the character-count parity of the response (1.0 when even)."""

    def reward(self, response: str) -> float:
        return float(len(response) % 2 == 0)


def generate(n: int, seed: int = 0, split: str = "train") -> list[Problem]:
    """`n` problems, deterministic per (seed, split); "train" and "test" use independent streams."""
    rng = random.Random(f"parity/{split}/{seed}")  # str seeds hash with SHA-512: stable across processes
    return [ParityProblem(id=f"parity/{split}/{seed}/{i}", kind="math",
                          question=f"Write a reply about '{rng.choice(_WORDS)} {rng.choice(_WORDS)}' whose "
                                   "length in characters is even.")
            for i in range(n)]
