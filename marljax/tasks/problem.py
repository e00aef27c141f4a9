"""`Problem`: one task instance, what every task yields and every workflow reads."""
from __future__ import annotations

import dataclasses
from typing import Any

from marljax.tasks.code import grade_code


@dataclasses.dataclass(frozen=True)
class Problem:
    """One task instance. `kind` selects the reward: "math" grades `answer`, "code" runs `tests` under
    the isolation `sandbox` ("bwrap" | "rlimits", from `task.sandbox`; see marljax.tasks.sandbox)."""

    id: str
    question: str
    kind: str  # "math" | "code"
    answer: str | None = None
    tests: tuple[dict[str, Any], ...] | None = None
    meta: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False)
    sandbox: str = "bwrap"

    def reward(self, response: str) -> float:
        """Binary reward of a final response text (1.0 or 0.0)."""
        if self.kind == "math":
            from marljax.tasks.math import grade  # lazily: math-verify imports sympy (~1 s)
            return grade(response, self.answer)
        if self.kind == "code":
            return grade_code(response, list(self.tests or ()), sandbox=self.sandbox)
        raise ValueError(f"Problem {self.id!r}: unknown kind {self.kind!r}; expected 'math' or 'code'.")
