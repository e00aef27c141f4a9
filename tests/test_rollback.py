"""Cliff rollback on a scripted accuracy series: the peak checkpoint is kept, restored when the cliff
detector fires, the lr is scaled afterwards (or the run stops), and resume stays exact.

The tiny random model earns reward 0 on arith, so every advantage and gradient is 0. The parameters still
move every step through AdamW's decoupled weight decay (`optim.weight_decay=0.5`: LoRA A shrinks by
lr·0.5 per step, B stays 0), so "the parameters after a rollback equal the peak's, not the newest's" is a
real check, and the shrink rate follows the lr. Evaluation is replaced by a scripted pass@1 per step
(`Run.evaluate` is monkeypatched), which is what the cliff detector reads.
"""
import json
import types

import jax
import numpy as np
import pytest
from test_train import TINY

from marljax.config import ConfigError, load_config
from marljax.core.checkpoint import Checkpointer
from marljax.train import Run
from marljax.train import main as train_main

# evals every 2 steps of 10; the cliff window is the last 75% (drops at step ≥ 2.5 are terminal), δ = 0.05
ACC = {0: 0.2, 2: 0.6, 4: 0.1, 6: 0.6, 8: 0.1, 10: 0.6}
ARGS = [*TINY, "task=arith", "workflow=single", "policy=shared", "steps=10", "seed=0", "checkpoint.every=1",
        "checkpoint.keep=20", "optim.weight_decay=0.5", "diagnostics.cliff_window=0.75", "diagnostics.rollback_on_cliff=true"]


def _scripted_eval(self, seed, problems=None):
    """`Run.evaluate` replaced: the pass@1 of `ACC` at the eval's step (its seed is run seed + step)."""
    return types.SimpleNamespace(metrics={"pass@1": ACC[seed - self.cfg.seed]}, transcripts=[])


@pytest.fixture
def scripted(monkeypatch):
    monkeypatch.setattr(Run, "evaluate", _scripted_eval)


def _records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _state(run_dir, step, which="newest"):
    return Checkpointer(run_dir, 1, 20).restore(None, step=step, which=which)


def _equal(a, b) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb))


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """One uninterrupted run with `rollback_lr_scale=0.5`: cliffs at steps 4 and 8, both back to step 2."""
    run_dir = tmp_path_factory.mktemp("rollback") / "straight"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Run, "evaluate", _scripted_eval)
        train_main([*ARGS, f"run_dir={run_dir}", "diagnostics.rollback_lr_scale=0.5"])
    return run_dir


def test_rollback_restores_the_peak_and_scales_the_lr(straight):
    records = _records(straight)
    assert [r["step"] for r in records] == list(range(11))
    rolled = [(r["step"], r["diag/rollback_from"], r["diag/rollback_to"], r["diag/lr_scale"])
              for r in records if r.get("diag/rollback")]
    assert rolled == [(4, 4, 2, 0.5), (8, 8, 2, 0.25)]
    assert all(r.get("diag/cliff") == 1 for r in records if r.get("diag/rollback"))
    assert [r["lr"] for r in records[1:]] == [1e-3] * 4 + [5e-4] * 4 + [2.5e-4] * 2  # scaled from the next step on
    peak_step, peak, peak_meta = _state(straight, None, "peak")
    assert peak_step == 2 and peak_meta["accuracy"]["best_step"] == 2
    for step in (4, 8):  # the saved state of a rollback step is the peak's: parameters, optimizer, EMA
        _, after, meta = _state(straight, step)
        assert _equal(after, peak)
        assert meta["lr_scale"] == {4: 0.5, 8: 0.25}[step]
        _, before, _ = _state(straight, step - 1)
        assert not _equal(before["params"], peak["params"])  # weight decay moved them since the peak
    # after the rollback, A shrinks at the scaled rate: step 5 applies (1 − 5e-4 · 0.5) to the peak's A
    a_peak = np.asarray(jax.tree.leaves(peak["params"])[0])
    a5 = np.asarray(jax.tree.leaves(_state(straight, 5)[1]["params"])[0])
    np.testing.assert_allclose(a5, a_peak * (1 - 5e-4 * 0.5), rtol=1e-6, atol=1e-9)


def test_rollback_then_stop_ends_the_run_on_the_peak(tmp_path, scripted, capfd):
    run_dir = tmp_path / "stop"
    train_main([*ARGS, f"run_dir={run_dir}"])  # rollback_lr_scale unset: stop after restoring
    err = capfd.readouterr().err
    assert "step 4: terminal cliff (pass@1 0.100, peak 0.600); rolled back to step 2's parameters" in err
    assert "stopping" in err
    records = _records(run_dir)
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4] and records[-1]["diag/rollback_to"] == 2
    ckpt = Checkpointer(run_dir, 1, 20)
    assert ckpt.latest_step() == 4
    _, final, meta = _state(run_dir, 4)
    assert _equal(final, _state(run_dir, 2, "peak")[1]) and meta["stopped"].startswith("cliff at step 4")
    train_main([*ARGS, f"run_dir={run_dir}"])  # a re-run of a stopped run trains no further
    assert "nothing left to train" in capfd.readouterr().err
    assert [r["step"] for r in _records(run_dir)] == [0, 1, 2, 3, 4]


class Killed(Exception):
    pass


def test_resume_keeps_the_peak_and_the_lr_scale(tmp_path, scripted, monkeypatch, straight):
    """Killed in step 3 (peak of step 2 saved, newest checkpoint 2) and in step 6 (after the first rollback):
    each resume restores the peak for the next rollback and the lr scale, and ends equal to `straight`."""
    run_dir = tmp_path / "killed"
    crash_at, train_step = {3, 6}, Run.train_step

    def flaky(self, step):
        if step in crash_at:
            crash_at.discard(step)
            raise Killed(step)
        return train_step(self, step)
    monkeypatch.setattr(Run, "train_step", flaky)
    args = [*ARGS, f"run_dir={run_dir}", "diagnostics.rollback_lr_scale=0.5"]
    for _ in range(2):
        with pytest.raises(Killed):
            train_main(args)
    assert Checkpointer(run_dir, 1, 20).peak_step() == 2
    train_main(args)

    def comparable(r):
        return {k: v for k, v in r.items() if not k.startswith(("time/", "throughput/"))}
    assert [comparable(r) for r in _records(run_dir)] == [comparable(r) for r in _records(straight)]
    assert _equal(_state(run_dir, 10)[1], _state(straight, 10)[1])


# validation (task.val_n) carries the cliff of ACC; the test set peaks at step 4 and drops at 6, which would
# fire a rollback to step 4 if the tracker read it
TEST_ACC = {0: 0.3, 2: 0.0, 4: 0.9, 6: 0.2}


def test_validation_alone_selects_the_peak_and_fires_the_rollback(tmp_path, monkeypatch, capfd):
    def scripted(self, seed, problems=None):
        on_val = problems is not None and problems is self.problems.val
        acc = (ACC if on_val else TEST_ACC)[seed - self.cfg.seed]
        return types.SimpleNamespace(metrics={"pass@1": acc}, transcripts=[{"problem_id": "p", "reward": acc}])
    monkeypatch.setattr(Run, "evaluate", scripted)
    run_dir = tmp_path / "val"
    train_main([*ARGS, "steps=6", "task.val_n=8", f"run_dir={run_dir}", "diagnostics.rollback_lr_scale=0.5"])
    records = _records(run_dir)
    evals = [(r["step"], r["val/pass@1"], r["eval/pass@1"]) for r in records if "val/pass@1" in r]
    assert evals == [(t, ACC[t], TEST_ACC[t]) for t in (0, 2, 4, 6)]
    assert [(r["step"], r["diag/rollback_to"]) for r in records if r.get("diag/rollback")] == [(4, 2)]
    assert Checkpointer(run_dir, 1, 20).peak_step() == 2
    assert "terminal cliff (validation pass@1 0.100, peak 0.600)" in capfd.readouterr().err
    assert json.loads((run_dir / "val_step4.jsonl").read_text())["reward"] == ACC[4]
    assert json.loads((run_dir / "eval_step4.jsonl").read_text())["reward"] == TEST_ACC[4]


def test_rollback_config_errors(tmp_path):  # refused when the config loads
    with pytest.raises(ConfigError, match="rollback_lr_scale=0.5 has no effect without diagnostics.rollback_on_cliff"):
        load_config(None, [*TINY, "workflow=single", f"run_dir={tmp_path}", "diagnostics.rollback_lr_scale=0.5"])
    with pytest.raises(ConfigError, match="must be > 0"):
        load_config(None, [*TINY, "workflow=single", f"run_dir={tmp_path}", "diagnostics.rollback_on_cliff=true",
                           "diagnostics.rollback_lr_scale=0"])


def test_a_rollback_that_never_fires_changes_nothing(tmp_path, monkeypatch):
    """With no drop of δ below the peak the rollback run is the plain run, record for record and bit for bit
    (what lets docs/findings read a rollback variant off its base run's validation curve)."""
    acc = {0: 0.2, 2: 0.6, 4: 0.58}  # a dip of 0.02 < δ = 0.05: no cliff
    monkeypatch.setattr(Run, "evaluate", lambda self, seed, problems=None: types.SimpleNamespace(
        metrics={"pass@1": acc[seed - self.cfg.seed]}, transcripts=[]))
    plain, rolled = tmp_path / "plain", tmp_path / "rolled"
    base = [a for a in ARGS if not a.startswith("diagnostics.rollback_on_cliff")] + ["steps=4"]
    train_main([*base, f"run_dir={plain}"])
    train_main([*base, f"run_dir={rolled}", "diagnostics.rollback_on_cliff=true", "diagnostics.rollback_lr_scale=0.25"])

    def comparable(r):
        return {k: v for k, v in r.items() if not k.startswith(("time/", "throughput/"))}
    assert [comparable(r) for r in _records(rolled)] == [comparable(r) for r in _records(plain)]
    assert not any(r.get("diag/cliff") for r in _records(rolled))
    assert _equal(_state(rolled, 4)[1], _state(plain, 4)[1])
