"""Per-role rollout metrics: what each role produced, how often it broke format, how often it was right."""
from __future__ import annotations

import numbers

import numpy as np

from marljax.workflows.base import CallRecord, Rollout


def rollout_metrics(rollout: Rollout) -> dict[str, float]:
    """Flat metrics of one rollout (or several joined by `Rollout.concat`).

    Per role: `role/<r>/{calls_per_episode, length_mean (response tokens), parse_fail, truncated}` and,
    where calls were re-graded, `role/<r>/accuracy` (voters', workers' and Eval-Opt generators' own
    answers; the evaluator's verdict against the truth). Per workflow: `reward/mean`,
    `workflow/any_correct` (an episode counts if any output of a graded role is correct: the oracle over
    voters / workers / Eval-Opt turns), and the mean of every numeric episode fact as `workflow/<key>`
    (e.g. `workflow/eval_opt_turns`, `workflow/n_strategies`, `workflow/choice`), and
    `workflow/prompt_overflow`, the fraction of episodes a prompt over the cap ended.
    """
    episodes = rollout.episodes
    if not episodes:
        raise ValueError("rollout_metrics: the rollout has no episodes.")
    out = {"reward/mean": float(np.mean([e.reward for e in episodes])),
           "workflow/prompt_overflow": float(np.mean([e.prompt_overflow for e in episodes]))}
    by_role: dict[str, list[CallRecord]] = {}
    for c in rollout.calls:
        by_role.setdefault(c.role, []).append(c)
    for role, calls in by_role.items():
        key = f"role/{role}"
        out[f"{key}/calls_per_episode"] = len(calls) / len(episodes)
        out[f"{key}/length_mean"] = float(np.mean([len(c.response_ids) for c in calls]))
        out[f"{key}/parse_fail"] = float(np.mean([c.parse_failed for c in calls]))
        out[f"{key}/truncated"] = float(np.mean([c.truncated for c in calls]))
        graded = [c.correct for c in calls if c.correct is not None]
        if graded:
            out[f"{key}/accuracy"] = float(np.mean(graded))
    oracle = [[rollout.calls[i].correct for i in e.call_ids
               if rollout.calls[i].role in rollout.graded_roles and rollout.calls[i].correct is not None]
              for e in episodes]
    if all(oracle):
        out["workflow/any_correct"] = float(np.mean([max(scores) for scores in oracle]))
    facts: dict[str, list[float]] = {}
    for e in episodes:
        for k, v in e.info.items():
            if isinstance(v, numbers.Real):
                facts.setdefault(k, []).append(float(v))
    out.update({f"workflow/{k}": float(np.mean(v)) for k, v in facts.items()})
    return out
