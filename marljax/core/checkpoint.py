"""Orbax checkpoints of a training run: its `TrainState` (every parameter set, optimizer states, EMA
grads, step) as it is, and a JSON record (step, trackers, counters), so a killed run resumes exactly where
it stopped. `restore_params` reads the parameter sets alone (evaluation needs no optimizer state).

Two directories: RUN_DIR/checkpoints holds the newest `keep` states (resume); RUN_DIR/peak holds the
state of the best held-out eval (the cliff rollback's target, and `evaluate which=peak`). The peak
directory keeps the newest peak plus the newest peak at or before the newest checkpoint: a run resumed
from that checkpoint has that peak as its tracker's best step, and recomputes (and saves again) any later
one. At most two states. RUN_DIR may be a bucket (`marljax.core.storage`): Orbax writes the arrays through
tensorstore and marks a finished gs:// step with commit_success.txt (no rename there).
"""
from __future__ import annotations

import contextlib
from typing import Any

import orbax.checkpoint as ocp
from etils import epath

from marljax.core import storage

WHICH = ("newest", "peak")


class Checkpointer:
    """Saves every `every` steps under RUN_DIR/checkpoints, keeping the newest `keep`; peaks under RUN_DIR/peak."""

    def __init__(self, run_dir: epath.PathLike, every: int, keep: int):
        self.every = every
        run_dir = storage.absolute(run_dir)
        self.dir = run_dir / "checkpoints"
        self.peak_dir = run_dir / "peak"
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                               enable_async_checkpointing=False)
        self.manager = ocp.CheckpointManager(self.dir, options=options)
        self.peaks = ocp.CheckpointManager(self.peak_dir, options=ocp.CheckpointManagerOptions(
            create=True, enable_async_checkpointing=False))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def peak_step(self) -> int | None:
        """Step of the newest saved peak (None before the first eval)."""
        return self.peaks.latest_step()

    def save(self, step: int, state: Any, meta: dict, *, force: bool = False) -> bool:
        """Save `state` (a pytree of arrays) and `meta` (JSON) at `step` when due (or `force`)."""
        if not force and (self.every <= 0 or step % self.every):
            return False
        _save(self.manager, step, state, meta)
        self._prune_peaks()
        return True

    def save_peak(self, step: int, state: Any, meta: dict) -> None:
        """Save the state of a new best eval at `step`."""
        _save(self.peaks, step, state, meta)
        self._prune_peaks()

    def discard_peaks_after(self, step: int | None) -> None:
        """Delete peaks newer than `step` (all when None): a run restarting from `step` saves them again."""
        for s in self.peaks.all_steps():
            if step is None or s > step:
                self.peaks.delete(s)

    def _prune_peaks(self) -> None:
        steps = sorted(self.peaks.all_steps())
        latest = self.latest_step()
        keep = {steps[-1]} if steps else set()
        keep |= {max((s for s in steps if latest is not None and s <= latest), default=None)}
        for s in steps:
            if s not in keep:
                self.peaks.delete(s)

    def restore(self, target: Any, step: int | None = None, *, which: str = "newest") -> tuple[int, Any, dict]:
        """Restore into the structure, dtypes and shardings of `target` (a `TrainState`; as saved, nested
        dicts, when None): the newest checkpoint (`which="newest"`) or the peak (`which="peak"`); `step`
        picks another one."""
        step, where = self._find(step, which)
        manager = self.manager if which == "newest" else self.peaks
        with _mismatch(where, step):
            out = manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()))
        return step, out["state"], out["meta"]

    def restore_params(self, target: dict, step: int | None = None, *, which: str = "newest") -> tuple[int, dict]:
        """(step, the parameter sets alone) restored into the structure, dtypes and shardings of `target`
        ({set: parameters}, or any subset of the saved sets); optimizer states and EMA are not read."""
        step, where = self._find(step, which)
        with ocp.CheckpointManager(where, item_handlers={"state": ocp.PyTreeCheckpointHandler()},
                                   options=ocp.CheckpointManagerOptions(create=False)) as manager, \
                _mismatch(where, step):
            item = {"params": target}
            out = manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
                item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item), partial_restore=True)))
        return step, out["state"]["params"]

    def _find(self, step: int | None, which: str) -> tuple[int, epath.Path]:
        """(the step to restore: `step`, or the newest one of `which`; its directory)."""
        if which not in WHICH:
            raise ValueError(f"which={which!r}; choose one of {WHICH}.")
        manager, where = (self.manager, self.dir) if which == "newest" else (self.peaks, self.peak_dir)
        step = manager.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"No {'checkpoint' if which == 'newest' else 'peak checkpoint'} under {where}.")
        return step, where

    def close(self):
        self.manager.close()
        self.peaks.close()


@contextlib.contextmanager
def _mismatch(where: epath.Path, step: int):
    """A restore that does not fit the target names the likely cause."""
    try:
        yield
    except (ValueError, KeyError, TypeError) as e:
        lines = str(e).strip().splitlines()  # Orbax appends a diff of the whole tree: keep its head
        why = "\n".join(x if len(x) <= 200 else x[:200] + " …" for x in lines[:6])
        why += f"\n… ({len(lines) - 6} more lines)" if len(lines) > 6 else ""
        raise ValueError(
            f"Checkpoint {where}/{step} does not match this run's config (model, policy map, "
            f"LoRA settings must be the same as when it was written, and a checkpoint written before the "
            f"TrainState layout of params/opt_state/ema/step does not restore): {why}\nUse a new run_dir, "
            "or the config the run was started with (RUN_DIR/config.yaml).") from e


def _save(manager: ocp.CheckpointManager, step: int, state: Any, meta: dict) -> None:
    manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                               meta=ocp.args.JsonSave(meta)), force=True)
    manager.wait_until_finished()
