"""`Problem`: one task instance, what every task yields and every workflow reads."""
from __future__ import annotations

import dataclasses
from typing import Any

from marljax.tasks.kinds import problem_kind


@dataclasses.dataclass(frozen=True)
class Problem:
    """One task instance. `kind` selects the reward (`marljax.tasks.kinds`): "math" grades `answer`, "code"
    runs `tests` under the isolation `sandbox` ("bwrap" | "rlimits", from `task.sandbox`; see marljax.tasks.sandbox)."""

    id: str
    question: str
    kind: str  # a registered problem kind (marljax.tasks.kinds): "math" | "code"
    answer: str | None = None
    tests: tuple[dict[str, Any], ...] | None = None
    meta: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False)
    sandbox: str = "bwrap"

    def reward(self, response: str) -> float:
        """Binary reward of a final response text (1.0 or 0.0)."""
        return problem_kind(self.kind).grade(self, response)
