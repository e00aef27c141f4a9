"""Rollout throughput, the RL workload: the engine vs the static sampler before it vs HF `generate`.

SmolLM2-135M-Instruct, GSM8K test questions in the math `solve` prompt (chat template), each sampled
`--samples` times (a GRPO group: identical prompts side by side), T = 0.7, top-p 1, max 256 new tokens,
stop on the chat's end tokens. Contenders, alternated within each repeat (the machine drifts):
  engine  `marljax.sampling.engine.Engine.generate` (continuous batching over `--slots` slots, paged KV, shared
          prompt prefixes; on a CPU the `cpu_kernel` attention: pages gathered once per decode chunk into a
          dense copy, which `marljax.sampling.engine.cpu_attention`'s kernel reads up to each row's real length)
  engine-xla-chunk  the same engine with `attention="chunk"`: the dense copy read by XLA's masked
          attention over the copy's whole width (the CPU path before the kernel)
  engine-gather  the same engine with `attention="gather"` (pages gathered at every decode step)
  engine-one-group  the same engine with `length_groups=1`: every decode row over one dense copy as wide as
          the longest row (the chunk path before its length groups)
  engine-optimistic  the same engine with `admission="optimistic"` (a request needs its first chunk's
          pages, not its worst case; the pool grows to the tokens in flight)
  engine-chunk16  the same engine with decode chunks of 16 steps (default 32, `engine.CHUNK_STEPS`): twice
          the chunks' fixed work (the dense copy of the rows' pages, the host scheduler), fewer idle row-steps
  static  `generate_static` (bench/static_sampler.py: the sampler before the engine, frozen here), one call
          over the whole batch: prefill + `lax.while_loop` over a padded [B, P + max_new] cache until every
          row is done. (Its form when the engine's issue #17 opened, with a full-vocabulary
          `jax.random.categorical` draw and keys [B, K, S, D] in its cache, was the contender
          static-issue-start until both left the package, issue #47; its figures stay in
          docs/benchmarks.md.)
  generate-default  `marljax.sampling.generate(model, prompts, params)`, the call a newcomer writes (its
          per-layer weights made once per model, its slots from the request)
  generate-tuned  the same with `layers=layer_weights(model)` and `num_slots=--slots` (the tuned call)
  generate-before  what `generate(model, prompts, params)` ran before its layers were cached:
          `Engine(model, num_slots=64).generate(prompts, params)` (the layers sliced anew per call)
  hf      transformers `generate` (torch CPU float32 whatever `--dtype`: its GGUF load computes in float32,
          and in bfloat16 it did not finish 2 sequences in 10 min here) on the same batch, left-padded
The engine and the static sampler read the per-layer weights the trainer makes once per sampling call
(`layer_weights`). Useful tokens = generated tokens up to and including the first stop (what the
caller gets); tokens/s = useful tokens over the call's wall time (prefill included). Each repeat uses
its own seed (all contenders the same one). Compile time is excluded: every contender runs the workload
once first (HF: warm-up only), and that run is not timed. Also counted: prompt tokens prefilled, and the
peak KV memory (engine: peak pages in use × page bytes; static: its [B, P + max_new] cache).

    nice python bench/rollout.py [--prompts 8] [--samples 8] [--repeats 2] [--max-new 256]
                                 [--dtype float32|bfloat16] [--contenders engine static hf] [--write] [--smoke]
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import pathlib
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from benchdoc import bench_model, machine, publish  # first (before jax); bench/ is on sys.path when a script here runs
import jax
import numpy as np

from marljax.core.shapes import bucket, bucket_rows
from marljax.models import ChatCodec, load_tokenizer
from marljax.models.sources import smollm2_gguf_path
from marljax.sampling import SamplingParams, generate, layer_weights
from marljax.sampling.engine import Engine
from marljax.workflows.prompts import prompt_set
from static_sampler import generate_static

GSM8K = pathlib.Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "gsm8k" / "test.jsonl"
TEMPERATURE = 0.7


def workload(codec: ChatCodec, n_prompts: int, samples: int) -> list[list[int]]:
    solve = prompt_set("math").solve
    with open(GSM8K) as f:
        questions = [json.loads(line)["question"] for _, line in zip(range(n_prompts), f)]
    return [codec.render([{"role": "user", "content": solve.format(problem=q)}])
            for q in questions for _ in range(samples)]


def params(ctx, seed: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=ctx["max_new"], temperature=TEMPERATURE, top_p=1.0, top_k=0,
                          stop_token_ids=tuple(ctx["codec"].stop_token_ids), seed=seed)


def run_engine(ctx, prompts, seed, name="engine"):
    t = time.perf_counter()
    out = ctx[name].generate(prompts, params(ctx, seed), layers=ctx["layers"])
    wall = time.perf_counter() - t
    ctx[name].release()  # its pool is not held while the other contenders run (the next call allocates anew)
    return wall, sum(map(len, out.tokens))


def run_static(ctx, prompts, seed):
    t = time.perf_counter()
    out = generate_static(ctx["model"], prompts, params(ctx, seed), layers=ctx["layers"])
    return time.perf_counter() - t, sum(map(len, out.tokens))


def run_generate(ctx, prompts, seed, how):
    """`how`: default (`generate(model, prompts, params)`), tuned (layers and slots passed) or before."""
    model, sp = ctx["model"], params(ctx, seed)
    t = time.perf_counter()
    if how == "default":
        out = generate(model, prompts, sp)
    elif how == "tuned":
        out = generate(model, prompts, sp, layers=ctx["layers"], num_slots=ctx["slots"])
    else:
        out = Engine(model, num_slots=64).generate(prompts, sp)
    return time.perf_counter() - t, sum(map(len, out.tokens))


def run_hf(ctx, prompts, seed):
    import torch
    stops, P = list(ctx["codec"].stop_token_ids), max(map(len, prompts))
    ids = torch.full((len(prompts), P), stops[0], dtype=torch.long)
    mask = torch.zeros((len(prompts), P), dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding
        ids[i, P - len(p):] = torch.tensor(p)
        mask[i, P - len(p):] = 1
    torch.manual_seed(seed)
    t = time.perf_counter()
    with torch.no_grad():
        out = ctx["hf"].generate(ids, attention_mask=mask, max_new_tokens=ctx["max_new"], do_sample=True,
                                 temperature=TEMPERATURE, top_p=1.0, top_k=0, eos_token_id=stops,
                                 pad_token_id=stops[0])
    wall = time.perf_counter() - t
    useful = 0
    for row in out[:, P:].tolist():
        ends = [i for i, tok in enumerate(row) if tok in stops]
        useful += ends[0] + 1 if ends else len(row)
    return wall, useful


ENGINES = {"engine": {}, "engine-xla-chunk": {"attention": "chunk"}, "engine-gather": {"attention": "gather"},
           "engine-one-group": {"length_groups": 1},
           "engine-optimistic": {"admission": "optimistic"},
           "engine-chunk16": {"chunk_steps": 16}}  # Engine settings besides --slots
CONTENDERS = {**{name: functools.partial(run_engine, name=name) for name in ENGINES},
              "static": run_static,
              **{f"generate-{how}": functools.partial(run_generate, how=how)
                 for how in ("default", "tuned", "before")},
              "hf": run_hf}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--max-new", type=int, default=256, help="new tokens per sequence at most")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="the JAX contenders' weights, activations and KV cache (float32 accumulation)")
    ap.add_argument("--contenders", nargs="+", choices=list(CONTENDERS), default=list(CONTENDERS))
    ap.add_argument("--write", action="store_true", help="replace the section in docs/benchmarks.md")
    ap.add_argument("--smoke", action="store_true", help="the JAX contenders on a tiny random model: seconds")
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(os.cpu_count())
    hf = None
    if "hf" in args.contenders:
        gguf = smollm2_gguf_path()
        hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    model = bench_model("smollm2-135m-instruct", args.smoke, args.dtype)
    codec = ChatCodec(load_tokenizer("smollm2-135m-instruct"))
    ctx = {"model": model, "layers": layer_weights(model), "codec": codec, "hf": hf, "max_new": args.max_new,
           "slots": args.slots,
           **{name: Engine(model, num_slots=args.slots, **kw) for name, kw in ENGINES.items()
              if name in args.contenders or name == "engine"}}
    prompts = workload(codec, args.prompts, args.samples)
    load_start = os.getloadavg()
    contenders = {name: CONTENDERS[name] for name in args.contenders}
    first = {name: fn(ctx, prompts, 1000)[0] for name, fn in contenders.items()}  # compiles; not timed
    rates = {name: [] for name in contenders}
    walls = {name: [] for name in contenders}
    for r in range(args.repeats):
        for name, fn in contenders.items():
            wall, useful = fn(ctx, prompts, r)
            rates[name].append(useful / wall)
            walls[name].append(wall)
            print(f"repeat {r} {name}: {useful} tokens in {wall:.1f} s = {useful / wall:.1f} tok/s", flush=True)
    load_end = os.getloadavg()

    def rate(xs):
        if len(xs) == 1:
            return f"{xs[0]:.1f} (one repeat)"
        return f"{statistics.mean(xs):.1f} ± {statistics.stdev(xs) / math.sqrt(len(xs)):.1f}"

    cfg, stats = model.config, ctx["engine"].stats
    n, P = len(prompts), max(map(len, prompts))
    itemsize = np.dtype(jax.numpy.dtype(args.dtype)).itemsize
    static_kv = (bucket_rows(n) * (bucket(P, 16) + args.max_new) * 2 * cfg.num_layers * cfg.num_kv_heads
                 * cfg.head_dim * itemsize)
    cmd = (f"nice python bench/rollout.py --prompts {args.prompts} --samples {args.samples} "
           f"--repeats {args.repeats} --slots {args.slots} --max-new {args.max_new} --dtype {args.dtype} "
           f"--contenders {' '.join(contenders)}")
    lines = [f"## Rollout engine (SmolLM2-135M, GSM8K {args.prompts} × {args.samples}, {args.dtype}, CPU)", "",
             f"`{cmd}` on {time.strftime('%Y-%m-%d %H:%M')}, {machine()}, jax {jax.__version__}, torch "
             f"{torch.__version__}; load average {load_start[0]:.1f} at the start and {load_end[0]:.1f} at the end "
             "(the machine was shared with other jobs: absolute rates are low, the contenders alternate so the "
             f"ratios hold better). {n} sequences: {args.prompts} GSM8K test questions in the math solve prompt "
             f"(prompts {min(map(len, prompts))}–{P} tokens), each {args.samples} times; T = {TEMPERATURE}, "
             f"top-p 1, max {args.max_new} new tokens, chat stop tokens. Useful tokens = generated up to and including "
             "the first stop; tokens/s over each call's wall time, prefill included; mean ± s.e. over "
             f"{args.repeats} repeats (one seed each, shared by the contenders). Excluded: compile time (every "
             "contender first runs the workload once, untimed: first-run seconds in the last column). Engine: "
             f"{args.slots} slots, pages of {ctx['engine'].page_size} positions, chunks of "
             f"{ctx['engine'].chunk_steps} steps; static = `generate_static` (bench/static_sampler.py: one call, the "
             "trainer's `layer_weights`); hf = transformers `generate`, torch CPU float32, left-padded batch.", "",
             "| contender | useful tok/s | wall s per call | first run s (compile included) |", "|---|---|---|---|"]
    for name in contenders:
        lines.append(f"| {name} | {rate(rates[name])} | "
                     f"{statistics.mean(walls[name]):.1f} | {first[name]:.1f} |")
    if "engine" in contenders:
        ratio = {o: statistics.mean(rates["engine"]) / statistics.mean(rates[o]) for o in contenders if o != "engine"}
        lines += ["", "; ".join(f"engine / {o}: **{r:.2f}×**" for o, r in ratio.items())
                  + " (issue #17's targets: ≥ 2× the static sampler of its start and ≥ 3× hf"
                  + ("; engine-gather: a gather per decode step)." if "engine-gather" in ratio else ").")]
    lines += ["", f"Prefill: the engine prefilled {stats.prefill_tokens} prompt tokens (each distinct prompt once); "
              f"the static sampler and HF prefill every row: {sum(map(len, prompts))} real tokens "
              f"(static: {bucket_rows(n)} × {bucket(P, 16)} = {bucket_rows(n) * bucket(P, 16)} with padding). "
              f"Peak KV memory: engine {stats.peak_kv_bytes / 2**20:.1f} MiB (peak pages in use; pool allocated "
              f"{stats.pool_bytes / 2**20:.1f} MiB; the chunk path's dense copy of the decode rows' pages, held "
              f"from chunk to chunk: up to {stats.peak_dense_bytes / 2**20:.1f} MiB more, "
              f"{stats.dense_row_gathers} of {stats.decode_rows} running rows gathered into it) vs the static sampler's cache {static_kv / 2**20:.1f} MiB "
              f"({bucket_rows(n)} × {bucket(P, 16) + args.max_new} positions). Engine decode work in the last run: "
              f"{stats.decode_steps} row-steps for {stats.generated_tokens} tokens.", ""]
    for name in contenders:
        if name in ENGINES and name != "engine":
            st = ctx[name].stats
            lines += [f"{name}: peak pages in use {st.peak_kv_bytes / 2**20:.1f} MiB, pool allocated "
                      f"{st.pool_bytes / 2**20:.1f} MiB, dense copy up to {st.peak_dense_bytes / 2**20:.1f} MiB "
                      f"({st.dense_row_gathers} of {st.decode_rows} running rows gathered), "
                      f"{st.decode_steps} row-steps for {st.generated_tokens} tokens, {st.preemptions} preemptions "
                      "(last run).", ""]
    publish("\n".join(lines), args.write)


if __name__ == "__main__":
    main()
