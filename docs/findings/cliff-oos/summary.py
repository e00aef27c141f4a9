"""The cliff out of sample (issue #46 item 7), as docs/findings/cliff-oos/README.md quotes it.

`.venv/bin/python docs/findings/cliff-oos/summary.py` (from the repo root) reads docs/findings/oos-<variant>-s<seed>
and prints, per seed, the test pass@1 at the step validation selects ("peak", `marljax.analysis.report.summarize`)
and at the last step, then each mitigation minus the base run over seeds, paired by seed, with t-based 95%
intervals (`marljax.analysis.seed_stats`; df = seeds − 1). A rollback run whose base run never fired the
detector is the base run bit for bit (tests/test_rollback.py::test_a_rollback_that_never_fires_changes_nothing),
so such a seed counts the base run for it, and says so.
"""
from __future__ import annotations

import pathlib

from marljax.analysis.report import summarize
from marljax.analysis.seed_stats import difference
from marljax.core.metrics import read_metrics

ROOT = pathlib.Path(__file__).resolve().parents[1]
SEEDS, MITIGATIONS = (2, 3, 4), ("rollback025", "onestep")


def fired(run: pathlib.Path) -> bool:
    """Whether the run's validation drop fired the cliff detector at any eval."""
    return any(r.get("diag/cliff") for r in read_metrics(run))


def runs() -> dict[str, dict[int, tuple[dict, str]]]:
    """variant → seed → (summary, how it was obtained) for the runs that exist or follow from their base."""
    out: dict[str, dict[int, tuple[dict, str]]] = {v: {} for v in ("base", *MITIGATIONS)}
    for seed in SEEDS:
        base = ROOT / f"oos-base-s{seed}"
        if not base.exists():
            continue
        out["base"][seed] = summarize(base), base.name
        for variant in MITIGATIONS:
            run = ROOT / f"oos-{variant}-s{seed}"
            if run.exists():
                out[variant][seed] = summarize(run), run.name
            elif variant == "rollback025" and not fired(base):
                out[variant][seed] = out["base"][seed][0], f"{base.name} (never fired: the rollback run is the base run)"
    return out


def main() -> None:
    table = runs()
    print("| variant | seed | run | peak: test at the validation-selected step | final (step 24) |")
    print("|---|---|---|---|---|")
    for variant, by_seed in table.items():
        for seed, (s, name) in sorted(by_seed.items()):
            print(f"| {variant} | {seed} | {name} | {s['peak']:.3f} (step {s['peak_step']}) | {s['final']:.3f} |")
    print()
    for variant in MITIGATIONS:
        seeds = sorted(set(table[variant]) & set(table["base"]))
        if not seeds:
            print(f"{variant}: no seed run yet")
            continue
        for key in ("final", "peak"):
            a, b = ({s: table[v][s][0][key] for s in seeds} for v in (variant, "base"))
            d = difference(a, b)
            per_seed = ", ".join(f"s{s} {a[s] - b[s]:+.3f}" for s in seeds)
            print(f"{variant} − base, {key}: {d.fmt()} over seeds {seeds} ({per_seed}): "
                  f"{'resolved' if d.resolved else 'not resolved'}")


if __name__ == "__main__":
    main()
