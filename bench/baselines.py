"""Base-model workflow pass@1: `python -m marljax.evaluate` for each workflow, tabulated into docs/baselines.md.

    python bench/baselines.py --n 100 [--config configs/default.yaml] [--worked-example true|false]
        [--max-new-tokens 32] [--workflows single voting ...] [--no-write]

Runs the exact `evaluate` command for every workflow (printed and written into the doc) on the config's
model and task (by default the default run's: SmolLM2-135M, easy arithmetic), reads its metrics.json, and
replaces the doc's section for this (model, task, prompt, length) setting.
"""
import argparse
import json
import math
import pathlib
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from benchdoc import machine, write_section  # noqa: E402
from marljax.config import load_config  # noqa: E402

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "baselines.md"
WORKFLOWS = ("single", "eval_opt", "voting", "orch_workers")
ROLE_OF_ANSWERS = {"single": "generator", "eval_opt": "generator", "voting": "generator", "orch_workers": "worker"}


def command(args, workflow: str, out: pathlib.Path) -> list[str]:
    return [sys.executable, "-m", "marljax.evaluate", "--config", args.config, f"workflow={workflow}",
            f"n={args.n}", f"seed={args.seed}", f"sampling.max_new_tokens={args.max_new_tokens}",
            f"workflow.worked_example={args.worked_example}", *args.overrides, "--out", str(out)]


def row(workflow: str, m: dict, seconds: float) -> str:
    p, n = m["pass@1"], m["n_problems"] * m.get("k", 1)
    role = ROLE_OF_ANSWERS[workflow]
    fmt = lambda key: f"{m[key]:.3f}" if key in m else "–"  # noqa: E731
    return (f"| {workflow} | {p:.3f} ± {math.sqrt(p * (1 - p) / n):.3f} | {fmt(f'role/{role}/accuracy')} | "
            f"{fmt(f'role/{role}/parse_fail')} | {fmt(f'role/{role}/truncated')} | {fmt('workflow/any_correct')} | "
            f"{seconds:.0f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/default.yaml")
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--worked-example", nargs="?", const="true", default="true", choices=["true", "false"])
    ap.add_argument("--workflows", nargs="+", default=list(WORKFLOWS), choices=WORKFLOWS)
    ap.add_argument("--no-write", action="store_true", help=f"print the section, leave {DOC.name} alone")
    ap.add_argument("overrides", nargs="*", help="more evaluate key=value overrides (e.g. task.options=...)")
    args = ap.parse_args()
    cfg = load_config(args.config, args.overrides)  # fails early on a bad config
    options = ", ".join(f"{k}={v}" for k, v in cfg.task.options.items())
    prompt = "worked example" if args.worked_example == "true" else "zero-shot (the paper's prompts)"
    title = (f"## {cfg.model} on {cfg.task.name}{f' ({options})' if options else ''}, {prompt}, "
             f"{args.max_new_tokens} new tokens")
    rows, commands = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for workflow in args.workflows:
            out = pathlib.Path(tmp) / workflow
            cmd = command(args, workflow, out)
            shown = " ".join(["python", *cmd[1:-2]])
            print(shown, flush=True)
            t0 = time.perf_counter()
            subprocess.run(cmd, check=True)
            rows.append(row(workflow, json.loads((out / "metrics.json").read_text()), time.perf_counter() - t0))
            commands.append(shown)
    text = "\n".join([
        title, "",
        f"{time.strftime('%Y-%m-%d %H:%M')}, {machine()}. n = {args.n} held-out problems, one sampled run each "
        f"(T = {cfg.eval.temperature}), seed {args.seed}, the rest of `{args.config}`. ± is one binomial "
        "standard error. The answer role is the generator (workers for Orch-Workers); its accuracy is "
        "re-graded on its own output.", "",
        "| workflow | pass@1 | answer-role accuracy | answer-role parse fail | truncated | any correct | seconds |",
        "|---|---|---|---|---|---|---|", *rows, "", "Commands:", "", "```", *commands, "```", ""])
    if args.no_write:
        print(text)
    else:
        write_section(title, text, DOC, "# Base-model baselines\n\nWritten by `bench/baselines.py`; one section per "
                      "(model, task, prompt, length) setting.")
        print(f"wrote {DOC}")


if __name__ == "__main__":
    main()
