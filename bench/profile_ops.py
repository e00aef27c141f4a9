"""Where the time goes: per-op times of one sampler call or one train step, summed by HLO op and shape.

Runs the program once to compile and warm up, then once under `jax.profiler` (Perfetto trace), and
joins the trace's op events with the optimized HLO (dumped by XLA) to name each op by its JAX source
(`op_name` metadata) and output shape. Ops on the two cores overlap, so the sum can exceed the wall time.

    python bench/profile_ops.py sampler [--batch 16] [--new 32] [--top 30]
    python bench/profile_ops.py engine [--batch 64] [--new 32] [--prompt 64]   # the engine's decode chunks
    python bench/profile_ops.py step [--mode lora|full] [--remat full|dots|none] [--batch 8] [--length 256]
    (--smoke: a tiny random model instead of SmolLM2-135M)
"""
from __future__ import annotations

import argparse
import collections
import functools
import gzip
import json
import os
import pathlib
import re
import sys
import tempfile
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["sampler", "engine", "step"])
    ap.add_argument("--batch", type=int, default=None, help="rows (sampler: 16, engine: 64 (its slots), step: 8)")
    ap.add_argument("--new", type=int, default=32, help="sampler, engine: new tokens (greedy, no stop)")
    ap.add_argument("--prompt", type=int, default=64, help="sampler, engine: prompt tokens (random ids)")
    ap.add_argument("--mode", choices=["lora", "full"], default="lora", help="step: LoRA r16 or full")
    ap.add_argument("--remat", default="full", help="step: rl.remat")
    ap.add_argument("--length", type=int, default=256, help="step: tokens per row")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--smoke", action="store_true", help="a tiny random model (benchdoc.smoke_config): seconds")
    args = ap.parse_args()
    work = pathlib.Path(tempfile.mkdtemp(prefix="marljax-profile-"))
    module = {"sampler": "_sample", "engine": "decode_chunk", "step": "_update"}[args.what]
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={work}/hlo "
                               f"--xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*{module}.*")
    from marljax.core import host_memory
    host_memory.retain()  # before jax: keeps freed host memory (marljax/core/host_memory.py)
    import jax
    import numpy as np

    from benchdoc import bench_model
    model = bench_model("smollm2-135m-instruct", args.smoke)
    rng = np.random.default_rng(0)
    if args.what in ("sampler", "engine"):
        from marljax.sampling import SamplingParams, layer_weights
        from marljax.sampling.engine import Engine
        from static_sampler import generate_static  # bench/static_sampler.py
        rows = args.batch or (16 if args.what == "sampler" else 64)
        prompts = rng.integers(100, 40000, (rows, args.prompt)).tolist()
        layers, sp = layer_weights(model), SamplingParams(max_new_tokens=args.new, temperature=0.0)
        if args.what == "sampler":
            run = functools.partial(generate_static, model, prompts, sp, layers=layers)
        else:
            run = functools.partial(Engine(model, num_slots=rows).generate, prompts, sp, layers=layers)
    else:
        from train_step import Contender, random_batch
        c = Contender(model, random_batch(args.batch or 8, args.length), args.mode == "lora", args.remat)
        run = c.step
    run()
    t = time.perf_counter()
    run()
    print(f"{args.what}: {time.perf_counter() - t:.2f} s per call (warm)")
    with jax.profiler.trace(str(work / "trace"), create_perfetto_trace=True):
        run()
    names = {}
    hlo = sorted((work / "hlo").glob(f"*{module}*after_optimizations.txt"))[-1]  # the last compiled
    for line in hlo.read_text().splitlines():
        m = re.match(r"\s+(?:ROOT )?%?([\w.\-]+) = (\S+) .*op_name=\"([^\"]+)\"", line)
        if m:
            names[m.group(1)] = ("/".join(m.group(3).split("/")[-2:]), m.group(2).split("{")[0])
    trace = next((work / "trace").rglob("*.trace.json.gz"))
    total, count = collections.Counter(), collections.Counter()
    for e in json.load(gzip.open(trace))["traceEvents"]:
        if e.get("ph") == "X" and e["name"] in names:
            key = (re.sub(r"\.\d+$", "", e["name"]), *reversed(names[e["name"]]))
            total[key] += e["dur"]
            count[key] += 1
    print(f"ops summed: {sum(total.values()) / 1e3:.0f} ms; top {args.top} by time (trace and HLO in {work}):")
    print(f"{'ms':>9} {'calls':>6}  {'kind':26} {'shape':28} source")
    for key, us in total.most_common(args.top):
        print(f"{us / 1e3:9.1f} {count[key]:6d}  {key[0][:26]:26} {key[1][:28]:28} {key[2][:60]}")


if __name__ == "__main__":
    sys.exit(main())
