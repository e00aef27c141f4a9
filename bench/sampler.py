"""Sampler throughput: marljax vs transformers `generate` (torch CPU), SmolLM2-135M, greedy.

64-token prompts, 64 new tokens (no early stop), batch 1, 16 and 64. The two engines alternate run by
run (the machine drifts ±30%); each figure is the median of `--repeats` runs. Prefill is timed as a
1-new-token generation, decode as the rest. Compile time is excluded (each shape runs once before the
timed runs); the first calls' excess over the medians is printed as the compile time. The roof is
this machine's XLA fp32 matmul rate, measured in the same run; FLOPs are `marljax/models/flops.py`'s model
FLOPs: prefill = every prompt token through the layers (causal attention) and the head on the last
prompt position only (where the sampler computes logits); decode = each new token's layers, attention
over its context and head.

    python bench/sampler.py [--batches 1 16 64] [--repeats 3] [--write] [--smoke]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from benchdoc import bench_model, machine, write_section  # first (before jax); bench/ is on sys.path
import jax
import numpy as np

from marljax.models.flops import decode_flops, prefill_flops
from roofline import matmul_gflops
from marljax.models.sources import smollm2_gguf_path
from marljax.sampling import SamplingParams, generate, layer_weights

PROMPT, NEW = 64, 64


def run_ours(model, prompts, new):
    sp = SamplingParams(max_new_tokens=new, temperature=0.0)
    t = time.perf_counter()
    out = generate(model[0], prompts, sp, layers=model[1])
    assert all(len(x) == new for x in out.tokens)
    return time.perf_counter() - t


def run_hf(hf, prompts, new):
    import torch
    ids = torch.tensor(prompts)
    t = time.perf_counter()
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                          do_sample=False, pad_token_id=0)
    assert out.shape[1] == ids.shape[1] + new
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--write", action="store_true", help="replace the section in docs/benchmarks.md")
    ap.add_argument("--smoke", action="store_true", help="ours a tiny random model, 8-token prompts, 4 new: seconds")
    args = ap.parse_args()
    prompt_len, new = (8, 4) if args.smoke else (PROMPT, NEW)

    import torch
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(os.cpu_count())
    gguf = smollm2_gguf_path()
    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, torch_dtype=torch.float32)
    hf.eval()
    model = bench_model("smollm2-135m-instruct", args.smoke)
    cfg = model.config
    ours = (model, layer_weights(model))  # per-layer weights made once, as the trainer does per sampling call
    roof = matmul_gflops()
    lines = ["## Sampler (SmolLM2-135M, CPU)", "",
             f"`python bench/sampler.py --batches {' '.join(map(str, args.batches))} --repeats {args.repeats}` on "
             f"{time.strftime('%Y-%m-%d %H:%M')}, {machine()}, jax {jax.__version__}, torch {torch.__version__}; "
             f"XLA fp32 matmul roof measured in the same run: {roof:.1f} GFLOP/s. {prompt_len}-token random prompts, "
             f"{new} new tokens (no early stop), greedy; marljax and HF `generate` alternate run by run; medians. "
             "marljax samples from per-layer weights made once (`layer_weights`, as the trainer does once per "
             "sampling call); HF holds per-layer tensors anyway. Prefill = a 1-token generation; decode = the rest. "
             "% of roof = model FLOP/s (`marljax/models/flops.py`: causal attention; the head on the last prompt position "
             "in prefill, on every new token in decode) over the measured matmul rate. Compile time is excluded "
             "(every shape runs once first); its column is each engine's first calls' excess over the medians (for HF, "
             "which compiles nothing, warm-up only).", "",
             "| batch | engine | prefill tok/s | decode tok/s | end-to-end new tok/s | decode % of roof | "
             "prefill % of roof | compile s (excluded) |", "|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    rng = np.random.default_rng(0)
    ratios = {}
    for b in args.batches:
        prompts = rng.integers(100, cfg.vocab_size - 100, (b, prompt_len)).tolist()
        first = {name: (fn(m, prompts, 1), fn(m, prompts, new))  # warm-up: compiles, not in the medians
                 for name, fn, m in (("marljax", run_ours, ours), ("hf", run_hf, hf))}
        times = {"marljax": {"pre": [], "full": []}, "hf": {"pre": [], "full": []}}
        for _ in range(args.repeats):
            for name, fn, m in (("marljax", run_ours, ours), ("hf", run_hf, hf)):
                times[name]["pre"].append(fn(m, prompts, 1))
                times[name]["full"].append(fn(m, prompts, new))
        e2e = {}
        for name in ("marljax", "hf"):
            pre = statistics.median(times[name]["pre"])
            full = statistics.median(times[name]["full"])
            dec = max(full - pre, 1e-9)
            pre_tps, dec_tps = b * prompt_len / pre, b * (new - 1) / dec
            e2e[name] = b * new / full
            dec_frac = decode_flops(cfg, prompt_len, new, b) / dec / 1e9 / roof
            pre_frac = prefill_flops(cfg, [prompt_len] * b) / pre / 1e9 / roof
            compile_s = (first[name][0] - pre) + (first[name][1] - full)
            lines.append(f"| {b} | {name} | {pre_tps:.0f} | {dec_tps:.1f} | {e2e[name]:.1f} | "
                         f"{100 * dec_frac:.0f}% | {100 * pre_frac:.0f}% | {compile_s:.1f} |")
            print(lines[-1], flush=True)
        ratios[b] = e2e["marljax"] / e2e["hf"]
    lines += ["", "marljax / HF end-to-end: " + ", ".join(f"**{r:.2f}× at batch {b}**" for b, r in ratios.items())
              + ".", ""]
    print("\n".join(lines[-3:]))
    if args.write:
        write_section(lines[0], "\n".join(lines))


if __name__ == "__main__":
    main()
