#!/usr/bin/env bash
# Issue #46 item 6: can the base model's supervisory roles act at all? The base SmolLM2-135M-Instruct on 32
# held-out arith problems (the findings' eval set, seed 0), Voting with 3 voters and Orch-Workers, each with
# the worked example in the solve/worker prompts and in the supervisory prompts, at response caps 32, 128
# and 256 tokens. Writes docs/findings/supervisors/<workflow>-<cap>/metrics.json (per-role parse_fail,
# truncated, length_mean). Usage: bash docs/findings/supervisors/run.sh
set -euo pipefail
cd "$(dirname "$0")/../../.."
for wf in voting orch_workers; do
  for cap in 32 128 256; do
    out=docs/findings/supervisors/$wf-$cap
    .venv/bin/python -m marljax.evaluate --config configs/default.yaml workflow.name=$wf \
      workflow.supervisor_example=true sampling.max_new_tokens=$cap n=32 --out "$out" 2>&1 | tail -1
  done
done
