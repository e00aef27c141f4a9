# Shared by launch/tpu_vm.sh and launch/gpu_host.sh (sourced, not run).
# Needs: REPO (the checkout), WORK (a local scratch dir), DRY_RUN (0/1).

PYTHON=${PYTHON:-python3}

# Print a command (shell-quoted, prefixed with "+"); run it unless --dry-run.
run() {
  printf '+'; printf ' %q' "$@"; printf '\n'
  if [[ "$DRY_RUN" != 1 ]]; then "$@"; fi
}

# The cell's config from `python -m marljax.matrix` (run locally even under --dry-run: it only writes
# a YAML file into $WORK, and validates the cell name). Sets CONFIG and MODEL.
cell_config() {
  local cell=$1 accelerator=$2
  printf '+ (cd %q && %q -m marljax.matrix --accelerator %q --cell %q --out %q)\n' \
    "$REPO" "$PYTHON" "$accelerator" "$cell" "$WORK"
  CONFIG=$(cd "$REPO" && "$PYTHON" -m marljax.matrix --accelerator "$accelerator" --cell "$cell" --out "$WORK")
  MODEL=$(sed -n 's/^model: *//p' "$CONFIG")
}

# The checkout as a tarball (no .git, .venv or runs), at $WORK/marljax.tgz.
make_bundle() {
  run tar -C "$REPO" -czf "$WORK/marljax.tgz" --exclude=.git --exclude=.venv --exclude=runs \
    --exclude=__pycache__ .
}

# Shell commands that install marljax from ~/marljax.tgz into ~/marljax/.venv with the given JAX
# extra, and fetch the Qwen3 weights of $MODEL into ~/checkpoints/$MODEL (the hosts have network).
install_commands() {
  local jax_extra=$1 hub
  case "$MODEL" in
    qwen3-0.6b) hub=Qwen/Qwen3-0.6B ;;
    qwen3-1.7b) hub=Qwen/Qwen3-1.7B ;;
    qwen3-4b) hub=Qwen/Qwen3-4B ;;
    *) hub= ;;
  esac
  local cmd="mkdir -p marljax && tar -xzf marljax.tgz -C marljax && cd marljax"
  cmd+=" && python3 -m venv .venv && .venv/bin/pip install -q -U pip"
  cmd+=" && .venv/bin/pip install -q '$jax_extra' -r requirements.txt && .venv/bin/pip install -q --no-deps -e ."
  if [[ -n "$hub" ]]; then
    cmd+=" && .venv/bin/pip install -q huggingface_hub"
    cmd+=" && .venv/bin/hf download $hub --local-dir \$HOME/checkpoints/$MODEL"
  fi
  printf '%s' "$cmd"
}
