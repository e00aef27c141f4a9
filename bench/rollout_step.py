"""A whole Voting rollout step of the default run, before and after the rollout engine.

`configs/default.yaml` (SmolLM2-135M-Instruct, Voting with 3 voters + aggregator, shared LoRA set on
the last 4 layers, 4 problems × 4 rollouts, T = 0.7, max 32 new tokens), the parameters of a fresh run
with the LoRA B matrices perturbed (so the adapter is not a no-op). Contenders, alternated within each
repeat (the machine drifts):
  before  `rollout` in lockstep over the static sampler (bench/static_sampler.py, `generate_static`): one
          call per stage and parameter set, each decoding until its longest row ends
  after   `rollout` over the engine (`build.Policy.rollout_sampler`: `PolicyStream`), each episode submitting its
          aggregator call as soon as its 3 voters are back
  after-chunk16  the same with decode chunks of 16 steps (`sampling.chunk_steps`; default 32): a finished
          voter returns sooner, so its episode's aggregator call starts sooner (optional contender)
Both fold the set's LoRA into per-layer weights once per rollout. Each repeat uses its own rollout seed
(both contenders the same). Compile time is excluded: each contender first runs one untimed rollout.

    nice python bench/rollout_step.py [--repeats 3] [--contenders before after after-chunk16] [--write] [key=value ...]
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import time

from benchdoc import machine, publish  # first (before jax); bench/ is on sys.path when a script here runs
import jax
import numpy as np

from marljax.build import Policy, build_policy, build_problems, build_workflow
from marljax.config import Config, load_config, resolve
from marljax.sampling import layer_weights
from marljax.workflows import Completion, EvalOpt, rollout
from static_sampler import generate_static


def static_sample_fn(cfg: Config, policy: Policy, params: dict, temperature: float):
    """Today's sampler before the engine: per set one static-batch call, the set's LoRA folded once."""
    sp = cfg.sampling.build(tuple(policy.codec.stop_token_ids))
    weights = {s: layer_weights(policy.model, a, policy.lora_scale) for s, a in params.items()}

    def fn(set_name, prompts, seed):
        out = generate_static(policy.model, prompts, sp.params(temperature, seed), layers=weights[set_name])
        return [Completion(t, lp, not f) for t, lp, f in zip(out.tokens, out.logprobs, out.finished)]
    return fn


def build_run(overrides: list[str]):
    """configs/default.yaml with `overrides`, built as `train` builds it (`marljax.build`): (config, policy,
    workflow, route, a fresh run's parameters with the LoRA B matrices perturbed, training step 1's problems)."""
    cfg = resolve(load_config("configs/default.yaml", overrides))
    policy = build_policy(cfg)
    workflow, policy_map = build_workflow(cfg)
    fresh = policy.init_params(cfg, policy_map.sets)
    params = jax.tree.map(lambda x: x + 0.01 * jax.random.normal(jax.random.key(1), x.shape), fresh)
    problems = build_problems(cfg).batch(1, cfg.rl.problems_per_step, cfg.seed)
    return cfg, policy, workflow, dict(policy_map.route), params, problems


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--contenders", nargs="+", choices=["before", "after", "after-chunk16"],
                    default=["before", "after"])
    ap.add_argument("--write", action="store_true", help="replace the section in docs/benchmarks.md")
    ap.add_argument("overrides", nargs="*", help="key=value on configs/default.yaml (a smoke run: a tiny model)")
    args = ap.parse_args()
    if not {"before", "after"} <= set(args.contenders):
        ap.error("--contenders needs before and after (their ratio is the result)")
    cfg, policy, workflow, route, params, problems = build_run(args.overrides)
    T = cfg.sampling.temperature

    def one(name, seed):
        c = cfg if name != "after-chunk16" else dataclasses.replace(
            cfg, sampling=dataclasses.replace(cfg.sampling, chunk_steps=16))
        sampler = static_sample_fn(cfg, policy, params, T) if name == "before" else policy.rollout_sampler(c, params, T)
        t = time.perf_counter()
        ro = rollout(workflow, problems, sampler, policy.codec, route, n_rollouts=cfg.rl.rollouts,
                     seed=seed, max_prompt_tokens=cfg.sampling.max_prompt_tokens)
        wall = time.perf_counter() - t
        return wall, sum(len(c.response_ids) for c in ro.calls), np.mean([e.reward for e in ro.episodes])

    load_start = os.getloadavg()[0]
    names = args.contenders
    first = {name: one(name, 1000)[0] for name in names}
    walls = {name: [] for name in names}
    tokens = {name: [] for name in names}
    for r in range(args.repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            wall, n, reward = one(name, r)
            walls[name].append(wall)
            tokens[name].append(n)
            print(f"repeat {r} {name}: {wall:.2f} s, {n} tokens, mean reward {reward:.3f}", flush=True)
    # Prefill work on the engine: Voting's identical voter prompts, Eval-Opt's growing chat (prefix cache)
    prefill = {}
    for wf in ("voting", "eval_opt"):
        flow = dataclasses.replace(workflow, n_votes=3) if wf == "voting" else EvalOpt(worked_example=True)
        sampler = policy.rollout_sampler(cfg, params, T)
        shared = {role: route.get(role, "shared") for role in flow.roles}  # the shared set
        ro = rollout(flow, problems, sampler, policy.codec, shared, n_rollouts=cfg.rl.rollouts, seed=0)
        stats = [s.stats for s in sampler.stream.streams.values()]
        prefill[wf] = (len(ro.calls), sum(len(c.prompt_ids) for c in ro.calls), sum(x.prefill_tokens for x in stats),
                       sum(x.cached_tokens for x in stats))
    ratio = [b / a for b, a in zip(walls["before"], walls["after"])]
    se = statistics.stdev(ratio) / math.sqrt(len(ratio)) if len(ratio) > 1 else float("nan")
    c16 = [a / b for a, b in zip(walls["after"], walls.get("after-chunk16", []))]  # its rate over after's
    se16 = statistics.stdev(c16) / math.sqrt(len(c16)) if len(c16) > 1 else float("nan")
    lines = ["## Voting rollout step of the default run (CPU)", "",
             f"`nice python bench/rollout_step.py --repeats {args.repeats} --contenders {' '.join(names)}` on "
             f"{time.strftime('%Y-%m-%d %H:%M')}, "
             f"{machine()}, jax {jax.__version__}; load average {load_start:.1f} at the start, "
             f"{os.getloadavg()[0]:.1f} at the end (other jobs shared the machine). configs/default.yaml: SmolLM2-135M-Instruct, Voting (3 voters "
             f"+ aggregator), shared LoRA on the last 4 layers (B perturbed), {len(problems)} problems × "
             f"{cfg.rl.rollouts} rollouts = {len(problems) * cfg.rl.rollouts * 4} role calls, T = {T}, "
             f"max {cfg.sampling.max_new_tokens} new tokens. before = lockstep `rollout` over the static "
             "sampler (one call per stage); after = the engine, episodes advancing on their own. Contenders "
             "alternate, one rollout seed per repeat shared by both; compile excluded (one untimed rollout "
             "each first: first-run seconds in the last column).", "",
             "| contender | wall s per rollout step (mean ± s.e.) | generated tokens (mean) | first run s |",
             "|---|---|---|---|"]
    for name in names:
        w = walls[name]
        s = statistics.stdev(w) / math.sqrt(len(w)) if len(w) > 1 else float("nan")
        lines.append(f"| {name} | {statistics.mean(w):.2f} ± {s:.2f} | {statistics.mean(tokens[name]):.0f} | "
                     f"{first[name]:.1f} |")
    lines += ["", f"before / after, paired per repeat: **{statistics.mean(ratio):.2f}× ± {se:.2f}** "
              f"({args.repeats} repeats). The samples differ (the engine draws each call from its own seed), so "
              "the generated token counts differ too."
              + (f" after / after-chunk16 (wall time), paired: {statistics.mean(c16):.2f}× ± {se16:.2f}."
                 if c16 else ""), "",
              "Prefill work of one rollout on the engine (same problems and settings; Eval-Opt with the paper's 3 "
              "iterations for math, `worked_example`):", "",
              "| workflow | role calls | prompt tokens submitted | prefilled | from the prefix cache |", "|---|---|---|---|---|"]
    for wf, (calls, submitted, done, cached) in prefill.items():
        lines.append(f"| {wf} | {calls} | {submitted} | {done} ({done / submitted:.0%}) | {cached} |")
    lines += ["", "Prefilled = computed once per distinct prompt (the 4 rollouts × 3 voters of a problem share one "
              "prefill) minus the leading pages found in the prefix cache (Eval-Opt: each call's prompt starts "
              "with the previous call's history).", ""]
    publish("\n".join(lines), args.write)


if __name__ == "__main__":
    main()
