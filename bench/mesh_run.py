"""One training step of the default run (SmolLM2-135M, Voting, shared LoRA) on one simulated CPU device
and on eight (mesh data=2 × fsdp=4), each in its own process: the peak resident memory of each, and the
eight-device run's rewards and per-role gradient norms against the one-device run's (relative
difference; issue #45 asks ≤ 1e-5) and its per-role losses (absolute: zero up to rounding at ratio 1).
The simulated devices share this host's memory: the eight-device peak counts every chip's share.

    python bench/mesh_run.py [--out /tmp/mesh_run] [-- key=value ...]
"""
from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent
RUN = ["--config", "configs/default.yaml", "steps=1", "rl.problems_per_step=4", "rl.rollouts=4",
       "sampling.max_new_tokens=24", "eval.every=0", "eval.at_start=false", "checkpoint.every=0"]
MESHES = {"1 device": (1, []), "8 devices (data=2, fsdp=4)": (8, ["mesh.data=2", "mesh.fsdp=4"])}


def run(out: pathlib.Path, devices: int, overrides: list[str]) -> tuple[dict, str]:
    """The step-1 record of one run and the peak-RSS line `peak_rss.py` printed for it."""
    env_flags = f"XLA_FLAGS=--xla_force_host_platform_device_count={devices}"
    cmd = ["env", env_flags, "JAX_PLATFORMS=cpu", sys.executable, str(HERE / "peak_rss.py"), "--",
           sys.executable, "-m", "marljax.train", *RUN, f"run_dir={out}", *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=HERE.parent)
    peak = [ln for ln in proc.stderr.splitlines() if ln.startswith("peak resident memory")]
    if proc.returncode or not peak:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    records = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    return records[-1], peak[0].split(":")[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/tmp/mesh_run")
    ap.add_argument("overrides", nargs="*", help="key=value overrides for both runs")
    args = ap.parse_args()
    results = {}
    for name, (devices, mesh) in MESHES.items():
        results[name] = run(pathlib.Path(args.out) / f"d{devices}", devices, mesh + args.overrides)
        print(f"{name}: {results[name][1]}", flush=True)
    (ref, _), (got, _) = results.values()
    keys = sorted(k for k in ref if k == "reward/mean" or (k.startswith("role/") and k.endswith(("/loss", "/grad_norm"))))
    print(f"{'metric':34} {'1 device':>12} {'8 devices':>12} {'difference':>12}")
    worst = 0.0
    for k in keys:  # a GRPO loss at ratio 1 is zero up to rounding: its difference is absolute
        diff = abs(got[k] - ref[k]) / (1.0 if k.endswith("/loss") else max(abs(ref[k]), 1e-30))
        worst = worst if k.endswith("/loss") else max(worst, diff)
        print(f"{k:34} {ref[k]:12.6g} {got[k]:12.6g} {diff:9.2e} {'abs' if k.endswith('/loss') else 'rel'}")
    print(f"largest relative difference of rewards and gradient norms {worst:.2e}")

if __name__ == "__main__":
    main()
