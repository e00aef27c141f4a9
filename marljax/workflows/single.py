"""Single-agent control: one generator call; its output is the final answer."""
from __future__ import annotations

import dataclasses

from marljax.tasks.problem import Problem
from marljax.workflows.base import GENERATOR, EpisodeScript, Outcome, RoleCall, Workflow, user


@dataclasses.dataclass(frozen=True)
class SingleAgent(Workflow):
    name = "single"
    roles = (GENERATOR,)
    graded_roles = frozenset({GENERATOR})

    def episode(self, problem: Problem) -> EpisodeScript:
        prompt = self.prompts(problem.kind).solve.format(problem=problem.question)
        [answer] = yield [RoleCall(GENERATOR, 0, 0, (user(prompt),))]
        return Outcome(answer, {})
