"""The problem-kind registry: what a `Problem.kind` means to the rest of marljax, in one place. A kind
says how a reply is rewarded (`grade`) and when a reply gives the grader nothing to grade
(`answer_missing`, a role's parse failure). `Problem.reward` and the workflows read a kind only here."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable


@dataclasses.dataclass(frozen=True)
class ProblemKind:
    name: str
    grade: Callable[[Any, str], float]  # (problem, response text) -> 1.0 or 0.0
    answer_missing: Callable[[str], bool]  # reply text -> True when it holds no answer to grade


KINDS: dict[str, ProblemKind] = {}


def register_kind(kind: ProblemKind) -> ProblemKind:
    """Make `kind` known by its name; a name registered twice is an error."""
    if kind.name in KINDS:
        raise ValueError(f"problem kind {kind.name!r} is already registered.")
    KINDS[kind.name] = kind
    return kind


def problem_kind(name: str) -> ProblemKind:
    """The registered kind `name`; a ValueError lists the known kinds."""
    if name not in KINDS:
        raise ValueError(f"Unknown problem kind {name!r}; expected one of {sorted(KINDS)}.")
    return KINDS[name]


def _grade_math(problem, response: str) -> float:
    from marljax.tasks.math import grade  # lazily: math-verify imports sympy (~1 s)
    return grade(response, problem.answer)


def _math_answer_missing(text: str) -> bool:
    from marljax.tasks.math import extract_answer
    return not extract_answer(text)  # no non-empty `\boxed{}`


def _grade_code(problem, response: str) -> float:
    from marljax.tasks.code import grade_code
    return grade_code(response, list(problem.tests or ()), sandbox=problem.sandbox)


def _code_answer_missing(text: str) -> bool:
    from marljax.tasks.code import extract_code
    return extract_code(text) is None  # no program


register_kind(ProblemKind("math", _grade_math, _math_answer_missing))  # `answer`, compared by math-verify
register_kind(ProblemKind("code", _grade_code, _code_answer_missing))  # `tests`, run in the sandbox
