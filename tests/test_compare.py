"""`marljax.compare` groups runs by config values and gives per-condition means ± s.e. over seeds and the
difference from the first condition, equal to a float64 numpy computation of the same numbers."""
import json
import math

import numpy as np
import pytest
import yaml

from marljax.compare import conditions, main, mean_se, run_series


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
    assert [n for n, _ in conds[1].runs] == ["n3s0", "n3s1"]
    assert conds[1].per_run("set/generator/step_delta", None) == [5.0, 7.0]
    assert run_series(conds[0].runs[0][1], "set/generator/step_delta", (2, 3)) == {2: 2.0, 3: 3.0}
    assert run_series(conds[0].runs[0][1], "eval/pass@1") == {} and run_series(
        conds[0].runs[0][1], "eval/pass@1", base=True) == {0: 0.5}

    out = tmp_path / "cmp"
    main([str(r) for r in runs] + ["--by", "workflow.n_votes", "--metric", "set/generator/step_delta",
                                   "--steps", "1:3", "--out", str(out)])
    a, b = np.array([2.0, 2.0]), np.array([5.0, 7.0])
    se_b = np.std(b, ddof=1) / math.sqrt(2)
    assert mean_se(list(b)) == pytest.approx((6.0, se_b))
    text = (out / "compare.md").read_text()
    assert "| n_votes=1 | 2 | 2 ± 0 | –" in text
    assert f"| n_votes=3 | 2 | 6 ± {se_b:.2g} | {b.mean() - a.mean():.4g} ± {math.hypot(se_b, 0.0):.2g} |" in text
    assert (out / "set_generator_step_delta.png").stat().st_size > 0


def test_one_seed_has_no_se_and_missing_config_is_named(tmp_path):
    assert math.isnan(mean_se([1.0])[1])
    (tmp_path / "bare").mkdir()
    with pytest.raises(SystemExit, match="no config.yaml"):
        conditions([tmp_path / "bare"], ["seed"])
    with pytest.raises(SystemExit, match="give A:B"):
        main([str(tmp_path / "bare"), "--by", "seed", "--metric", "x", "--steps", "a:b"])
