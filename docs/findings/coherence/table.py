"""The coherence grid's table (docs/findings.md §1): per run of docs/findings/coh-*/ the generator's mean agent
and mini-batch gradient cosines and its step coherence step_delta / (k · update_norm) over the training steps
that had a gradient (k optimizer steps; unrelated equal steps give 1/√k, aligned ones 1).

    python docs/findings/coherence/table.py            # from the repository root
"""
import glob
import json
import math
import os

import numpy as np
import yaml


def row(run_dir: str) -> str:
    cfg = yaml.safe_load(open(os.path.join(run_dir, "config.yaml")))
    recs = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    recs = [r for r in recs if r.get("step", 0) >= 1]
    # a step whose groups were all flat has no gradient (AdamW still moves on its momentum: not counted)
    live = [r for r in recs if r.get("role/generator/grad_norm", 0) > 0]

    def mean(key):
        vals = [r[key] for r in live if isinstance(r.get(key), float) and math.isfinite(r[key])]
        return (f"{np.mean(vals):+.3f}" + (f" ({', '.join(f'{v:+.2f}' for v in vals)})" if len(vals) > 1 else "")
                if vals else "–")

    k = cfg["workflow"]["n_votes"]
    ratio = [r["set/generator/step_delta"] / (r["set/generator/opt_steps"] * r["set/generator/update_norm"])
             for r in live]
    ratio_s = f"{np.mean(ratio):.3f} ({', '.join(f'{v:.2f}' for v in ratio)})" if ratio else "–"
    null = "null" if cfg["rl"].get("null_advantages") else "real"
    rewards = ", ".join(f"{r['reward/mean']:.2f}" for r in recs)
    return (f"| {os.path.basename(run_dir)} | {k} | {cfg['optim']['name']} (lr {cfg['optim']['lr']:g}) | {null} | "
            f"{len(live)} of {len(recs)} | {mean('role/generator/agent_grad_cos')} | "
            f"{mean('role/generator/minibatch_grad_cos')} | {ratio_s} | {1 / math.sqrt(k):.3f} | {rewards} |")


def main() -> None:
    print("| run | N | optimizer | advantages | steps with a gradient | agent_grad_cos | minibatch_grad_cos | "
          "step_delta / (k · update_norm) | 1/√k | training reward per step |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for d in sorted(glob.glob("docs/findings/coh-*-s[0-9]")):
        print(row(d))


if __name__ == "__main__":
    main()
