"""report.md + PNG plots of runs (`write_report`; the CLI is `python -m marljax.report`, and a training run
writes one for itself at its end).

Per run: accuracy vs step (base line, peak, final, cliff marker), per-role gradient norm and mass share,
per-role output length and parse-failure rate, optimizer steps per set. For several runs, the paper's table
over conditions (runs whose configs differ only in their seed; `condition_table`: means with t-based 95%
intervals over seeds), then a paper-style table: cell, base, peak (step), final, Δ vs base ± its noise, Δ vs
a like-for-like single-agent run (`LIKE_KEYS`: same task, model, steps, problems, eval set, optimizer, rate,
response cap; else blank with the keys that differ), cliff, dominant role. With a validation split
(`val/pass@1`) validation picks the peak step and flags the cliff, and the peak is the test accuracy there. Every number in the table comes from metrics.jsonl through
`summarize`, except the noise and the SA-transfer column (below). The noise is one standard error of the
paired difference final − base: both evals run the same held-out problems, whose transcripts
(`eval_step{N}.jsonl`) give per problem its mean reward over the eval's k runs (the k answers of a problem are
one cluster); with d_i = final_i − base_i over the n problems, s.e. = std(d, ddof=1) / √n. Without both
transcripts it falls back to the unpaired binomial s.e. of two independent evals (√(p₀(1−p₀)/N₀ +
p₁(1−p₁)/N₁), N = `eval/n_problems` × `eval/k` episodes), labelled as such.

Checkpoint re-evaluations (`python -m marljax.evaluate checkpoint=RUN_DIR`, e.g. `which=peak`, or a
single-agent run's SA→MA `transfer=`) are read from RUN_DIR/evals/*.json: the table then gains an
"SA-transfer" column beside "Δ vs single", and the report lists every such eval with its state and step.
"""
from __future__ import annotations

import collections
import json
import math
import os
import re
import sys
from typing import Any

import numpy as np
import yaml
from etils import epath

from marljax.analysis.seed_stats import Interval, difference, t_interval
from marljax.config import ConfigError, config_value, load_config, to_dict
from marljax.core.metrics import read_metrics
from marljax.core.storage import save_figure
from marljax.rl.diagnostics import CliffConfig, detect_cliff


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
    return [p[0] for p in pts], [float(p[1]) for p in pts]


def _roles(records: list[dict], suffix: str) -> list[str]:
    return sorted({k.split("/")[1] for r in records for k in r if k.startswith("role/") and k.endswith(suffix)})


def _config(run_dir: epath.Path) -> dict:
    """The run's config.yaml read back through `load_config` (as a resume reads it), so a key marljax gained
    after the run takes its default, which is what the run did; a config that no longer loads (a key since
    renamed) is read as written, with a note, and then a key it lacks is no difference (`conditions`)."""
    path = run_dir / "config.yaml"
    if not path.exists():
        return {}
    try:
        return to_dict(load_config(str(path)))
    except ConfigError as e:
        print(f"note: {path} no longer loads as a config ({e}); reading it as written", file=sys.stderr)
        return yaml.safe_load(path.read_text())


def summarize(run_dir: epath.PathLike) -> dict[str, Any]:
    """Base, peak, final, cliff and dominant role of one run, from its metrics.jsonl."""
    run_dir = epath.Path(run_dir)
    records = read_metrics(run_dir)
    cfg = _config(run_dir)
    steps, acc = _series(records, "eval/pass@1")
    val_steps, val_acc = _series(records, "val/pass@1")
    diag = cfg.get("diagnostics", {})
    cliff_cfg = CliffConfig(min_drop=diag.get("cliff_drop", 0.05), window_frac=diag.get("cliff_window", 0.25))
    last = max((r["step"] for r in records), default=0)  # a run stopped early ends there, not at cfg steps
    total = min(int(cfg.get("steps") or last), last) or None
    workflow, task = cfg.get("workflow", {}).get("name"), cfg.get("task", {}).get("name")
    out: dict[str, Any] = {
        "run": run_dir.name, "workflow": workflow, "task": task, "model": cfg.get("model"),
        "cell": "/".join(str(x) for x in (workflow, task, cfg.get("model"), _policy_name(cfg.get("policy")))),
        "steps": last, "seed": cfg.get("seed"), "like": like_for_like(cfg)}
    if steps:
        s = detect_cliff(steps, acc, total_steps=total, cfg=cliff_cfg)
        curve = dict(zip(steps, acc))
        out.update(base=s["base"], peak=s["peak"], peak_step=s["best_step"], final=s["final"],
                   delta=s["final"] - s["base"], cliff=bool(s["cliff"]), curve=curve, selected_on="test")
        if val_steps:  # validation chooses the step and flags the cliff; the test set reports at that step
            v = detect_cliff(val_steps, val_acc, total_steps=total, cfg=cliff_cfg)
            out.update(peak=curve.get(v["best_step"]), peak_step=v["best_step"], cliff=bool(v["cliff"]),
                       val_curve=dict(zip(val_steps, val_acc)), selected_on="validation")
        out.update(_lift_noise(run_dir, steps[0], steps[-1], s["base"], s["final"], _eval_sizes(records)))
    doms = [r["diag/dominant_role"] for r in records if "diag/dominant_role" in r
            and r.get("diag/dominant_share", 1.0) > 0]  # share 0: no gradient, nothing dominated (older runs)
    shares = [r["diag/dominant_share"] for r in records if isinstance(r.get("diag/dominant_share"), float)
              and math.isfinite(r["diag/dominant_share"])]
    if doms:
        out["dominant_role"] = mode(doms)
        out["dominant_share"] = shares[-1] if shares else float("nan")
    return out


PAIRED, UNPAIRED = "1 s.e. of the paired difference", "1 s.e., unpaired binomial: no paired eval transcripts"


def _lift_noise(run_dir: epath.Path, base_step: int, final_step: int, base: float, final: float,
                sizes: list[float]) -> dict[str, Any]:
    """`noise` (one s.e. of final − base) and `noise_kind` (how it was computed; see the module docstring)."""
    paired = paired_se(run_dir / f"eval_step{base_step}.jsonl", run_dir / f"eval_step{final_step}.jsonl")
    if paired is not None:
        return {"noise": paired, "noise_kind": PAIRED}
    if sizes[0] and sizes[-1]:
        return {"noise": math.hypot(_se(base, sizes[0]), _se(final, sizes[-1])), "noise_kind": UNPAIRED}
    return {}


def problem_means(path: epath.Path) -> dict[str, float]:
    """Mean reward per problem id over the episodes (the k runs) of one eval's transcripts."""
    rewards: dict[str, list[float]] = {}
    for line in path.read_text().splitlines():
        t = json.loads(line)
        rewards.setdefault(str(t["problem_id"]), []).append(float(t["reward"]))
    return {p: float(np.mean(r)) for p, r in rewards.items()}


def mode(values: list[str]) -> str:
    """The most frequent value; a tie goes to the one seen first (not to set order, which changes with
    the interpreter's hash seed, and with it the report)."""
    return collections.Counter(values).most_common(1)[0][0]


def paired_se(base_path: epath.Path, final_path: epath.Path) -> float | None:
    """std(d, ddof=1) / √n of the per-problem differences d (problem means, final − base); None unless
    both transcripts exist and cover the same ≥ 2 problems."""
    if base_path == final_path or not (base_path.exists() and final_path.exists()):
        return None
    base, final = problem_means(base_path), problem_means(final_path)
    if set(base) != set(final) or len(base) < 2:
        return None
    d = np.asarray([final[p] - base[p] for p in sorted(base)])
    return float(np.std(d, ddof=1) / math.sqrt(len(d)))


def _eval_sizes(records: list[dict]) -> list[float]:
    """Graded episodes behind each eval (`eval/n_problems` × `eval/k`; 0 when not logged)."""
    return [r.get("eval/n_problems", 0) * r.get("eval/k", 1) for r in records if "eval/pass@1" in r]


def _se(p: float, n: float) -> float:
    """Binomial standard error of an accuracy p over n episodes (0 when n is unknown)."""
    return math.sqrt(p * (1 - p) / n) if n else 0.0


def _sharing_roles(policy: Any, roles: list[str]) -> list[str]:
    """The roles whose parameter set also serves another role (their mass share is informative)."""
    if policy == "isolated":
        return []
    if isinstance(policy, dict):
        return [r for r in roles if list(policy.values()).count(policy.get(r)) > 1]
    return roles


def _policy_name(policy: Any) -> str:
    return policy if isinstance(policy, str) else "custom"


def plot_run(run_dir: epath.Path, out_dir: epath.Path) -> list[epath.Path]:
    """Write the per-run PNGs; returns their paths."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir)
    summary = summarize(run_dir)
    name = run_dir.name
    paths = []

    fig, ax = plt.subplots(figsize=(6.4, 4))
    steps, acc = _series(records, "eval/pass@1")
    if steps:
        err = [_se(a, k) for a, k in zip(acc, _eval_sizes(records))]
        ax.errorbar(steps, acc, yerr=err if any(err) else None, fmt="o-", capsize=4,
                    label="workflow pass@1 (held-out" + (", ± 1 s.e.)" if any(err) else ")"))
        ax.axhline(summary["base"], color="gray", ls="--", label=f"base {summary['base']:.3f}")
        ax.plot([summary["peak_step"]], [summary["peak"]], "*", ms=14, color="tab:green",
                label=f"peak {summary['peak']:.3f} @ {summary['peak_step']}")
        if summary["cliff"]:
            ax.axvspan(steps[-1] - 0.5, steps[-1] + 0.5, color="red", alpha=0.2, label="terminal cliff")
    rs, rw = _series(records, "reward/mean")
    if rs:
        ax.plot(rs, rw, "-", alpha=0.5, label="train reward (mean)")
    for role in _roles(records, "/accuracy"):
        ax.plot(*_series(records, f"role/{role}/accuracy"), ":", alpha=0.8, label=f"train {role} accuracy (own answers)")
        held_steps, held = _series(records, f"eval/role/{role}/accuracy")
        if held_steps:
            ax.plot(held_steps, held, "s--", ms=5, alpha=0.8, label=f"held-out {role} accuracy (own answers)")
    ax.set(title=f"{name}: accuracy", xlabel="training step", ylabel="accuracy / reward (0–1)")
    ax.legend(fontsize=8)
    paths.append(save_figure(fig, out_dir / f"{name}_accuracy.png"))

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    norms = []
    for role in _roles(records, "/grad_norm"):
        steps_r, norm_r = _series(records, f"role/{role}/grad_norm")
        a1.plot(steps_r, [v if v > 0 else float("nan") for v in norm_r], "o-", ms=3, label=role)  # 0: no signal
        norms += norm_r
    a1.set(title="per-role gradient norm ‖g_r‖", xlabel="training step", ylabel="L2 norm",
           yscale="log" if any(n > 0 for n in norms) else "linear")  # all-zero: no signal yet
    a1.legend(fontsize=8)
    sharing = _sharing_roles(_config(run_dir).get("policy"), _roles(records, "/grad_share"))
    for role in sharing:
        a2.plot(*_series(records, f"role/{role}/grad_share"), label=role)
    a2.set(title="per-role share of its set's gradient mass (grad_share)", xlabel="training step",
           ylabel="share (0–1)", ylim=(0, 1.05))
    if sharing:
        a2.legend(fontsize=8)
    else:
        a2.text(0.5, 0.5, "no parameter set is shared by two roles:\neach role's share is 1 by definition",
                ha="center", va="center", transform=a2.transAxes)
    paths.append(save_figure(fig, out_dir / f"{name}_gradients.png"))

    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(15, 4))
    for role in _roles(records, "/length_mean"):
        a1.plot(*_series(records, f"role/{role}/length_mean"), label=role)
    a1.set(title="per-role output length", xlabel="training step", ylabel="tokens per call")
    a1.legend(fontsize=8)
    for role in _roles(records, "/parse_fail"):
        a2.plot(*_series(records, f"role/{role}/parse_fail"), label=role)
    a2.set(title="per-role parse-failure rate", xlabel="training step", ylabel="fraction of calls",
           ylim=(-0.05, 1.05))
    a2.legend(fontsize=8)
    sets = sorted({k.split("/")[1] for r in records for k in r if k.startswith("set/") and k.endswith("/opt_steps")})
    for s in sets:
        a3.plot(*_series(records, f"set/{s}/opt_steps"), "o-", label=s)
    a3.set(title="optimizer steps per set per training step", xlabel="training step", ylabel="steps")
    a3.legend(fontsize=8)
    paths.append(save_figure(fig, out_dir / f"{name}_roles.png"))
    return paths


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:+.3f}" if v < 0 else f"{v:.3f}"
    return "–" if v is None else str(v)


# What a single-agent run must share with a run for "Δ vs single" to compare like with like
LIKE_KEYS = ("model", "steps", "task.name", "task.options", "task.eval_n", "task.split_seed", "rl.problems_per_step",
             "rl.rollouts", "optim.name", "optim.lr", "optim.schedule", "optim.warmup_steps", "sampling.max_new_tokens")


def like_for_like(cfg: dict) -> dict:
    """The values of `LIKE_KEYS` in a run's config (None where it lacks one)."""
    return {k: config_value(cfg, k) for k in LIKE_KEYS}


def _is_single_for(x: dict, s: dict) -> bool:
    """Whether summary `x` is a single-agent run like `s` (and `s` is not one): the same task, model, steps,
    problems, rollouts, eval set, optimizer and rate and response cap (`LIKE_KEYS`)."""
    return x.get("workflow") == "single" and s.get("workflow") != "single" and x.get("like") == s.get("like")


def _unlike(x: dict, s: dict) -> list[str]:
    """The `LIKE_KEYS` on which a single-agent run `x` differs from `s`."""
    return [k for k in LIKE_KEYS if x.get("like", {}).get(k) != s.get("like", {}).get(k)]


def vs_single(s: dict, summaries: list[dict]) -> float | None:
    """Final accuracy minus that of a like-for-like single-agent run (`_is_single_for`) of the same seed."""
    singles = [x for x in summaries if _is_single_for(x, s) and "final" in x and x.get("seed") == s.get("seed")]
    return s["final"] - singles[0]["final"] if singles and "final" in s else None


def read_evals(run_dir: epath.PathLike) -> list[dict]:
    """A run's checkpoint evals (RUN_DIR/evals/*.json, written by `python -m marljax.evaluate checkpoint=`)."""
    return [json.loads(p.read_text()) for p in sorted((epath.Path(run_dir) / "evals").glob("*.json"))]


def sa_transfer(s: dict, summaries: list[dict]) -> str | None:
    """pass@1 of single-agent runs (same task and model) transferred onto this run's workflow, per mode."""
    if s.get("workflow") == "single":
        return None
    found = [e for x in summaries if x.get("workflow") == "single"
             and (x.get("task"), x.get("model")) == (s.get("task"), s.get("model"))
             for e in x.get("evals", []) if e.get("transfer") and e["workflow"] == s.get("workflow")]
    return "; ".join(f"{e['transfer']}{' (peak)' if e['which'] == 'peak' else ''} {e['pass@1']:.3f}"
                     for e in found) or None


def table(summaries: list[dict]) -> str:
    """Markdown table: cell, base, peak (step), final, Δ vs base ± noise, Δ vs single, [SA-transfer,] cliff,
    dominant role. The SA-transfer column appears when a summary carries transfer evals (`evals`)."""
    sa = any(e.get("transfer") for s in summaries for e in s.get("evals", []))
    lines = ["| run | cell | base | peak (step) | final | Δ vs base (± 1 s.e.; † unpaired) | Δ vs single |"
             + (" SA-transfer |" if sa else "") + " cliff | dominant role |",
             "|---|---|---|---|---|---|---|" + ("---|" if sa else "") + "---|---|"]
    for s in summaries:
        peak = f"{_fmt(s.get('peak'))} ({s.get('peak_step', '–')})"
        delta = _fmt(s.get("delta")) + (f" ± {s['noise']:.3f}" + ("†" if s.get("noise_kind") == UNPAIRED else "")
                                         if "noise" in s else "")
        dom = f"{s['dominant_role']} ({s['dominant_share']:.2f})" if "dominant_role" in s else "–"
        transfer = f" {_fmt(sa_transfer(s, summaries))} |" if sa else ""
        lines.append(f"| {s['run']} | {s['cell']} | {_fmt(s.get('base'))} | {peak} | {_fmt(s.get('final'))} | "
                     f"{delta} | {_fmt(vs_single(s, summaries))} |{transfer} {_fmt(s.get('cliff'))} | {dom} |")
    return "\n".join(lines)


SEED_KEYS = ("seed", "run_dir")  # what may differ between the seeds of one condition


def _flat(node: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(node, dict):
        return {prefix: node}
    return {k: v for key, sub in node.items() for k, v in _flat(sub, f"{prefix}{key}.").items()} if node else {}


def conditions(summaries: list[dict], configs: list[dict]) -> list[tuple[str, str, list[dict]]]:
    """Runs grouped into conditions: configs equal but for `SEED_KEYS` (`_config` fills a key added after a
    run with its default; only in a config that no longer loads is a key it lacks no difference). Each is
    (name, settings, runs): the name is the runs' common name without its seed suffix (`amp-n5-s0`,
    `amp-n5-s1` → `amp-n5`), the settings are the config values that tell it apart from the other conditions
    (`workflow.n_votes=5, …`)."""
    flat = [{k.rstrip("."): v for k, v in _flat(c).items() if k.rstrip(".") not in SEED_KEYS} for c in configs]

    def same(a: dict, b: dict) -> bool:
        return all(a[k] == b[k] for k in a.keys() & b.keys())

    groups: list[list[int]] = []
    for i, f in enumerate(flat):
        home = next((g for g in groups if same(flat[g[0]], f)), None)
        home.append(i) if home is not None else groups.append([i])
    firsts = [flat[g[0]] for g in groups]
    keys = sorted({k for a in firsts for b in firsts for k in a.keys() & b.keys() if a[k] != b[k]})
    out, used = [], set()
    for g in groups:
        stem = os.path.commonprefix([summaries[i]["run"] for i in g])
        stem = re.sub(r"[-_]?(s|seed)?\d*$", "", stem) if len(g) > 1 else re.sub(r"[-_](s|seed)\d+$", "", stem)
        settings = ", ".join(f"{k}={flat[g[0]][k]}" for k in keys if k in flat[g[0]])
        name = stem if stem and stem not in used else summaries[g[0]]["run"]
        used.add(name)
        out.append((name, settings, [summaries[i] for i in g]))
    return out


def _cell(iv: Interval) -> str:
    """An interval over seeds, marked ✱ when it excludes 0 (for differences: resolved)."""
    return iv.fmt() + (" ✱" if iv.resolved else "")


def _finals_by_seed(runs: list[dict]) -> dict[Any, float]:
    """seed → final accuracy, for pairing by seed; keyed by run name instead when the runs' seeds are not
    distinct (none is dropped; `difference` then takes Welch's interval)."""
    seeds = [s.get("seed") for s in runs]
    distinct = None not in seeds and len(set(seeds)) == len(seeds)
    return {s["seed"] if distinct else s["run"]: s["final"] for s in runs}


def condition_table(summaries: list[dict], configs: list[dict]) -> str:
    """Markdown, the paper's form over seeds: per condition base, peak (step), final and Δ vs base as the mean
    with its t-based 95% interval over seeds (`marljax.analysis.seed_stats`; one seed: its paired s.e. for Δ), Δ vs a
    like-for-like single-agent condition (paired by seed where both ran the same seeds), cliffs (runs flagged
    of runs), dominant role. Peak: the step where the seed-mean validation curve peaks, and the test mean
    there; runs without validation take the seed-mean test curve's maximum (marked †: biased up)."""
    conds = [(name, settings, [s for s in runs if "final" in s])
             for name, settings, runs in conditions(summaries, configs)]
    conds = [c for c in conds if c[2]]
    lines = ["| condition | cell | seeds | base | peak (step) | final | Δ vs base | Δ vs single | cliff | "
             "dominant role |", "|---|---|---|---|---|---|---|---|---|---|"]
    blanks = []
    for name, _, runs in conds:
        steps = sorted(set.intersection(*(set(s["curve"]) for s in runs)))
        curve = {t: float(np.mean([s["curve"][t] for s in runs])) for t in steps}
        peak = "–"
        if all("val_curve" in s for s in runs):
            vsteps = sorted(set.intersection(*(set(s["val_curve"]) for s in runs)) & set(curve))
            if vsteps:
                step = max(vsteps, key=lambda t: np.mean([s["val_curve"][t] for s in runs]))
                peak = f"{_fmt(curve[step])} ({step})"
        elif curve:
            step = max(curve, key=curve.get)
            peak = f"{_fmt(curve[step])} ({step})†"
        finals = _finals_by_seed(runs)
        delta = t_interval([s["delta"] for s in runs])
        delta_cell = (_cell(delta) if len(runs) > 1 or "noise" not in runs[0]
                      else f"{delta.mean:.3f} ± {runs[0]['noise']:.3f} (1 seed, 1 s.e. over problems)")
        single = next((rs for lab, _, rs in conds if _is_single_for(rs[0], runs[0])), None)
        vs = "–"
        if single:
            vs = _cell(difference(finals, _finals_by_seed(single)))
        elif runs[0].get("workflow") != "single":
            others = [rs[0] for _, _, rs in conds if rs[0].get("workflow") == "single"
                      and rs[0].get("task") == runs[0].get("task")]
            why = (f"the single-agent runs differ in {', '.join(_unlike(others[0], runs[0]))}" if others
                   else "no single-agent run of its task")
            blanks.append(f"- {name}: Δ vs single left blank: {why}.")
        doms = [s["dominant_role"] for s in runs if "dominant_role" in s]
        dom = "–"
        if doms:
            role = mode(doms)
            share = np.mean([s["dominant_share"] for s in runs if s.get("dominant_role") == role])
            dom = f"{role} ({doms.count(role)}/{len(runs)} runs, final share {share:.2f})"
        lines.append(f"| {name} | {runs[0]['cell']} | {len(runs)} | {t_interval([s['base'] for s in runs]).fmt()} | "
                     f"{peak} | {t_interval(list(finals.values())).fmt()} | {delta_cell} | {vs} | "
                     f"{sum(s['cliff'] for s in runs)}/{len(runs)} | {dom} |")
    lines += ["", "What tells the conditions apart:", ""]
    lines += [f"- {name} ({', '.join(s['run'] for s in runs)}): {settings or 'the only condition'}"
              for name, settings, runs in conds]
    if blanks:
        lines += ["", *blanks]
    return "\n".join(lines)


def evals_table(summaries: list[dict]) -> str:
    """Markdown table of every checkpoint eval: which state (newest or peak) at which step, on which
    workflow (and transfer mode), pass@1 ± its binomial s.e. over n × k episodes."""
    lines = ["| run | state (step) | workflow | transfer | pass@1 (± 1 s.e.) | n × k |", "|---|---|---|---|---|---|"]
    for s in summaries:
        for e in s.get("evals", []):
            se = _se(e["pass@1"], e["n"] * e["k"])
            lines.append(f"| {s['run']} | {e['which']} ({e['step']}) | {e['workflow']} | {_fmt(e.get('transfer'))} | "
                         f"{e['pass@1']:.3f} ± {se:.3f} | {e['n']} × {e['k']} |")
    return "\n".join(lines)


def write_report(run_dirs: list[epath.PathLike], out: epath.PathLike | None = None) -> epath.Path:
    """Write report.md (+ PNGs) into `out` (default: the single run's dir; local or a bucket) and return its path."""
    run_dirs = [epath.Path(d) for d in run_dirs]
    out_dir = epath.Path(out) if out else run_dirs[0]
    out_dir.mkdir(parents=True, exist_ok=True)
    summaries = [{**summarize(d), "evals": read_evals(d)} for d in run_dirs]
    parts = ["# marljax report", "", "## Conditions", "",
             "Runs whose configs differ only in `seed` are one condition. Each cell: the mean over its seeds "
             "[t-based 95% interval, df = seeds − 1]; ✱: a difference whose interval excludes 0 (resolved); Δ vs "
             "single is paired by seed where both conditions ran the same seeds. Peak: the test accuracy at the "
             "step where the seed-mean validation curve peaks († no validation: the seed-mean test curve's "
             "maximum, biased up). Cliff: runs flagged of runs (on validation where the runs have it).", "",
             condition_table(summaries, [_config(d) for d in run_dirs]), "", "## Runs", "", table(summaries), ""]
    if any(s["evals"] for s in summaries):
        parts += ["## Checkpoint evaluations", "", evals_table(summaries), ""]
    for d in run_dirs:
        parts += [f"## {d.name}", ""]
        for p in plot_run(d, out_dir):
            parts.append(f"![{p.stem}]({p.name})")
        parts.append("")
    path = out_dir / "report.md"
    path.write_text("\n".join(parts))
    return path

