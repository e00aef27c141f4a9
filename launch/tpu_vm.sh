#!/usr/bin/env bash
# Run one matrix cell on a Cloud TPU VM slice: create the slice, copy and install marljax on every
# worker, train on all workers at once (one JAX process per host, joined by jax.distributed) with the
# run dir in a bucket, copy the run dir to --out, delete the slice (also on failure, unless --keep).
#
#   launch/tpu_vm.sh --cell voting-math-qwen3-0.6b-isolated --bucket gs://BUCKET/PATH
#       [--accelerator v5e-8|v4-8|v6e-8|v5p-8] [--zone ZONE] [--project PROJECT] [--name VM] [--spot]
#       [--keep] [--data DIR] [--out DIR] [--dry-run] [-- key=value ...]
#
# The cell's config comes from `python -m marljax.matrix`, the slice's type and runtime from
# marljax/core/launch_specs.py; `key=value` after `--` are extra overrides for `python -m marljax.train`.
# The run dir is BUCKET/PATH/<cell>: a slice lost to --spot preemption loses no checkpoint, and the same
# command run again resumes from the newest one. For many cells on many slices, with automatic recovery,
# use `python -m marljax.matrix --emit skypilot` (docs/scale_out.md). --data copies a local dir
# (dapo-math-17k/, deepcoder/) to the workers' marljax/data. --dry-run prints every command instead of
# running it.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
CELL= BUCKET= ACCELERATOR=v5e-8 ZONE=us-west4-a PROJECT= NAME= SPOT=0 KEEP=0 DATA= OUT=runs DRY_RUN=0
EXTRA=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --cell) CELL=$2; shift 2 ;;
    --bucket) BUCKET=${2%/}; shift 2 ;;
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
[[ "$BUCKET" == gs://?* ]] || { echo "--bucket ${BUCKET:-(missing)}: pass --bucket gs://BUCKET/PATH; the run" \
  "dir lives there (BUCKET/PATH/$CELL), so a preempted or deleted slice loses no checkpoint" >&2; exit 2; }
NAME=${NAME:-marljax-${CELL//./-}}
NAME=${NAME:0:60}
WORK=$(mktemp -d)
# shellcheck source=launch/common.sh
source "$REPO/launch/common.sh"
VM=$(cd "$REPO" && "$PYTHON" -c 'import sys
from marljax.core.launch_specs import LaunchSpecError, tpu_vm
try:
    print(*tpu_vm(sys.argv[1]))
except LaunchSpecError as e:
    sys.exit(str(e))' "$ACCELERATOR") || exit 2
read -r TYPE RUNTIME <<< "$VM"

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
TRAIN+=" .venv/bin/python -m marljax.train --config \$HOME/$(basename "$CONFIG") $(printf '%q' "run_dir=$BUCKET/$CELL")"
for kv in "${EXTRA[@]}"; do TRAIN+=" $(printf '%q' "$kv")"; done
run "${GCLOUD[@]}" ssh "$NAME" --worker=all "${WHERE[@]}" --command "$TRAIN"

run mkdir -p "$OUT"
run gcloud storage cp --recursive "$BUCKET/$CELL" "$OUT/"
echo "run dir: $BUCKET/$CELL (copied to $OUT/$CELL)"
