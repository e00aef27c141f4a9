#!/usr/bin/env bash
# The coherence grid of docs/findings.md §1 (issue #46): N = 3, 5 voters × AdamW / SGD × real / null
# advantages, seed 0, 3 steps each, one run at a time; each run's metrics, config and log land in
# docs/findings/coh-*/. N = 1 is not run: one voter and one mini-batch have no pairwise cosine.
# Usage: bash docs/findings/coherence/run.sh [SEED]
set -euo pipefail
cd "$(dirname "$0")/../../.."
seed=${1:-0}
mkdir -p runs/findings
for n in 3 5; do
  for opt in sgd adamw; do
    lr=1.0e-3; [ "$opt" = sgd ] && lr=0.5
    for null in false true; do
      name=coh-n$n-$opt$([ "$null" = true ] && echo -null || true)-s$seed
      rm -rf "runs/findings/$name"
      .venv/bin/python -m marljax.train --config configs/findings/coherence.yaml seed="$seed" \
        workflow.n_votes=$n optim.name=$opt optim.lr=$lr rl.null_advantages=$null \
        run_dir="runs/findings/$name" 2>&1 | tee "runs/findings/$name.log" | grep -E "^step|Error" || true
      mkdir -p "docs/findings/$name"
      cp "runs/findings/$name/metrics.jsonl" "runs/findings/$name/config.yaml" "docs/findings/$name/"
    done
  done
done
