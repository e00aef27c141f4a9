"""The paper's per-call limits, by problem kind and workflow (SPEC §1): the one table that config keys
left at `None` resolve from (`marljax.config.resolve`), that Eval-Opt takes its iteration count from,
and that the experiment matrix sizes its cells by.

- response: tokens one role call may generate (math 5120, code 2048);
- prompt: tokens one role call's prompt may hold; a longer prompt ends the episode (see
  `workflows.base.rollout`). Math: Eval-Opt 30720, Voting and Orch-Workers 20480, single 15360; code:
  every multi-agent workflow 10240, single 4096;
- iterations: Eval-Opt's evaluator calls at most (math 3, code 2).
"""
from __future__ import annotations

import dataclasses

KINDS = ("math", "code")
MAX_RESPONSE_TOKENS = {"math": 5120, "code": 2048}
MAX_ITERATIONS = {"math": 3, "code": 2}
_MAX_PROMPT_TOKENS = {
    "math": {"single": 15360, "eval_opt": 30720, "voting": 20480, "orch_workers": 20480},
    "code": {"single": 4096, "eval_opt": 10240, "voting": 10240, "orch_workers": 10240},
}


@dataclasses.dataclass(frozen=True)
class Limits:
    response: int
    prompt: int
    iterations: int


def paper_limits(kind: str, workflow: str) -> Limits:
    """The paper's limits for a problem kind ("math" | "code") and a workflow name."""
    if kind not in KINDS:
        raise ValueError(f"No paper limits for problem kind {kind!r}; known: {KINDS}.")
    prompts = _MAX_PROMPT_TOKENS[kind]
    if workflow not in prompts:
        raise ValueError(f"No paper limits for workflow {workflow!r}; known: {sorted(prompts)}.")
    return Limits(MAX_RESPONSE_TOKENS[kind], prompts[workflow], MAX_ITERATIONS[kind])
