"""Peak retention: RUN_DIR/peak keeps the newest peak and the newest one a resume from the newest checkpoint
would roll back to, whatever `checkpoint.keep` deletes."""
import numpy as np

from marljax.core.checkpoint import Checkpointer


def test_peak_survives_retention_and_resume(tmp_path):
    ck = Checkpointer(tmp_path, every=2, keep=1)

    def state(step):
        return {"w": np.full((3,), float(step), np.float32)}

    peaks = []
    for step, new_peak, want in [(0, True, [0]), (1, False, [0]), (2, False, [0]), (3, True, [0, 3]),
                                 (4, False, [3]), (5, True, [3, 5]), (6, False, [5]), (7, True, [5, 7]),
                                 (8, False, [7])]:
        if new_peak:  # the trainer saves a peak before the regular checkpoint of the same step
            ck.save_peak(step, state(step), {"step": step})
        ck.save(step, state(step), {"step": step})
        peaks.append(sorted(ck.peaks.all_steps()))
        assert peaks[-1] == want, (step, peaks)
    assert ck.manager.all_steps() == [8]  # keep=1: only the newest regular checkpoint
    step, restored, meta = ck.restore(None, which="peak")
    assert step == 7 and meta == {"step": 7} and np.array_equal(np.asarray(restored["w"]), state(7)["w"])
    ck.save_peak(9, state(9), {"step": 9})  # a peak after the newest checkpoint (8) ...
    assert sorted(ck.peaks.all_steps()) == [7, 9]
    ck.discard_peaks_after(ck.latest_step())  # ... is dropped on resume from 8; the run saves it again
    assert ck.peak_step() == 7
    ck.discard_peaks_after(None)  # a fresh start (no checkpoint) clears them all
    assert ck.peak_step() is None
    ck.close()


def test_a_checkpoint_of_another_layout_fails_with_a_short_message(tmp_path):
    """A state saved in the pre-TrainState layout ({params, opt, ema}) does not restore into today's; the error
    names the fix and keeps only the head of Orbax's tree diff."""
    import jax.numpy as jnp
    import pytest

    from marljax.rl.state import TrainState

    ck = Checkpointer(tmp_path, every=1, keep=1)
    old = {"params": {"s": {"w": np.zeros((2,), np.float32)}}, "opt": {"s": {f"m{i}": np.zeros((2,), np.float32)
                                                                            for i in range(40)}}, "ema": {}}
    ck.save(1, old, {"step": 1})
    target = TrainState(params={"s": {"w": jnp.zeros((2,))}}, opt_state={"s": {"m": jnp.zeros((2,))}}, ema={},
                        step=jnp.zeros((), jnp.int32))
    with pytest.raises(ValueError, match="does not match this run's config") as e:
        ck.restore(target)
    msg = str(e.value)
    assert "new run_dir" in msg and len(msg.splitlines()) <= 9 and len(msg) < 2000, msg  # Orbax's own: 13 lines, 9k chars
    ck.close()
