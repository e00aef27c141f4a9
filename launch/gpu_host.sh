#!/usr/bin/env bash
# Run one matrix cell on one or more GPU hosts reachable by ssh: copy and install marljax with
# jax[cuda12] on each, start one JAX process per host (each drives all of its GPUs; several hosts
# join through jax.distributed, host 1 coordinating), then fetch the run dir from the first host.
#
#   launch/gpu_host.sh --cell voting-math-qwen3-0.6b-isolated --hosts gpu1[,gpu2,...]
#       [--accelerator h100|h200] [--port 12355] [--data DIR] [--out DIR] [--dry-run] [-- key=value ...]
#
# The cell's config comes from `python -m marljax.matrix` (sized for one 8-GPU host); with more
# hosts the extra devices go to the mesh's data axis (mesh.data=-1). --dry-run prints every command.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
CELL= HOSTS= ACCELERATOR=h100 PORT=12355 DATA= OUT=runs DRY_RUN=0
EXTRA=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --cell) CELL=$2; shift 2 ;;
    --hosts) HOSTS=$2; shift 2 ;;
    --accelerator) ACCELERATOR=$2; shift 2 ;;
    --port) PORT=$2; shift 2 ;;
    --data) DATA=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    --) shift; EXTRA=("$@"); break ;;
    *) echo "unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
  esac
done
[[ -n "$CELL" && -n "$HOSTS" ]] || { echo "--cell and --hosts are required" >&2; exit 2; }
case "$ACCELERATOR" in
  h100 | h200) ;;
  *) echo "--accelerator $ACCELERATOR: choose h100 or h200" >&2; exit 2 ;;
esac
IFS=, read -r -a HOST_LIST <<< "$HOSTS"
N=${#HOST_LIST[@]}
WORK=$(mktemp -d)
# shellcheck source=launch/common.sh
source "$REPO/launch/common.sh"

cell_config "$CELL" "$ACCELERATOR"
make_bundle
INSTALL=$(install_commands 'jax[cuda12]')
for host in "${HOST_LIST[@]}"; do
  run scp "$WORK/marljax.tgz" "$CONFIG" "$host:"
  run ssh "$host" "$INSTALL"
  if [[ -n "$DATA" ]]; then run scp -r "$DATA" "$host:marljax/data"; fi
done

TRAIN=".venv/bin/python -m marljax.train --config \$HOME/$(basename "$CONFIG") run_dir=runs/$CELL"
[[ "$N" -gt 1 ]] && TRAIN+=" mesh.data=-1"
for kv in "${EXTRA[@]}"; do TRAIN+=" $(printf '%q' "$kv")"; done
PIDS=()
for i in "${!HOST_LIST[@]}"; do
  ENV="MARLJAX_CHECKPOINTS=\$HOME/checkpoints"
  if [[ "$N" -gt 1 ]]; then
    ENV+=" MARLJAX_DISTRIBUTED=1 JAX_COORDINATOR_ADDRESS=${HOST_LIST[0]#*@}:$PORT"
    ENV+=" JAX_NUM_PROCESSES=$N JAX_PROCESS_ID=$i"
  fi
  run ssh "${HOST_LIST[$i]}" "cd marljax && $ENV $TRAIN" &
  PIDS+=($!)
done
STATUS=0
for pid in "${PIDS[@]}"; do wait "$pid" || STATUS=$?; done
[[ "$STATUS" == 0 ]] || { echo "training failed on a host (exit $STATUS)" >&2; exit "$STATUS"; }

run mkdir -p "$OUT"
run scp -r "${HOST_LIST[0]}:marljax/runs/$CELL" "$OUT/"
echo "run dir: $OUT/$CELL"
