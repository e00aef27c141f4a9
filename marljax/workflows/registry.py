"""The workflow registry: a workflow module registers its class with `@register` (one line), and
`marljax.workflows` imports the module. Train, evaluate, the experiment matrix and config validation read
a workflow only through its declaration here: `roles`, its options (the class's dataclass fields, with
their types and defaults), `same_role_counts`, `sampler_stages` and the paper's prompt caps."""
from __future__ import annotations

from marljax.workflows.base import Workflow
from marljax.workflows.limits import MAX_ITERATIONS, MAX_RESPONSE_TOKENS, Limits

WORKFLOWS: dict[str, type[Workflow]] = {}


def register(cls: type[Workflow]) -> type[Workflow]:
    """Class decorator: make `cls` a workflow by its `name`; a name registered twice is an error."""
    if cls.name in WORKFLOWS:
        raise ValueError(f"workflow {cls.name!r} is already registered (by {WORKFLOWS[cls.name].__module__}).")
    WORKFLOWS[cls.name] = cls
    return cls


def workflow_class(name: str) -> type[Workflow]:
    """The registered class of workflow `name`; a ValueError lists the registered names."""
    if name not in WORKFLOWS:
        raise ValueError(f"Unknown workflow {name!r}; choose one of {sorted(WORKFLOWS)}.")
    return WORKFLOWS[name]


def get_workflow(name: str, **kwargs) -> Workflow:
    """A workflow by name, configured by its keyword options (its dataclass fields, e.g. voting: n_votes)."""
    cls = workflow_class(name)
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise TypeError(f"Bad options {kwargs} for workflow {name!r}: {e}") from None


def paper_limits(kind: str, workflow: str) -> Limits:
    """The paper's limits for a problem kind ("math" | "code") and a registered workflow's name."""
    if kind not in MAX_RESPONSE_TOKENS:
        raise ValueError(f"No paper limits for problem kind {kind!r}; known: {sorted(MAX_RESPONSE_TOKENS)}.")
    if workflow not in WORKFLOWS:
        raise ValueError(f"No paper limits for workflow {workflow!r}; known: {sorted(WORKFLOWS)}.")
    return Limits(MAX_RESPONSE_TOKENS[kind], WORKFLOWS[workflow].max_prompt_tokens[kind], MAX_ITERATIONS[kind])
