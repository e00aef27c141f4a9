"""Evaluator-Optimizer: the generator solves, the evaluator judges, the generator refines, in one chat.

Turn structure (the paper's): generator turn 0; then for t = 0 .. max_iterations-1 the evaluator judges
the latest solution (turn t), and unless its verdict is Correct or t is the last iteration, the generator
refines (turn t+1). Both roles see one growing chat: the problem prompt, then every generator and
evaluator output as assistant messages; each call appends its own instruction as the final user message,
which is not kept in the chat. An unparsable verdict counts as not satisfied. The final answer is the
last generator output.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from marljax.tasks.problem import Problem
from marljax.workflows.base import (EVALUATOR, GENERATOR, CallRecord, EpisodeScript, Outcome, RoleCall, SamplerStage,
                                    Workflow, assistant, last_boxed, user)
from marljax.workflows.limits import MAX_ITERATIONS
from marljax.workflows.registry import register


def parse_verdict(text: str) -> str | None:
    """"correct" / "incorrect" from the last `\\boxed{Correct|Incorrect}`, else None (unparsable)."""
    verdict = last_boxed(text, "correct|incorrect")
    return verdict.lower() if verdict else None


@register
@dataclasses.dataclass(frozen=True)
class EvalOpt(Workflow):
    """`max_iterations`: evaluator calls per episode at most (= generator calls at most); None → the
    paper's by problem kind (`workflows.limits`: 3 for math, 2 for code)."""

    max_iterations: int | None = None

    name = "eval_opt"
    paper_matrix = True
    roles = (GENERATOR, EVALUATOR)
    graded_roles = frozenset({GENERATOR})
    max_prompt_tokens = {"math": 30720, "code": 10240}

    def __post_init__(self):
        if self.max_iterations is not None and self.max_iterations < 1:
            raise ValueError(f"max_iterations must be >= 1, got {self.max_iterations}")

    def iterations(self, kind: str) -> int:
        return self.max_iterations if self.max_iterations is not None else MAX_ITERATIONS[kind]

    def sampler_stages(self, kind: str) -> tuple[SamplerStage, ...]:
        """Generator turn k sees k solutions and k verdicts; evaluator turn k one more solution."""
        return tuple(SamplerStage(role, 1, responses=2 * k + (role == EVALUATOR))
                     for k in range(self.iterations(kind)) for role in (GENERATOR, EVALUATOR))

    def episode(self, problem: Problem) -> EpisodeScript:
        prompts = self.prompts(problem.kind)
        chat = (user(prompts.solve.format(problem=problem.question)),)
        [answer] = yield [RoleCall(GENERATOR, 0, 0, chat)]
        chat += (assistant(answer),)
        verdicts = []
        n = self.iterations(problem.kind)
        for turn in range(n):
            [review] = yield [RoleCall(EVALUATOR, 0, turn, chat + (user(prompts.evaluate),))]
            chat += (assistant(review),)
            verdicts.append(parse_verdict(review))
            if verdicts[-1] == "correct" or turn == n - 1:
                break
            [answer] = yield [RoleCall(GENERATOR, 0, turn + 1, chat + (user(prompts.refine),))]
            chat += (assistant(answer),)
        return Outcome(answer, {"eval_opt_turns": len(verdicts), "verdicts": verdicts})

    def parse_failed(self, role: str, text: str, kind: str) -> bool:
        if role == EVALUATOR:
            return parse_verdict(text) is None
        return super().parse_failed(role, text, kind)

    def score_calls(self, calls: Sequence[CallRecord], grade: Callable[[str], float]) -> list[float | None]:
        """Generators: their answer graded. Evaluator at turn t: 1 iff its verdict matches the truth of
        the generator output of turn t (the one it judged); an unparsable verdict scores 0."""
        judged = {c.turn: grade(c.text) for c in calls if c.role == GENERATOR}
        return [float(parse_verdict(c.text) == ("correct" if judged[c.turn] == 1.0 else "incorrect"))
                if c.role == EVALUATOR else grade(c.text) for c in calls]
