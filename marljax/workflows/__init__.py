"""Multi-agent workflows as pure episode scripts, run batched by `rollout`."""
from __future__ import annotations

from marljax.workflows.base import CallColumns, Completion, Rollout, Workflow, rollout
from marljax.workflows.eval_opt import EvalOpt
from marljax.workflows.orch_workers import OrchWorkers
from marljax.workflows.single import SingleAgent
from marljax.workflows.voting import Voting

WORKFLOWS: dict[str, type[Workflow]] = {
    "single": SingleAgent, "eval_opt": EvalOpt, "voting": Voting, "orch_workers": OrchWorkers,
}


def get_workflow(name: str, **kwargs) -> Workflow:
    """A workflow by name (single | eval_opt | voting | orch_workers), configured by its keyword options
    (eval_opt: max_iterations; voting: n_votes; orch_workers: max_subtasks)."""
    if name not in WORKFLOWS:
        raise ValueError(f"Unknown workflow {name!r}; choose one of {sorted(WORKFLOWS)}.")
    cls = WORKFLOWS[name]
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise TypeError(f"Bad options {kwargs} for workflow {name!r}: {e}") from None


__all__ = ["WORKFLOWS", "CallColumns", "Completion", "EvalOpt", "OrchWorkers", "Rollout", "SingleAgent", "Voting",
           "Workflow", "get_workflow", "rollout"]
