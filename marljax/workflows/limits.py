"""The paper's per-call limits, by problem kind and workflow (SPEC §1): what config keys left at `None`
resolve from (`marljax.config.resolve`), what Eval-Opt takes its iteration count from, and what the
experiment matrix sizes its cells by (`workflows.registry.paper_limits` joins them).

- response: tokens one role call may generate (math 5120, code 2048);
- prompt: tokens one role call's prompt may hold; a longer prompt ends the episode (see
  `workflows.base.rollout`). Each workflow declares its own (`Workflow.max_prompt_tokens`). Math: Eval-Opt
  30720, Voting and Orch-Workers 20480, single 15360; code: every multi-agent workflow 10240, single 4096;
- iterations: Eval-Opt's evaluator calls at most (math 3, code 2).
"""
from __future__ import annotations

import dataclasses

MAX_RESPONSE_TOKENS = {"math": 5120, "code": 2048}
MAX_ITERATIONS = {"math": 3, "code": 2}


@dataclasses.dataclass(frozen=True)
class Limits:
    response: int
    prompt: int
    iterations: int
