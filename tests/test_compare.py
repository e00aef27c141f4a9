"""`marljax.compare` groups runs by config values and gives per-condition means with t-based 95% intervals
over seeds and the difference from the first condition (paired by seed), equal to a float64 numpy/scipy
computation of the same numbers."""
import json
import math

import numpy as np
import pytest
import yaml

from scipy import stats

from marljax.analysis.seed_stats import difference, t_interval
from marljax.compare import conditions, main, run_series


def _run(tmp_path, name, n_votes, seed, values):
    d = tmp_path / name
    d.mkdir()
    (d / "config.yaml").write_text(yaml.safe_dump({"seed": seed, "workflow": {"name": "voting", "n_votes": n_votes}}))
    lines = [json.dumps({"step": 0, "eval/pass@1": 0.5})]  # an eval-only record: not a training step
    lines += [json.dumps({"step": s, "set/generator/step_delta": v}) for s, v in enumerate(values, start=1)]
    (d / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return d


def test_groups_means_and_differences(tmp_path, capsys):
    runs = [_run(tmp_path, "n1s0", 1, 0, [1.0, 2.0, 3.0]), _run(tmp_path, "n3s0", 3, 0, [3.0, 5.0, 7.0]),
            _run(tmp_path, "n1s1", 1, 1, [2.0, 2.0, 2.0]), _run(tmp_path, "n3s1", 3, 1, [6.0, 6.0, 9.0])]
    conds = conditions(runs, ["workflow.n_votes"])
    assert [c.label for c in conds] == ["n_votes=1", "n_votes=3"]
    assert [n for n, _, _ in conds[1].runs] == ["n3s0", "n3s1"]
    assert conds[1].per_seed("set/generator/step_delta", None) == {0: 5.0, 1: 7.0}
    assert run_series(conds[0].runs[0][2], "set/generator/step_delta", (2, 3)) == {2: 2.0, 3: 3.0}
    assert run_series(conds[0].runs[0][2], "eval/pass@1") == {} and run_series(
        conds[0].runs[0][2], "eval/pass@1", base=True) == {0: 0.5}

    out = tmp_path / "cmp"
    main([str(r) for r in runs] + ["--by", "workflow.n_votes", "--metric", "set/generator/step_delta",
                                   "--steps", "1:3", "--out", str(out)])
    a, b = np.array([2.0, 2.0]), np.array([5.0, 7.0])
    t1 = stats.t.ppf(0.975, 1)  # 12.706: two seeds, one degree of freedom
    half_b = np.std(b, ddof=1) / math.sqrt(2) * t1
    d = b - a  # paired by seed: 3, 5
    half_d = np.std(d, ddof=1) / math.sqrt(2) * t1
    text = (out / "compare.md").read_text()
    assert "| n_votes=1 | 2 | 2 [+2, +2] | –" in text
    assert (f"| n_votes=3 | 2 | 6 [{6 - half_b:+.4g}, {6 + half_b:+.4g}] | "
            f"4 [{4 - half_d:+.4g}, {4 + half_d:+.4g}] |") in text  # not resolved: no ✱
    assert (out / "set_generator_step_delta.png").stat().st_size > 0


def test_one_seed_has_no_interval_and_missing_config_is_named(tmp_path):
    assert math.isnan(t_interval([1.0]).half) and t_interval([1.0]).fmt() == "1.000 (1 seed)"
    (tmp_path / "bare").mkdir()
    with pytest.raises(SystemExit, match="no config.yaml"):
        conditions([tmp_path / "bare"], ["seed"])
    with pytest.raises(SystemExit, match="give A:B"):
        main([str(tmp_path / "bare"), "--by", "seed", "--metric", "x", "--steps", "a:b"])


def test_intervals_against_scipy_paired_and_welch():
    """t-based 95% intervals: the mean ± t(0.975, n−1)·s/√n; a difference over the same seeds is paired (it
    resolves a shift the seeds share that an unpaired one would not), over different seeds Welch's."""
    x = [0.50, 0.55, 0.61]
    iv = t_interval(x)
    lo, hi = stats.t.interval(0.95, 2, loc=np.mean(x), scale=stats.sem(x))
    assert (iv.mean - iv.half, iv.mean + iv.half) == pytest.approx((lo, hi), rel=1e-12)
    a, b = {2: 0.50, 3: 0.55, 4: 0.61}, {2: 0.40, 3: 0.46, 4: 0.50}
    paired = difference(a, b)
    assert paired.paired and paired.resolved and paired.mean == pytest.approx(0.1, rel=1e-12)
    welch = difference(a, {5: 0.40, 6: 0.46, 7: 0.50})
    r = stats.ttest_ind(list(a.values()), [0.40, 0.46, 0.50], equal_var=False)
    ci = r.confidence_interval(0.95)
    assert not welch.paired and (welch.mean - welch.half, welch.mean + welch.half) == pytest.approx(
        (ci.low, ci.high), rel=1e-9)
    assert not difference({0: 0.3, 1: 0.9}, {0: 0.2, 1: 0.1}).resolved  # wide with 1 df: not resolved
