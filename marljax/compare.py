"""`python -m marljax.compare RUN_DIR ... --by KEY ... --metric NAME ... [--steps A:B] [--out DIR]`.

Compares conditions over training seeds: runs are grouped by the config values named by `--by` (dotted
keys of each run's config.yaml, e.g. `workflow.n_votes rl.same_role_scale`); runs of one condition differ
in their seed. For every metric (a key of metrics.jsonl, e.g. `set/generator/step_delta`), a run's value is
its mean over the training steps in `--steps` (default: all logged steps of the metric); a condition's value
is the mean of its runs with its t-based 95% interval over seeds (df = seeds − 1; `marljax.analysis.seed_stats`); each
condition's difference from the first condition is paired by seed where both ran the same seeds, else
Welch's, and marked ✱ when its interval excludes 0. The step-to-step noise inside a run is not counted
twice: the seeds' spread carries it.

Writes compare.md (the table, the runs behind each condition, the command) and, per metric, a PNG of the
per-step mean over seeds of every condition with its seeds' range shaded. Run dirs and --out may be
buckets (`gs://…`, see marljax.core.storage).
"""
from __future__ import annotations

import argparse
import math
import re
import sys
from typing import Any

import numpy as np
import yaml
from etils import epath

from marljax.analysis.seed_stats import difference, t_interval
from marljax.config import config_value
from marljax.core.metrics import read_metrics
from marljax.core.storage import save_figure


def run_series(records: list[dict], metric: str, steps: tuple[int, int] | None = None, *,
               base: bool = False) -> dict[int, float]:
    """step → value of `metric` over the training records (those with a step ≥ 1) within `steps`; with
    `base`, step 0 too (the eval before training)."""
    out = {}
    for r in records:
        v, s = r.get(metric), r.get("step", 0)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and s >= (0 if base else 1):
            if steps is None or steps[0] <= s <= steps[1]:
                out[int(s)] = float(v)
    return out


class Condition:
    """The runs sharing one value of the `--by` keys."""

    def __init__(self, label: str):
        self.label, self.runs = label, []  # runs: (name, seed, records)

    def per_seed(self, metric: str, steps) -> dict[Any, float]:
        """seed → the run's mean of `metric` over `steps` (runs without it left out)."""
        return {seed: float(np.mean(list(s.values()))) for _, seed, rec in self.runs
                if (s := run_series(rec, metric, steps))}


def conditions(run_dirs: list[epath.Path], by: list[str]) -> list[Condition]:
    """Runs grouped by their `by` values, in the order each condition first appears."""
    out: dict[str, Condition] = {}
    for d in run_dirs:
        path = d / "config.yaml"
        if not path.exists():
            raise SystemExit(f"{d}: no config.yaml; pass run directories written by `python -m marljax.train`.")
        cfg = yaml.safe_load(path.read_text())
        label = ", ".join(f"{k.split('.')[-1]}={config_value(cfg, k)}" for k in by)
        out.setdefault(label, Condition(label)).runs.append((d.name, cfg.get("seed", d.name), read_metrics(d)))
    return list(out.values())


def table(conds: list[Condition], metrics: list[str], steps) -> str:
    """Markdown: per condition the seeds and each metric's mean [95% interval], then Δ vs the first condition."""
    head = ["condition", "seeds"] + metrics + [f"Δ {m} vs first" for m in metrics]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in conds:
        cells, deltas = [], []
        for m in metrics:
            vals, ref = c.per_seed(m, steps), conds[0].per_seed(m, steps)
            cells.append(t_interval(list(vals.values())).fmt(".4g") if vals else "–")
            if c is conds[0] or not vals or not ref:
                deltas.append("–")
                continue
            d = difference(vals, ref)
            deltas.append(d.fmt(".4g") + (" ✱" if d.resolved else ""))
        lines.append(f"| {c.label} | {len(c.runs)} | " + " | ".join(cells + deltas) + " |")
    return "\n".join(lines)


def plot(conds: list[Condition], metric: str, out: epath.Path) -> epath.Path:
    """Per-step mean over seeds per condition (step 0, the base eval, included), the seeds' min–max shaded."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for c in conds:
        series = [run_series(rec, metric, base=True) for _, _, rec in c.runs]
        steps = sorted(set().union(*series))
        if not steps:
            continue
        vals = [[s[t] for s in series if t in s] for t in steps]
        line, = ax.plot(steps, [np.mean(v) for v in vals], "o-", ms=3, label=f"{c.label} ({len(series)} seeds)")
        ax.fill_between(steps, [min(v) for v in vals], [max(v) for v in vals], color=line.get_color(), alpha=0.15)
    ax.set_xlabel("training step")
    ax.set_ylabel(metric)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return save_figure(fig, out / (re.sub(r"[^A-Za-z0-9_.-]+", "_", metric) + ".png"))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m marljax.compare", description=__doc__.split("\n")[2])
    p.add_argument("runs", nargs="+", type=epath.Path, help="run directories (metrics.jsonl + config.yaml)")
    p.add_argument("--by", nargs="+", required=True, help="dotted config keys that define a condition")
    p.add_argument("--metric", nargs="+", required=True, help="metrics.jsonl keys to compare")
    p.add_argument("--steps", help="A:B, the training steps averaged (default: all)")
    p.add_argument("--out", type=epath.Path, help="output directory (default: the first run's parent)")
    args = p.parse_args(argv)
    try:
        steps = tuple(int(x) for x in args.steps.split(":")) if args.steps else None
    except ValueError:
        steps = ()
    if steps is not None and len(steps) != 2:
        raise SystemExit(f"--steps {args.steps!r}: give A:B, e.g. 1:12.")
    out = args.out or args.runs[0].parent
    out.mkdir(parents=True, exist_ok=True)
    conds = conditions(args.runs, args.by)
    pngs = [plot(conds, m, out) for m in args.metric]
    runs = "\n".join(f"- {c.label}: " + ", ".join(n for n, _, _ in c.runs) for c in conds)
    cmd = "python -m marljax.compare " + " ".join(sys.argv[1:] if argv is None else argv)
    text = (f"# Comparison\n\n`{cmd}`\n\nEach cell: mean over seeds of the run's mean over training steps "
            f"{args.steps or '(all)'} [t-based 95% interval over seeds]; ✱: a difference whose interval excludes 0.\n\n{table(conds, args.metric, steps)}\n\nRuns:\n{runs}\n\n"
            + "\n".join(f"![{p.stem}]({p.name})" for p in pngs) + "\n")
    (out / "compare.md").write_text(text)
    print(table(conds, args.metric, steps))
    print(f"wrote {out / 'compare.md'}")


if __name__ == "__main__":
    main()
