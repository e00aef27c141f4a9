"""The report's table equals what a synthetic metrics.jsonl with a known peak, final and cliff implies."""
import json

import numpy as np
import pytest
import yaml
from scipy import stats

from marljax.analysis.report import PAIRED, UNPAIRED, summarize, table, write_report


def _run(tmp_path, name, accs, policy="shared", steps=10, workflow="voting", n_problems=None):
    d = tmp_path / name
    d.mkdir()
    (d / "config.yaml").write_text(yaml.safe_dump({
        "model": "tiny-qwen3", "policy": policy, "steps": steps, "workflow": {"name": workflow},
        "task": {"name": "arith"}, "diagnostics": {"cliff_drop": 0.05, "cliff_window": 0.25}}))
    lines = []
    for step in range(steps + 1):
        r = {"step": step, "reward/mean": 0.1 * step, "role/generator/grad_norm": 1.0 + step,
             "role/aggregator/grad_norm": 0.5, "role/generator/grad_share": 0.75, "role/aggregator/grad_share": 0.25,
             "role/generator/length_mean": 60.0, "role/aggregator/length_mean": 5.0 + step,
             "role/generator/parse_fail": 0.2, "role/aggregator/parse_fail": 0.1, "set/shared/opt_steps": 1,
             "diag/dominant_role": "generator", "diag/dominant_share": 0.75}
        if step in accs:
            r["eval/pass@1"] = accs[step]
            if n_problems:
                r.update({"eval/n_problems": n_problems, "eval/k": 2})
        lines.append(json.dumps(r))
    (d / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return d


def test_table_numbers_come_from_metrics(tmp_path):
    cliff = _run(tmp_path, "cliff", {0: 0.30, 2: 0.40, 4: 0.55, 6: 0.60, 8: 0.58, 10: 0.35})
    steady = _run(tmp_path, "steady", {0: 0.30, 5: 0.45, 10: 0.50}, policy="isolated", n_problems=50)
    single = _run(tmp_path, "single", {0: 0.20, 10: 0.42}, workflow="single")
    s = summarize(cliff)
    assert (s["base"], s["peak"], s["peak_step"], s["final"]) == (0.30, 0.60, 6, 0.35)
    assert abs(s["delta"] - 0.05) < 1e-12 and s["cliff"] is True
    assert s["dominant_role"] == "generator" and s["cell"] == "voting/arith/tiny-qwen3/shared"
    t = summarize(steady)
    assert (t["peak"], t["peak_step"], t["final"], t["cliff"]) == (0.50, 10, 0.50, False)
    noise = (0.3 * 0.7 / 100 + 0.5 * 0.5 / 100) ** 0.5  # no transcripts: unpaired, 50 problems x k=2 per eval
    assert abs(t["noise"] - noise) < 1e-12 and t["noise_kind"] == UNPAIRED
    assert "noise" not in s  # neither transcripts nor episode counts: no noise
    md = table([s, t, summarize(single)])
    assert ("| cliff | voting/arith/tiny-qwen3/shared | 0.300 | 0.600 (6) | 0.350 | 0.050 | -0.070 | yes | "
            "generator (0.75) |") in md
    assert (f"| steady | voting/arith/tiny-qwen3/isolated | 0.300 | 0.500 (10) | 0.500 | 0.200 ± {noise:.3f}† | "
            "0.080 | no |") in md
    assert "| single | single/arith/tiny-qwen3/shared | 0.200 | 0.420 (10) | 0.420 | 0.220 | – | no |" in md
    report = write_report([cliff, steady, single], tmp_path / "out")
    text = report.read_text()
    assert md in text
    for name in ("cliff", "steady"):
        for kind in ("accuracy", "gradients", "roles"):
            png = tmp_path / "out" / f"{name}_{kind}.png"
            assert png.exists() and png.stat().st_size > 10_000


def _transcripts(path, rewards_pk, order):
    """One line per episode, in `order` of (problem, run), as `Rollout.transcripts` writes them."""
    path.write_text("".join(json.dumps({"problem_id": f"p{p}", "rollout": r, "reward": float(rewards_pk[p, r]),
                                        "episode": i, "calls": []}) + "\n" for i, (p, r) in enumerate(order)))


def test_noise_is_the_paired_standard_error_over_problem_clusters(tmp_path):
    """d_i = final − base of problem i's mean over its k = 3 runs; s.e. = std(d, ddof=1) / √n (numpy).
    Treating the 3 answers as independent, or the evals as unpaired, gives other numbers."""
    rng = np.random.default_rng(0)
    n, k = 12, 3
    base_pk = (rng.random((n, k)) < 0.3).astype(float)
    final_pk = np.clip(base_pk + (rng.random((n, k)) < 0.3), 0, 1)
    run = _run(tmp_path, "paired", {0: base_pk.mean(), 10: final_pk.mean()}, n_problems=n)
    order = [(p, r) for p in range(n) for r in range(k)]
    _transcripts(run / "eval_step0.jsonl", base_pk, order)
    _transcripts(run / "eval_step10.jsonl", final_pk, order[::-1])  # pairing is by problem id, not line
    d = final_pk.mean(axis=1) - base_pk.mean(axis=1)
    expected = d.std(ddof=1) / np.sqrt(n)
    s = summarize(run)
    assert s["noise_kind"] == PAIRED and s["noise"] == pytest.approx(expected, rel=1e-12)
    unclustered = (final_pk - base_pk).ravel()
    assert abs(expected - unclustered.std(ddof=1) / np.sqrt(n * k)) > 1e-3
    assert f"{s['delta']:.3f} ± {expected:.3f} |" in table([s])
    (run / "eval_step10.jsonl").unlink()
    assert summarize(run)["noise_kind"] == UNPAIRED  # a missing transcript: the labelled fallback


def test_conditions_average_seeds_and_difference_the_single_agent_condition(tmp_path, capsys):
    """Seeds of one condition (configs equal but for seed/run_dir; a key a config lacks takes its default,
    and only in a config that no longer loads is a key it lacks no difference) are averaged: mean ±
    with the t-based 95% interval over seeds; Δ vs the like-for-like single condition, paired by seed."""
    runs = {"a-s0": ({0: 0.2, 5: 0.6, 10: 0.4}, 3, 0), "a-s1": ({0: 0.3, 5: 0.5, 10: 0.5}, 3, 1),
            "b-s0": ({0: 0.2, 5: 0.3, 10: 0.3}, 5, 0), "single-s0": ({0: 0.1, 10: 0.25}, 3, 0),
            "single-s1": ({0: 0.1, 10: 0.35}, 3, 1), "c-s0": ({0: 0.2, 5: 0.4, 10: 0.4}, 3, 0)}
    dirs = []
    for name, (accs, votes, seed) in runs.items():
        d = _run(tmp_path, name, accs, workflow="single" if name[0] == "s" else "voting")
        cfg = yaml.safe_load((d / "config.yaml").read_text())
        cfg.update(seed=seed, run_dir=str(d))
        cfg["workflow"]["n_votes"] = votes
        if name == "single-s1":
            cfg["workflow"]["supervisor_example"] = False  # single-s0 lacks the key: its default, also False
        if name == "a-s1":
            cfg["rl"] = {"renamed_since": 1}  # no longer loads: read as written
        if name == "c-s0":
            cfg["workflow"]["supervisor_example"] = True  # a-s0 lacks it: False, its default, so not a's
        (d / "config.yaml").write_text(yaml.safe_dump(cfg))
        dirs.append(d)
    text = write_report(dirs, tmp_path / "out").read_text()
    t1 = stats.t.ppf(0.975, 1)  # two seeds: one degree of freedom
    half_a = np.std([0.4, 0.5], ddof=1) / np.sqrt(2) * t1
    half_base = np.std([0.2, 0.3], ddof=1) / np.sqrt(2) * t1
    # Δ vs single paired by seed: a − single = 0.15 in both seeds, so the interval is [0.15, 0.15]: resolved
    assert (f"| a | voting/arith/tiny-qwen3/shared | 2 | 0.250 [{0.25 - half_base:+.3f}, {0.25 + half_base:+.3f}] | "
            f"0.550 (5)† | 0.450 [{0.45 - half_a:+.3f}, {0.45 + half_a:+.3f}] | 0.200 [+0.200, +0.200] ✱ | "
            f"0.150 [+0.150, +0.150] ✱ | 1/2 | generator (2/2 runs, final share 0.75) |") in text
    # b ran seed 0 only, single seeds 0 and 1: unpaired, and one seed gives no interval
    assert "| b | voting/arith/tiny-qwen3/shared | 1 | 0.200 (1 seed) | 0.300 (5)† | 0.300 (1 seed) | 0.100 (1 seed) | 0.000 (1 seed) | 0/1 |" in text
    assert "| single | single/arith/tiny-qwen3/shared | 2 | 0.100 [+0.100, +0.100] | 0.300 (10)† |" in text
    assert "- a (a-s0, a-s1): workflow.n_votes=3, workflow.name=voting" in text
    assert "- b (b-s0): workflow.n_votes=5, workflow.name=voting" in text
    assert "- c (c-s0): workflow.n_votes=3, workflow.name=voting, workflow.supervisor_example=True" in text
    assert "a-s1/config.yaml no longer loads as a config" in capsys.readouterr().err


def test_a_tied_dominant_role_is_the_first_seen_whatever_the_hash_seed():
    """Two roles each dominant at half the steps: the report names the one dominant first, in every
    interpreter (a `max(set(...))` answer changed with PYTHONHASHSEED, and so did regenerated reports)."""
    import os
    import subprocess
    import sys
    code = ("from marljax.analysis.report import mode; "
            "print(mode(['worker', 'orchestrator', 'synthesizer', 'orchestrator', 'worker', 'synthesizer']))")
    got = {subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": str(seed)},
                          capture_output=True, text=True, check=True).stdout.strip() for seed in range(8)}
    assert got == {"worker"}


def test_validation_chooses_the_peak_step_and_an_unlike_single_is_left_blank(tmp_path):
    """With val/pass@1 the peak step is validation's and the peak is the test accuracy there (not the test
    maximum); a single-agent run of another length gets no Δ, and the report says on which keys it differs."""
    run = _run(tmp_path, "val", {0: 0.30, 4: 0.70, 8: 0.50, 10: 0.45})
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    val = {0: 0.2, 4: 0.3, 8: 0.6, 10: 0.6}
    for r in records:
        if r["step"] in val:
            r["val/pass@1"] = val[r["step"]]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    s = summarize(run)
    assert (s["peak"], s["peak_step"], s["final"], s["selected_on"]) == (0.50, 8, 0.45, "validation")
    assert s["cliff"] is False  # the test curve drops 0.70 → 0.45 late (a cliff on test), validation holds
    single = _run(tmp_path, "single", {0: 0.20, 12: 0.42}, workflow="single", steps=12)
    text = write_report([run, single], tmp_path / "out").read_text()
    assert "| val | voting/arith/tiny-qwen3/shared | 1 | 0.300 (1 seed) | 0.500 (8) | 0.450 (1 seed) |" in text
    assert "- val: Δ vs single left blank: the single-agent runs differ in steps." in text


def test_runs_without_a_seed_in_their_config_all_count(tmp_path):
    """Two runs of one condition with the same seed (here the default, 0) are two values of the interval,
    not one (keyed by seed, the second would replace the first)."""
    runs = [_run(tmp_path, name, {0: 0.2, 10: final}) for name, final in (("x-a", 0.4), ("x-b", 0.6))]
    text = write_report(runs, tmp_path / "out").read_text()
    assert "| 2 | 0.200 [+0.200, +0.200] | 0.500 (10)† | 0.500 [" in text
