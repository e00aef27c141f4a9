"""Single-agent control: one generator call; its output is the final answer."""
from __future__ import annotations

import dataclasses

from marljax.tasks.problem import Problem
from marljax.workflows.base import GENERATOR, EpisodeScript, Outcome, RoleCall, SamplerStage, Workflow, user
from marljax.workflows.registry import register


@register
@dataclasses.dataclass(frozen=True)
class SingleAgent(Workflow):
    name = "single"
    roles = (GENERATOR,)
    graded_roles = frozenset({GENERATOR})
    max_prompt_tokens = {"math": 15360, "code": 4096}

    def sampler_stages(self, kind: str) -> tuple[SamplerStage, ...]:
        return (SamplerStage(GENERATOR, 1),)

    def episode(self, problem: Problem) -> EpisodeScript:
        prompt = self.prompts(problem.kind).solve.format(problem=problem.question)
        [answer] = yield [RoleCall(GENERATOR, 0, 0, (user(prompt),))]
        return Outcome(answer, {})
