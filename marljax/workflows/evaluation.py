"""Workflow evaluation: pass@1 (and, over k runs, mean ± std and pass@k) plus per-role metrics."""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from marljax.tasks.problem import Problem
from marljax.workflows.base import (ChatCodec, RewardFn, Rollout, SampleFn, StreamSampler, Workflow, grade_serially,
                                   rollout)
from marljax.workflows.metrics import rollout_metrics


@dataclasses.dataclass(frozen=True)
class Evaluation:
    metrics: dict[str, float]
    transcripts: list[dict[str, Any]]  # one JSON-able dict per episode (problem order, then run)


def evaluate_workflow(
    workflow: Workflow,
    problems: Sequence[Problem],
    sampler: SampleFn | StreamSampler,
    codec: ChatCodec,
    route: Mapping[str, str],
    seed: int = 0,
    k: int = 1,
    batch_size: int = 64,
    *,
    reward_fn: RewardFn = grade_serially,
    progress: bool = True,
    max_prompt_tokens: int | None = None,
) -> Evaluation:
    """Run `workflow` k times on every problem, `batch_size` problems (× k episodes) per rollout.

    Metrics: `pass@1` (mean reward over all problems and runs), `pass@1/std` (std over the k per-run
    means, 0 when k = 1), `pass@k` for k > 1 (fraction of problems solved in any run), `n_problems`, `k`,
    and every `rollout_metrics` key. `max_prompt_tokens`: as `rollout`'s.
    """
    if not problems:
        raise ValueError("evaluate_workflow: no problems given.")
    if k < 1 or batch_size < 1:
        raise ValueError(f"k and batch_size must be >= 1, got k={k}, batch_size={batch_size}")
    parts: list[Rollout] = []
    rewards = []
    with tqdm(total=len(problems) * k, unit="episode", desc=f"eval {workflow.name}", disable=not progress) as bar:
        for b, start in enumerate(range(0, len(problems), batch_size)):
            batch_seed = int(np.random.SeedSequence([seed, b]).generate_state(1)[0])
            part = rollout(workflow, problems[start: start + batch_size], sampler, codec, route,
                           n_rollouts=k, seed=batch_seed, reward_fn=reward_fn,
                           max_prompt_tokens=max_prompt_tokens)
            parts.append(part)
            rewards += [e.reward for e in part.episodes]
            bar.update(len(part.episodes))
            bar.set_postfix({"pass@1": f"{np.mean(rewards):.3f}"})
    joined = Rollout.concat(parts)
    by_run = np.asarray(rewards, np.float64).reshape(len(problems), k)  # episode order: problem, then run
    metrics = {"pass@1": float(by_run.mean()), "pass@1/std": float(by_run.mean(axis=0).std()),
               "n_problems": float(len(problems)), "k": float(k)}
    if k > 1:
        metrics[f"pass@{k}"] = float(by_run.max(axis=1).mean())
    metrics.update(rollout_metrics(joined))
    return Evaluation(metrics, joined.transcripts())
