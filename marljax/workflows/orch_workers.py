"""Orchestrator-Workers: an orchestrator proposes strategies, one worker per strategy solves the full
problem with it, and a synthesizer compares the worker solutions and writes the final answer.

Strategies are parsed from `STRATEGY k:` headers; failing that from a numbered list (`1.` / `1)`);
failing that every non-empty line longer than 10 characters is one; at most `max_subtasks` are kept.
With zero strategies (blank or only short lines) the episode still runs: one worker solves the problem
with the plain solve prompt and no strategy, so every episode trains all three roles; the orchestrator's
output counts as a parse failure and `n_strategies` is 0. Workers are pooled into one GRPO group per
problem (their slots are not separate groups).
"""
from __future__ import annotations

import dataclasses
import re

from marljax.tasks.problem import Problem
from marljax.workflows.base import (ORCHESTRATOR, SYNTHESIZER, WORKER, EpisodeScript, Outcome, RoleCall, SamplerStage,
                                    Workflow, user)
from marljax.workflows.prompts import format_solutions
from marljax.workflows.registry import register

_STRATEGY_HEADER = re.compile(r"STRATEGY\s*(\d+)\s*:", re.IGNORECASE)
_NUMBERED_HEADER = re.compile(r"^[ \t]*(\d+)[.)][ \t]+", re.MULTILINE)


@dataclasses.dataclass(frozen=True)
class Strategies:
    items: tuple[str, ...]
    source: str  # "strategy" | "numbered" | "lines" | "none"


def _numbered_items(text: str, header: re.Pattern) -> list[str]:
    """Texts following each header match, up to the next one, ordered by the header's number."""
    heads = list(header.finditer(text))
    items = [(int(h.group(1)), text[h.end(): nxt.start() if nxt else len(text)].strip(" \t\n*"))
             for h, nxt in zip(heads, heads[1:] + [None])]
    return [body for _, body in sorted(items, key=lambda item: item[0]) if body]


def parse_strategies(text: str, max_subtasks: int) -> Strategies:
    """The orchestrator's strategies, by the first rule that yields any, truncated to `max_subtasks`."""
    for source, items in (
        ("strategy", lambda: _numbered_items(text, _STRATEGY_HEADER)),
        ("numbered", lambda: _numbered_items(text, _NUMBERED_HEADER)),
        ("lines", lambda: [line.strip() for line in text.splitlines() if len(line.strip()) > 10]),
    ):
        found = items()
        if found:
            return Strategies(tuple(found[:max_subtasks]), source)
    return Strategies((), "none")


@register
@dataclasses.dataclass(frozen=True)
class OrchWorkers(Workflow):
    max_subtasks: int = 3

    name = "orch_workers"
    paper_matrix = True
    roles = (ORCHESTRATOR, WORKER, SYNTHESIZER)
    graded_roles = frozenset({WORKER})
    max_prompt_tokens = {"math": 20480, "code": 10240}

    def __post_init__(self):
        if self.max_subtasks < 1:
            raise ValueError(f"max_subtasks must be >= 1, got {self.max_subtasks}")

    def same_role_counts(self) -> dict[str, int]:
        return {WORKER: self.max_subtasks}

    def sampler_stages(self, kind: str) -> tuple[SamplerStage, ...]:
        """Each worker sees one strategy; the synthesizer every solution with its strategy."""
        m = self.max_subtasks
        return (SamplerStage(ORCHESTRATOR, 1), SamplerStage(WORKER, m, notes=1),
                SamplerStage(SYNTHESIZER, 1, responses=m, notes=m))

    def episode(self, problem: Problem) -> EpisodeScript:
        prompts = self.prompts(problem.kind)
        q = problem.question
        propose = prompts.propose.format(problem=q, max_subtasks=self.max_subtasks)
        [plan] = yield [RoleCall(ORCHESTRATOR, 0, 0, (user(propose),))]
        strategies = parse_strategies(plan, self.max_subtasks)
        assigned = list(strategies.items) or [None]
        work = [prompts.solve.format(problem=q) if s is None else prompts.work.format(problem=q, strategy=s)
                for s in assigned]
        solutions = yield [RoleCall(WORKER, slot, 0, (user(w),)) for slot, w in enumerate(work)]
        judge = prompts.synthesize.format(problem=q, solutions=format_solutions(solutions, assigned))
        [final] = yield [RoleCall(SYNTHESIZER, 0, 0, (user(judge),))]
        return Outcome(final, {"n_strategies": len(strategies.items), "strategies": list(strategies.items),
                               "strategy_source": strategies.source})

    def parse_failed(self, role: str, text: str, kind: str) -> bool:
        if role == ORCHESTRATOR:
            return parse_strategies(text, self.max_subtasks).source != "strategy"
        return super().parse_failed(role, text, kind)
