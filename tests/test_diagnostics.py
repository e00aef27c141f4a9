"""Diagnostics on synthetic series: a known terminal cliff, recoveries, an early collapse; dominance; drift."""
import json

import pytest

from marljax.rl.diagnostics import AccuracyTracker, CliffConfig, DominanceTracker, LengthDrift, detect_cliff

STEPS = list(range(0, 101, 10))  # evals every 10 steps of a 100-step run; cutoff = 75 with the defaults
RISE = [0.30, 0.35, 0.40, 0.45, 0.50, 0.52, 0.53, 0.54]  # steps 0..70, peak 0.54 at 70
# δ = 0.05: a drop is ≤ 0.49, healthy is ≥ 0.515.


def run(accs, total=100, cfg=CliffConfig()):
    t = AccuracyTracker(total_steps=total, cliff=cfg)
    fired = [s for s, a in zip(STEPS, accs) if t.update(s, a)]
    return t, fired


def test_terminal_cliff_detected_online_and_offline():
    accs = RISE + [0.53, 0.40, 0.38]
    t, fired = run(accs)
    assert fired == [90]  # step 80 (0.53) is still healthy; 0.40 at step 90 is the drop
    s = t.summary()
    assert s == {"n_evals": 11, "base": 0.30, "peak": 0.54, "best_step": 70, "final": 0.38, "final_step": 100,
                 "gain": pytest.approx(0.24), "drop": pytest.approx(0.16), "drop_step": 90, "cliff": True,
                 "collapsed": True, "cliff_events": [90]}
    assert detect_cliff(STEPS, accs) == s


def test_recovery_within_half_delta_clears_the_cliff():
    accs = RISE + [0.45, 0.52, 0.50]  # drop at 80, back to 0.52 ≥ 0.515 at 90, 0.50 is inside the band
    t, fired = run(accs)
    assert fired == [80]  # it fired online ...
    assert not t.in_cliff and t.drop_step is None  # ... and the recovery cleared it
    assert detect_cliff(STEPS, accs)["cliff"] is False


def test_partial_recovery_is_still_a_cliff():
    accs = RISE + [0.53, 0.45, 0.50]  # 0.50 < 0.515: won back less than δ/2
    assert detect_cliff(STEPS, accs)["cliff"] is True
    # a wider recovery band (within 0.9·δ = 0.045 of the peak) counts 0.50 as recovered
    assert detect_cliff(STEPS, accs, cfg=CliffConfig(recovery_frac=0.9))["cliff"] is False


def test_early_collapse_is_not_terminal_and_window_and_delta_matter():
    early = [0.30, 0.40, 0.50, 0.44, 0.30, 0.30, 0.31, 0.30, 0.29, 0.30, 0.30]  # drop at step 30
    s = detect_cliff(STEPS, early)
    assert s["collapsed"] and s["drop_step"] == 30 and not s["cliff"]
    assert detect_cliff(STEPS, early, cfg=CliffConfig(window_frac=0.75))["cliff"]  # cutoff 25
    small = RISE + [0.53, 0.50, 0.50]  # 0.04 below the peak: not a drop with δ = 0.05
    assert not detect_cliff(STEPS, small)["collapsed"]
    assert detect_cliff(STEPS, small, cfg=CliffConfig(min_drop=0.03))["cliff"]
    assert not detect_cliff(STEPS, RISE + [0.53, 0.40, 0.38], total_steps=400)["cliff"]  # run is far from its end


def test_state_dict_round_trip_resumes_exactly():
    accs = RISE + [0.53, 0.40, 0.38]
    t = AccuracyTracker(total_steps=100)
    for s, a in zip(STEPS[:9], accs[:9]):
        t.update(s, a)
    restored = AccuracyTracker.from_state_dict(json.loads(json.dumps(t.state_dict())))
    assert restored == t
    for s, a in zip(STEPS[9:], accs[9:]):
        restored.update(s, a)
    assert restored.summary() == run(accs)[0].summary()


def test_tracker_errors():
    t = AccuracyTracker(total_steps=10)
    t.update(0, 0.5)
    with pytest.raises(ValueError, match="must increase"):
        t.update(0, 0.5)
    with pytest.raises(ValueError, match="not finite"):
        t.update(1, float("nan"))
    with pytest.raises(ValueError, match="window_frac"):
        CliffConfig(window_frac=0)
    assert AccuracyTracker(total_steps=5).summary() == {"n_evals": 0}


def test_dominant_role_over_a_window():
    d = DominanceTracker(window=3)
    assert d.index()[0] is None
    agg = [0.25, 0.25, 0.25, 0.7, 0.8, 0.9]
    for a in agg:
        d.update({"generator": 1 - a, "aggregator": a})
    role, value = d.index()
    assert role == "aggregator" and value == pytest.approx(0.8)
    full = DominanceTracker(window=6)
    for i, a in enumerate(agg):
        full.update({"generator": 1 - a, "aggregator": a} if i else {"generator": 1.0})  # step 0: aggregator absent
    assert full.mean_shares() == pytest.approx({"generator": (1 + 1.5 + 0.3 + 0.2 + 0.1) / 6,
                                                "aggregator": (0.5 + 2.4) / 6})
    assert full.index() == ("generator", pytest.approx(3.1 / 6))
    silent = DominanceTracker(window=2)
    for _ in range(2):
        silent.update({"orchestrator": 0.0, "worker": 0.0})  # reward 0 everywhere: no gradient
    assert silent.index() == (None, 0.0)
    silent.update({"orchestrator": 0.0, "worker": 1.0})
    assert silent.index() == ("worker", 0.5)
    again = DominanceTracker.from_state_dict(json.loads(json.dumps(d.state_dict())))
    assert again.summary() == d.summary() == {"dominant_role": "aggregator", "dominance": pytest.approx(0.8),
                                              "n_roles": 2, "window_used": 3}


def test_length_drift_vs_first_step():
    drift = LengthDrift()
    assert drift.update(0, {"generator": 200.0, "aggregator": 8.0}) == {"generator": 1.0, "aggregator": 1.0}
    drift.update(10, {"generator": 220.0, "aggregator": 160.0})
    assert drift.update(20, {"aggregator": 120.0, "evaluator": 50.0}) == {"aggregator": 15.0, "evaluator": 1.0}
    s = drift.summary()
    assert s["generator"] == {"base": 200.0, "base_step": 0, "last": 220.0, "ratio": pytest.approx(1.1),
                              "max_ratio": pytest.approx(1.1)}
    assert s["aggregator"]["max_ratio"] == 20.0 and s["aggregator"]["ratio"] == 15.0
    assert s["evaluator"]["base_step"] == 20
    assert LengthDrift.from_state_dict(json.loads(json.dumps(drift.state_dict()))) == drift
    with pytest.raises(ValueError, match="finite"):
        drift.update(30, {"generator": -1.0})
