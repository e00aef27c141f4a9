"""Orbax checkpoints of a training run: every parameter set, optimizer states, EMA grads, and a JSON
record (step, trackers, counters), so a killed run resumes exactly where it stopped."""
from __future__ import annotations

import pathlib
from typing import Any

import orbax.checkpoint as ocp


class Checkpointer:
    """Saves every `every` steps under RUN_DIR/checkpoints, keeping the newest `keep`."""

    def __init__(self, run_dir: str | pathlib.Path, every: int, keep: int):
        self.every = every
        self.dir = pathlib.Path(run_dir).absolute() / "checkpoints"
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                               enable_async_checkpointing=False)
        self.manager = ocp.CheckpointManager(self.dir, options=options)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: Any, meta: dict, *, force: bool = False) -> bool:
        """Save `state` (a pytree of arrays) and `meta` (JSON) at `step` when due (or `force`)."""
        if not force and (self.every <= 0 or step % self.every):
            return False
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                        meta=ocp.args.JsonSave(meta)), force=force)
        self.manager.wait_until_finished()
        return True

    def restore(self, target: Any, step: int | None = None) -> tuple[int, Any, dict]:
        """Restore into the structure, dtypes and shardings of `target`; the newest step by default."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"No checkpoint under {self.dir}.")
        try:
            out = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(
                f"Checkpoint {self.dir}/{step} does not match this run's config (model, policy map, "
                f"LoRA settings must be the same as when it was written): {e}. Use a new run_dir, or "
                "the config the run was started with (RUN_DIR/config.yaml).") from e
        return step, out["state"], out["meta"]

    def close(self):
        self.manager.close()
