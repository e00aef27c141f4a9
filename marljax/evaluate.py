"""`python -m marljax.evaluate model=M workflow=W task=T n=100 [checkpoint=DIR] [key=value ...]`.

Workflow pass@1 on held-out problems (one sampled run per problem; `eval.k=K` for mean ± std and
pass@K), per-role metrics, transcripts as JSONL. Same config keys as `train`; `checkpoint=RUN_DIR`
evaluates a training run's parameter sets and routing: its newest checkpoint, or with `which=peak` the
state of its best eval during training. `transfer=all|generators` with `workflow=W` is the paper's SA→MA
transfer control: a single-agent run's set on every role of W, or on its solving roles with the base model
on the supervisory ones. Checkpoint evals are also written to RUN_DIR/evals/<name>.json, where the report
finds them; RUN_DIR may be a bucket (`gs://…`, see marljax.core.storage). The base config: with
`checkpoint=RUN_DIR`, the run's own RUN_DIR/config.yaml (`--config` beside it is refused: key=value
changes the eval's keys); else as `train`'s: `--config FILE`; no arguments at all: configs/default.yaml;
only key=value: the paper's settings. The first lines (stderr) name the base and the keys that depart from the
paper's settings. The last line printed is `pass@1 = <float>`.
"""
from __future__ import annotations

if __name__ == "__main__":  # the CLI keeps freed host memory: before anything imports jax
    from marljax.core import host_memory
    host_memory.opt_in("marljax.evaluate")

import argparse
import dataclasses
import json
import sys
from typing import TYPE_CHECKING

import yaml
from etils import epath

from marljax.config import Config, ConfigError, cli_config, describe, load_config, resolve, to_dict
from marljax.core import compile_cache, storage
from marljax.rl import policy_map as pm

if TYPE_CHECKING:
    from marljax.build import Policy
    from marljax.workflows import Workflow

SHORTCUTS = ("n", "checkpoint", "which", "transfer")


def parse(argv: list[str] | None):
    """(args, config overrides, {shortcut: value})."""
    ap = argparse.ArgumentParser(prog="python -m marljax.evaluate", description=__doc__.splitlines()[0])
    ap.add_argument("--config", help="YAML config (not with checkpoint=: a run is evaluated under its own)")
    ap.add_argument("--out", help="write metrics.json and transcripts.jsonl here")
    ap.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")
    ap.add_argument("overrides", nargs="*", help="key=value; n=N, checkpoint=RUN_DIR, which=newest|peak, "
                                                 "transfer=all|generators are shortcuts")
    args = ap.parse_args(argv)
    overrides, short = [], {}
    for item in args.overrides:
        key, _, value = item.partition("=")
        if key == "n":
            overrides.append(f"task.eval_n={value}")
        elif key in SHORTCUTS:
            short[key] = value
        else:
            overrides.append(item)
    return ap, args, overrides, short


TRANSFER_RESETS = ("rl.kl_beta={}",)  # with transfer=: the source's kl_beta names its roles; nothing is trained


@dataclasses.dataclass
class Evaluation:
    """What an eval samples from: the resolved config, the policy, the workflow and its routing, the held-out
    problems and the parameter sets ({set: parameters}, restored or fresh)."""

    cfg: Config
    policy: Policy
    workflow: Workflow
    route: dict[str, str]
    eval_problems: list
    params: dict

    def rollout_sampler(self, temperature: float):
        return self.policy.rollout_sampler(self.cfg, self.params, temperature)


def build(checkpoint: epath.Path | None, config_file: str | None, overrides: list[str], which: str,
          transfer: str | None) -> tuple[Evaluation, int | None]:
    """The Evaluation and the checkpoint step its parameters come from (None without a checkpoint: fresh
    parameters, the base model). Only parameters are restored, no optimizer state.

    Raises ConfigError (bad keys, transfer from a run that is not single-agent, an unknown workflow or mode)
    or FileNotFoundError (no checkpoint / peak)."""
    from marljax.build import build_policy, build_problems, build_workflow
    from marljax.core.checkpoint import WHICH, Checkpointer

    if which not in WHICH:
        raise ConfigError(f"which={which!r}; choose one of {WHICH}.")
    if checkpoint is None and (transfer is not None or which != "newest"):
        raise ConfigError("which= and transfer= evaluate a training run; add checkpoint=RUN_DIR.")
    cfg, _ = cli_config(config_file, [*overrides, *TRANSFER_RESETS] if transfer else overrides)
    target = cfg.workflow.build()
    source = load_config(config_file) if transfer is not None else None
    if transfer is not None:
        if source.workflow.name != "single":
            raise ConfigError(f"transfer={transfer} puts a single-agent run's parameters on a workflow's roles, but "
                              f"{checkpoint} is a workflow={source.workflow.name} run; pass a workflow=single run.")
        if transfer not in pm.TRANSFER_MODES:
            raise ConfigError(f"transfer={transfer!r}; choose one of {pm.TRANSFER_MODES}.")
        cfg.policy = dict(pm.transfer(target.roles, target.graded_roles, transfer).route)
    cfg = resolve(cfg)
    problems = build_problems(cfg)
    policy = build_policy(cfg)
    workflow, policy_map = build_workflow(cfg)
    params = policy.init_params(cfg, policy_map.sets)
    step = None
    if checkpoint is not None:
        ckpt = Checkpointer(checkpoint, cfg.checkpoint.every, cfg.checkpoint.keep)
        try:
            if transfer is None:
                step, params = ckpt.restore_params(params, which=which)
            else:  # "base" keeps its fresh init: B = 0, the base model
                name = pm.from_config(source.policy, ("generator",)).route["generator"]
                step, restored = ckpt.restore_params({name: params["sa"]}, which=which)
                params = {**params, "sa": restored[name]}
        finally:
            ckpt.close()
    return Evaluation(cfg, policy, workflow, dict(policy_map.route), problems.eval, params), step


def result(ev, cfg, checkpoint: epath.Path, step: int, which: str, transfer: str | None,
           overrides: list[str]) -> dict:
    """The JSON record of a checkpoint eval: what was evaluated, pass@1, and each problem's mean reward."""
    per_problem: dict[str, list[float]] = {}
    for t in ev.transcripts:
        per_problem.setdefault(str(t["problem_id"]), []).append(float(t["reward"]))
    return {"run": checkpoint.name, "workflow": cfg.workflow.name, "transfer": transfer, "which": which,
            "step": step, "pass@1": ev.metrics["pass@1"], "n": int(ev.metrics["n_problems"]),
            "k": int(ev.metrics["k"]), "seed": cfg.seed, "overrides": overrides, "metrics": ev.metrics,
            "rewards": {pid: sum(r) / len(r) for pid, r in per_problem.items()}}


def result_path(checkpoint: epath.Path, workflow: str, which: str, transfer: str | None) -> epath.Path:
    """RUN_DIR/evals/<which>.json, or transfer-<workflow>-<mode>-<which>.json for a transfer eval."""
    name = which if transfer is None else f"transfer-{workflow}-{transfer}-{which}"
    return checkpoint / "evals" / f"{name}.json"


def main(argv: list[str] | None = None) -> None:
    ap, args, overrides, short = parse(argv)
    compile_cache.enable()
    checkpoint = epath.Path(short["checkpoint"]) if "checkpoint" in short else None
    which, transfer = short.get("which", "newest"), short.get("transfer")
    config_file = args.config
    if checkpoint is not None:
        config_file = str(checkpoint / "config.yaml")
        if args.config is not None:
            ap.exit(2, f"config error: --config {args.config} and checkpoint={checkpoint} were both given; a run "
                       f"is evaluated under its own config, {config_file}. Drop --config and give what the eval "
                       "changes as key=value (e.g. workflow=voting transfer=all n=100).\n")
        try:
            storage.connect(checkpoint)
        except storage.StorageError as e:
            ap.exit(2, f"storage error: {e}\n")
        if not epath.Path(config_file).exists():
            ap.exit(2, f"checkpoint={checkpoint}: no config.yaml there; is it a marljax run directory?\n")
    try:
        cfg, base = cli_config(config_file, [*overrides, *TRANSFER_RESETS] if transfer else overrides)
        resolved = resolve(cfg)
    except ConfigError as e:
        ap.exit(2, f"config error: {e}\n")
    print(describe(cfg, base), file=sys.stderr, flush=True)
    if args.print_config:
        print(yaml.safe_dump(to_dict(resolved), sort_keys=False), end="")
        return
    try:
        run, step = build(checkpoint, config_file, overrides, which, transfer)
    except ConfigError as e:
        ap.exit(2, f"config error: {e}\n")
    except FileNotFoundError as e:
        ap.exit(2, f"checkpoint={checkpoint}: {e}\n")
    cfg = run.cfg
    if checkpoint is not None:
        what = f" → {cfg.workflow.name} (transfer={transfer})" if transfer else ""
        print(f"evaluating {checkpoint} {which} at step {step}{what}", file=sys.stderr)
    from marljax.workflows.evaluation import evaluate_workflow
    ev = evaluate_workflow(run.workflow, run.eval_problems, run.rollout_sampler(cfg.eval.temperature), run.policy.codec,
                           run.route, seed=cfg.seed, k=cfg.eval.k, max_prompt_tokens=run.cfg.sampling.max_prompt_tokens)
    for k, v in sorted(ev.metrics.items()):
        print(f"{k}: {v:.4f}" if isinstance(v, float) else f"{k}: {v}")
    if args.out:
        out = epath.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "metrics.json").write_text(json.dumps(ev.metrics, indent=1))
        (out / "transcripts.jsonl").write_text("".join(json.dumps(t) + "\n" for t in ev.transcripts))
    if checkpoint is not None:
        path = result_path(checkpoint, cfg.workflow.name, which, transfer)
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps(result(ev, cfg, checkpoint, step, which, transfer, overrides), indent=1))
        print(f"wrote {path}", file=sys.stderr)
    print(f"pass@1 = {ev.metrics['pass@1']:.4f}")


if __name__ == "__main__":
    main()
