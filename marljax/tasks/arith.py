"""Synthetic arithmetic word problems with exact gold answers: the offline math task for small runs and
for end-to-end tests. Deterministic per (seed, split); difficulty knobs: number of operands, digits per
operand, the operations used, and the chance of an irrelevant (distractor) sentence."""
from __future__ import annotations

import dataclasses
import random

from marljax.tasks.problem import Problem

_NAMES = ("Ava", "Ben", "Chloe", "Dev", "Emma", "Farid", "Grace", "Hugo", "Iris", "Jonas", "Kira", "Liam")
_ITEMS = ("apples", "marbles", "stickers", "coins", "books", "pencils", "shells", "cards", "stamps")


@dataclasses.dataclass(frozen=True)
class ArithConfig:
    """Difficulty knobs. `operations` is a subset of "+-*/" (division always divides evenly, subtraction
    never goes below zero); `distractor` is the probability of one irrelevant sentence."""

    operands: int = 3
    digits: int = 2
    operations: str = "+-"
    distractor: float = 0.0

    def __post_init__(self):
        if self.operands < 2 or self.digits < 1 or not 0.0 <= self.distractor <= 1.0:
            raise ValueError(f"{self}: need operands >= 2, digits >= 1 and 0 <= distractor <= 1.")
        if not self.operations or set(self.operations) - set("+-*/"):
            raise ValueError(f"operations={self.operations!r}: use a non-empty subset of '+-*/'.")


def _step(rng: random.Random, op: str, total: int, digits: int, name: str, item: str) -> tuple[str, int]:
    """One sentence applying `op` to the running total, and the new total."""
    hi = 10 ** digits - 1
    if op == "+":
        b = rng.randint(1, hi)
        return f"Then {name} gets {b} more {item}.", total + b
    if op == "-" and total > 0:
        b = rng.randint(1, min(hi, total))
        return f"Then {name} gives away {b} {item}.", total - b
    if op == "*":
        b = rng.randint(2, max(2, min(hi, 9)))
        return f"Then the number of {item} {name} has becomes {b} times as large.", total * b
    if op == "/" and total > 1:
        divisors = [d for d in range(2, min(total, hi) + 1) if total % d == 0]
        if divisors:
            b = rng.choice(divisors)
            return f"Then {name} splits the {item} equally into {b} groups and keeps one group.", total // b
    return _step(rng, "+", total, digits, name, item)  # the operation does not apply to this total


def generate(n: int, seed: int = 0, split: str = "train", config: ArithConfig = ArithConfig()) -> list[Problem]:
    """`n` problems; the same (seed, split, config) always gives the same problems, and "train" and
    "test" use independent streams."""
    rng = random.Random(f"arith/{split}/{seed}")  # str seeds hash with SHA-512: stable across processes
    problems = []
    for i in range(n):
        name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
        total = rng.randint(1, 10 ** config.digits - 1)
        sentences = [f"{name} has {total} {item}."]
        for _ in range(config.operands - 1):
            sentence, total = _step(rng, rng.choice(config.operations), total, config.digits, name, item)
            sentences.append(sentence)
        if rng.random() < config.distractor:  # someone else's count of something else
            other = rng.choice([x for x in _NAMES if x != name])
            count, things = rng.randint(1, 10 ** config.digits - 1), rng.choice([x for x in _ITEMS if x != item])
            sentences.insert(rng.randint(1, len(sentences)), f"{other} has {count} {things}.")
        question = " ".join(sentences) + f" How many {item} does {name} have now?"
        problems.append(Problem(id=f"arith/{split}/{seed}/{i}", question=question, kind="math",
                                answer=str(total), meta={"config": dataclasses.asdict(config)}))
    return problems
