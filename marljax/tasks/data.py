"""Problems and dataset loaders: every task yields `Problem`s with a prompt, a gold target and a reward."""
from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Problem:
    """One task instance. `kind` selects the reward: "math" grades `answer`, "code" runs `tests`."""

    id: str
    question: str
    kind: str  # "math" | "code"
    answer: str | None = None
    tests: tuple[dict[str, Any], ...] | None = None
    meta: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False)

    def reward(self, response: str) -> float:
        """Binary reward of a final response text (1.0 or 0.0)."""
        if self.kind == "math":
            from marljax.tasks.math import grade
            return grade(response, self.answer)
        if self.kind == "code":
            from marljax.tasks.code import grade_code
            return grade_code(response, list(self.tests or ()))
        raise ValueError(f"Problem {self.id!r}: unknown kind {self.kind!r}; expected 'math' or 'code'.")
