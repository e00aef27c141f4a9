"""Voting: `n_votes` generators solve from the identical prompt; an aggregator picks one by `\\boxed{i}`.

All voters are role `generator` (one parameter set) with slots 0..n_votes-1, and each slot is its own
GRPO group under the paper preset. The reward is the chosen candidate's.
"""
from __future__ import annotations

import dataclasses
import re

from marljax.tasks.problem import Problem
from marljax.workflows.base import (AGGREGATOR, GENERATOR, EpisodeScript, Outcome, RoleCall, SamplerStage, Workflow,
                                    user)
from marljax.workflows.prompts import format_solutions
from marljax.workflows.registry import register


@dataclasses.dataclass(frozen=True)
class Choice:
    index: int  # 1-based candidate number
    source: str  # "boxed" | "digit" (first standalone digit 1-9) | "default" (candidate 1)


_BOXED_NUMBER = re.compile(r"\\boxed\{(\d+)\}")
_STANDALONE_DIGIT = re.compile(r"\b[1-9]\b")


def parse_choice(text: str, n: int) -> Choice:
    """The aggregator's pick among n candidates, as the paper's parser reads it: the first `\\boxed{i}`
    (digits only, nothing else inside the braces) if 1 <= i <= n; else the first standalone digit 1-9 of
    the text if it names a candidate; else candidate 1. Only the first match of each rule counts."""
    boxed = _BOXED_NUMBER.search(text)
    if boxed is not None and 1 <= int(boxed.group(1)) <= n:
        return Choice(int(boxed.group(1)), "boxed")
    digit = _STANDALONE_DIGIT.search(text)
    if digit is not None and int(digit.group()) <= n:
        return Choice(int(digit.group()), "digit")
    return Choice(1, "default")


@register
@dataclasses.dataclass(frozen=True)
class Voting(Workflow):
    n_votes: int = 3

    name = "voting"
    paper_matrix = True
    roles = (GENERATOR, AGGREGATOR)
    graded_roles = frozenset({GENERATOR})
    slot_grouped_roles = frozenset({GENERATOR})
    max_prompt_tokens = {"math": 20480, "code": 10240}

    def __post_init__(self):
        if self.n_votes < 1:
            raise ValueError(f"n_votes must be >= 1, got {self.n_votes}")

    def same_role_counts(self) -> dict[str, int]:
        return {GENERATOR: self.n_votes}

    def sampler_stages(self, kind: str) -> tuple[SamplerStage, ...]:
        return SamplerStage(GENERATOR, self.n_votes), SamplerStage(AGGREGATOR, 1, responses=self.n_votes)

    def episode(self, problem: Problem) -> EpisodeScript:
        prompts = self.prompts(problem.kind)
        solve = (user(prompts.solve.format(problem=problem.question)),)
        candidates = yield [RoleCall(GENERATOR, slot, 0, solve) for slot in range(self.n_votes)]
        pick = prompts.aggregate.format(problem=problem.question, solutions=format_solutions(candidates),
                                        n=self.n_votes)
        [verdict] = yield [RoleCall(AGGREGATOR, 0, 0, (user(pick),))]
        choice = parse_choice(verdict, self.n_votes)
        return Outcome(candidates[choice.index - 1], {"choice": choice.index, "choice_source": choice.source})

    def parse_failed(self, role: str, text: str, kind: str) -> bool:
        if role == AGGREGATOR:
            return parse_choice(text, self.n_votes).source != "boxed"
        return super().parse_failed(role, text, kind)
