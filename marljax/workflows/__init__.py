"""Multi-agent workflows as pure episode scripts, run batched by `rollout`. Each module registers its
workflow (`workflows.registry.register`); importing it here is what makes the name known. The import
order is the order of the options' config keys (`workflow.n_votes`, `workflow.max_iterations`, ...)."""
from __future__ import annotations

from marljax.workflows.base import CallColumns, Completion, Rollout, SamplerStage, Workflow, rollout
from marljax.workflows.voting import Voting
from marljax.workflows.eval_opt import EvalOpt
from marljax.workflows.orch_workers import OrchWorkers
from marljax.workflows.single import SingleAgent
from marljax.workflows.registry import WORKFLOWS, get_workflow, paper_limits, register, workflow_class

__all__ = ["WORKFLOWS", "CallColumns", "EvalOpt", "OrchWorkers", "Completion", "Rollout", "SamplerStage", "SingleAgent",
           "Voting", "Workflow", "get_workflow", "paper_limits", "register", "rollout", "workflow_class"]
