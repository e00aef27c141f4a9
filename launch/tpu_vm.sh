#!/usr/bin/env bash
# Run one matrix cell on a Cloud TPU VM slice: create the slice, copy and install marljax on every
# worker, train on all workers at once (one JAX process per host, joined by jax.distributed), fetch
# the run dir from worker 0, delete the slice (also on failure, unless --keep).
#
#   launch/tpu_vm.sh --cell voting-math-qwen3-0.6b-isolated [--accelerator v5e-8|v4-8]
#       [--zone ZONE] [--project PROJECT] [--name VM] [--spot] [--keep] [--data DIR] [--out DIR]
#       [--dry-run] [-- key=value ...]
#
# The cell's config comes from `python -m marljax.matrix`; `key=value` after `--` are extra
# overrides for `python -m marljax.train`. --data copies a local dir (dapo-math-17k/, deepcoder/) to
# the workers' marljax/data. --dry-run prints every command instead of running it.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
CELL= ACCELERATOR=v5e-8 ZONE=us-west4-a PROJECT= NAME= SPOT=0 KEEP=0 DATA= OUT=runs DRY_RUN=0
EXTRA=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --cell) CELL=$2; shift 2 ;;
    --accelerator) ACCELERATOR=$2; shift 2 ;;
    --zone) ZONE=$2; shift 2 ;;
    --project) PROJECT=$2; shift 2 ;;
    --name) NAME=$2; shift 2 ;;
    --spot) SPOT=1; shift ;;
    --keep) KEEP=1; shift ;;
    --data) DATA=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    --) shift; EXTRA=("$@"); break ;;
    *) echo "unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
  esac
done
[[ -n "$CELL" ]] || { echo "--cell is required; python -m marljax.matrix --dry-run lists the cells" >&2; exit 2; }
case "$ACCELERATOR" in
  v5e-8) TYPE=v5litepod-8 RUNTIME=v2-alpha-tpuv5-lite ;;
  v4-8) TYPE=v4-8 RUNTIME=tpu-ubuntu2204-base ;;
  *) echo "--accelerator $ACCELERATOR: choose v5e-8 or v4-8" >&2; exit 2 ;;
esac
NAME=${NAME:-marljax-${CELL//./-}}
NAME=${NAME:0:60}
WORK=$(mktemp -d)
# shellcheck source=launch/common.sh
source "$REPO/launch/common.sh"

GCLOUD=(gcloud compute tpus tpu-vm)
WHERE=(--zone "$ZONE")
[[ -n "$PROJECT" ]] && WHERE+=(--project "$PROJECT")

cell_config "$CELL" "$ACCELERATOR"
make_bundle

CREATE=("${GCLOUD[@]}" create "$NAME" "${WHERE[@]}" --accelerator-type "$TYPE" --version "$RUNTIME")
[[ "$SPOT" == 1 ]] && CREATE+=(--spot)
run "${CREATE[@]}"
delete_vm() { run "${GCLOUD[@]}" delete "$NAME" "${WHERE[@]}" --quiet; }
[[ "$KEEP" == 1 ]] || trap delete_vm EXIT

run "${GCLOUD[@]}" scp "$WORK/marljax.tgz" "$CONFIG" "$NAME:" --worker=all "${WHERE[@]}"
run "${GCLOUD[@]}" ssh "$NAME" --worker=all "${WHERE[@]}" --command "$(install_commands 'jax[tpu]')"
if [[ -n "$DATA" ]]; then
  run "${GCLOUD[@]}" scp --recurse "$DATA" "$NAME:marljax/data" --worker=all "${WHERE[@]}"
fi

TRAIN="cd marljax && MARLJAX_DISTRIBUTED=1 MARLJAX_CHECKPOINTS=\$HOME/checkpoints"
TRAIN+=" .venv/bin/python -m marljax.train --config \$HOME/$(basename "$CONFIG") run_dir=runs/$CELL"
for kv in "${EXTRA[@]}"; do TRAIN+=" $(printf '%q' "$kv")"; done
run "${GCLOUD[@]}" ssh "$NAME" --worker=all "${WHERE[@]}" --command "$TRAIN"

run mkdir -p "$OUT"
run "${GCLOUD[@]}" scp --recurse "$NAME:marljax/runs/$CELL" "$OUT/" --worker=0 "${WHERE[@]}"
echo "run dir: $OUT/$CELL"
