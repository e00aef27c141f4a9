"""The SmolLM2-135M LoRA train step with marljax's host malloc (freed memory kept for reuse) against
glibc's default (XLA CPU's multi-GB temp buffer mmapped afresh and faulted in on every call), side by side:
one worker process per (malloc, remat), since malloc is set when a process starts; the parent steps them
in turn, each step after a 1 s pause, the first round compiling. See marljax/core/host_memory.py.

    python bench/host_malloc.py [--batch 8] [--length 256] [--repeats 3] [--write] [--smoke]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

MALLOCS, REMATS = ("retain", "system"), ("dots", "full")


def worker(remat: str, rows: int, length: int, smoke: bool) -> None:
    """Build one LoRA contender, then answer each line on stdin with one timed step as JSON."""
    from train_step import Contender, random_batch  # keeps host memory before jax (per env)

    from benchdoc import bench_model

    from marljax.core import host_memory
    c = Contender(bench_model("smollm2-135m-instruct", smoke), random_batch(rows, length), lora=True, remat=remat)
    print(json.dumps({"state": host_memory.state}), flush=True)
    for _ in sys.stdin:
        seconds, minflt, stime = c.step()
        print(json.dumps({"s": seconds, "minflt": minflt, "stime": stime}), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--write", action="store_true", help="replace the section in docs/benchmarks.md")
    ap.add_argument("--smoke", action="store_true", help="a tiny random model (benchdoc.smoke_config): seconds")
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker, args.batch, args.length, args.smoke)
    from benchdoc import machine, publish
    procs = {}
    for malloc in MALLOCS:
        for remat in REMATS:
            p = subprocess.Popen([sys.executable, __file__, "--worker", remat, "--batch", str(args.batch),
                                  "--length", str(args.length), *["--smoke"] * args.smoke],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                 env={**os.environ, "MARLJAX_HOST_MALLOC": malloc})
            state = json.loads(p.stdout.readline())["state"]
            assert (state == "retained") == (malloc == "retain"), (malloc, state)
            procs[(malloc, remat)] = p
    runs = {k: [] for k in procs}
    for rep in range(args.repeats + 1):
        for key, p in procs.items():
            time.sleep(0 if args.smoke else 1)
            p.stdin.write("step\n")
            p.stdin.flush()
            r = json.loads(p.stdout.readline())
            if rep:
                runs[key].append(r)
    for p in procs.values():
        p.stdin.close()
        p.wait()
    med = {k: {f: statistics.median(r[f] for r in rs) for f in ("s", "minflt", "stime")} for k, rs in runs.items()}
    lines = ["## Host malloc (SmolLM2-135M LoRA train step, CPU)", "",
             f"`python bench/host_malloc.py --batch {args.batch} --length {args.length} --repeats {args.repeats}` "
             f"on {time.strftime('%Y-%m-%d %H:%M')}, {machine(malloc=False)}; LoRA rank 16, one `Trainer.update` on "
             f"{args.batch} × {args.length} tokens, one worker process per row, stepped in turn; medians.", "",
             "| remat | host malloc | step s | page faults | kernel CPU s | steps s |", "|---|---|---|---|---|---|"]
    for (malloc, remat), m in sorted(med.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        lines.append(f"| {remat} | {malloc} | {m['s']:.2f} | {m['minflt'] / 1e3:.0f}k | {m['stime']:.2f} | "
                     + ", ".join(f"{r['s']:.1f}" for r in runs[(malloc, remat)]) + " |")
    ratio = {remat: med[("retain", remat)]["s"] / med[("system", remat)]["s"] for remat in REMATS}
    lines += [""] + [f"`{remat}`: retain / system step time **{r:.2f}**." for remat, r in ratio.items()]
    publish("\n".join(lines) + "\n", args.write)


if __name__ == "__main__":
    main()
