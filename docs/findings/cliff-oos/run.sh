#!/usr/bin/env bash
# Issue #46 item 7: seeds 2-4 of the cliff configuration, the rollback(0.25) and the one-step mitigation,
# with validation choosing the peak (configs/findings/cliff_oos.yaml). Each run's metrics, config and eval
# transcripts land in docs/findings/oos-<variant>-s<seed>/. ~2 h per run on 2 cores beside other work
# (the config's 24 steps, 7 evals of 64 test and 64 validation problems).
#
# The base runs detect the cliff with the rollback's own settings (a drop of 0.1 below the validation
# peak anywhere in the run) without acting on it, so their `diag/cliff` records say where the rollback
# variant would fire. Until it fires the rollback run is the base run bit for bit
# (tests/test_rollback.py::test_a_rollback_that_never_fires_changes_nothing); a seed whose base run never
# fires has no separate rollback run to make.
#
# Usage: bash docs/findings/cliff-oos/run.sh [VARIANT:SEED ...]   (default: base:2 base:3 base:4)
#   VARIANT: base | rollback025 | onestep
set -euo pipefail
cd "$(dirname "$0")/../../.."
mkdir -p runs/findings
runs=("$@"); [ ${#runs[@]} -eq 0 ] && runs=(base:2 base:3 base:4)
detect=(diagnostics.cliff_window=1.0 diagnostics.cliff_drop=0.1)
for run in "${runs[@]}"; do
  variant=${run%%:*} seed=${run##*:}
  case $variant in
    base) extra=("${detect[@]}") ;;
    rollback025) extra=("${detect[@]}" diagnostics.rollback_on_cliff=true diagnostics.rollback_lr_scale=0.25) ;;
    onestep) extra=("${detect[@]}" rl.minibatch=balanced) ;;
    *) echo "unknown variant $variant (base | rollback025 | onestep)" >&2; exit 2 ;;
  esac
  name=oos-$variant-s$seed
  .venv/bin/python -m marljax.train --config configs/findings/cliff_oos.yaml seed="$seed" "${extra[@]}" \
    run_dir="runs/findings/$name" > "runs/findings/$name.log" 2>&1
  mkdir -p "docs/findings/$name"
  cp runs/findings/$name/{metrics.jsonl,config.yaml} runs/findings/$name/*_step*.jsonl "docs/findings/$name/"
done
