#!/usr/bin/env bash
# Issue #46 item 7: seeds 2-4 of the cliff configuration, the rollback(0.25) and the one-step mitigation,
# with validation choosing the peak (configs/findings/cliff_oos.yaml). One run at a time, ~60 min each on
# 2 cores: 9 runs. Each run's metrics, config and eval transcripts land in docs/findings/oos-*/.
# Usage: bash docs/findings/cliff-oos/run.sh [SEED ...]   (default: 2 3 4)
set -euo pipefail
cd "$(dirname "$0")/../../.."
mkdir -p runs/findings
seeds=("$@"); [ ${#seeds[@]} -eq 0 ] && seeds=(2 3 4)
for seed in "${seeds[@]}"; do
  for variant in base rollback025 onestep; do
    case $variant in
      base) extra=() ;;
      rollback025) extra=(diagnostics.rollback_on_cliff=true diagnostics.rollback_lr_scale=0.25
                          diagnostics.cliff_window=1.0 diagnostics.cliff_drop=0.1) ;;
      onestep) extra=(rl.minibatch=balanced) ;;
    esac
    name=oos-$variant-s$seed
    .venv/bin/python -m marljax.train --config configs/findings/cliff_oos.yaml seed="$seed" "${extra[@]}" \
      run_dir="runs/findings/$name" > "runs/findings/$name.log" 2>&1
    mkdir -p "docs/findings/$name"
    cp runs/findings/$name/{metrics.jsonl,config.yaml} runs/findings/$name/*_step*.jsonl "docs/findings/$name/"
  done
done
