"""`python -m marljax.evaluate model=M workflow=W task=T n=100 [checkpoint=DIR] [key=value ...]`.

Workflow pass@1 on held-out problems (one sampled run per problem; `eval.k=K` for mean ± std and
pass@K), per-role metrics, transcripts as JSONL. Same config keys as `train`; `checkpoint=RUN_DIR`
evaluates the newest checkpoint of a training run (its parameter sets and routing). The base config is
chosen as `train`'s: `--config FILE` (or the checkpoint's config.yaml); no arguments at all:
configs/default.yaml; only key=value: the paper's settings. The first lines (stderr) name the base and the
keys that depart from the paper's settings. The last line printed is `pass@1 = <float>`.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys

from marljax import compile_cache
import yaml

from marljax.config import ConfigError, cli_config, describe, resolve, to_dict


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m marljax.evaluate", description=__doc__.splitlines()[0])
    ap.add_argument("--config", help="YAML config (e.g. a run's config.yaml)")
    ap.add_argument("--out", help="write metrics.json and transcripts.jsonl here")
    ap.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")
    ap.add_argument("overrides", nargs="*", help="key=value; n=N, checkpoint=RUN_DIR are shortcuts")
    args = ap.parse_args(argv)
    compile_cache.enable()
    overrides, checkpoint = [], None
    for item in args.overrides:
        key, _, value = item.partition("=")
        if key == "n":
            overrides.append(f"task.eval_n={value}")
        elif key == "checkpoint":
            checkpoint = pathlib.Path(value)
        else:
            overrides.append(item)
    config_file = args.config
    if checkpoint is not None and config_file is None:
        config_file = str(checkpoint / "config.yaml")
        if not pathlib.Path(config_file).exists():
            ap.exit(2, f"checkpoint={checkpoint}: no config.yaml there; is it a marljax run directory?\n")
    try:
        cfg, base = cli_config(config_file, overrides)
        resolved = resolve(cfg)
    except ConfigError as e:
        ap.exit(2, f"config error: {e}\n")
    print(describe(cfg, base), file=sys.stderr, flush=True)
    if args.print_config:
        print(yaml.safe_dump(to_dict(resolved), sort_keys=False), end="")
        return
    cfg.eval.at_start = False

    from marljax.train import Run
    from marljax.checkpoint import Checkpointer
    run = Run(cfg)
    if checkpoint is not None:
        ckpt = Checkpointer(checkpoint, cfg.checkpoint.every, cfg.checkpoint.keep)
        if ckpt.latest_step() is None:
            ap.exit(2, f"checkpoint={checkpoint}: no checkpoint under {ckpt.dir}.\n")
        step, state, meta = ckpt.restore(run.state())
        run.load(state, meta)
        ckpt.close()
        print(f"evaluating {checkpoint} at step {step}", file=sys.stderr)
    from marljax.workflows.evaluation import evaluate_workflow
    ev = evaluate_workflow(run.workflow, run.eval_problems, run.sample_fn(cfg.eval.temperature), run.codec,
                           run.route, seed=cfg.seed, k=cfg.eval.k, max_prompt_tokens=run.cfg.sampling.max_prompt_tokens)
    for k, v in sorted(ev.metrics.items()):
        print(f"{k}: {v:.4f}" if isinstance(v, float) else f"{k}: {v}")
    if args.out:
        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "metrics.json").write_text(json.dumps(ev.metrics, indent=1))
        (out / "transcripts.jsonl").write_text("".join(json.dumps(t) + "\n" for t in ev.transcripts))
    print(f"pass@1 = {ev.metrics['pass@1']:.4f}")


if __name__ == "__main__":
    main()
