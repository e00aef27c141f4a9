"""Train-step throughput on SmolLM2-135M: tokens/s and model FLOP utilisation, LoRA and full fine-tuning,
each with full and `dots` rematerialisation, vs the machine's measured XLA fp32 matmul rate, in one run
(the contenders alternate).

Model FLOPs (what the step must compute, whatever it recomputes), per sequence token: forward 2·P_layers
+ attention (2·heads·head_dim·T/2 multiply-adds, causal), backward twice that for activation gradients,
plus 2·P_layers weight gradients for full fine-tuning; the output projection (D × vocab) for response
tokens only, forward + input gradient (+ embedding gradient for full fine-tuning); LoRA's rank-r matmuls
(< 1%) are not counted. MFU = model FLOP/s ÷ roof. Executed FLOP/s adds what remat recomputes: the
layers' forward for `full`, the attention forward for `dots`.

The machine drifts (±30% within minutes), so the roof is sampled before every timed step and once at
the end, in the same alternation as the contenders, each sample and each step after a 1 s pause (a step
frees gigabytes of buffers in the background, which slows whatever runs right after it). MFU is the
median step's model FLOP/s over the median roof sample and, more conservatively, over the highest one.
Page faults and kernel CPU time per step (medians, from getrusage) show what XLA CPU's per-execution
temp buffer costs when malloc returns it to the system after each call (`MARLJAX_HOST_MALLOC=system`):
it is then mmapped afresh and faulted in page by page; bench/host_malloc.py measures that side by side.

    python bench/train_step.py [--batch 8] [--length 256] [--repeats 3] [--write] [--smoke]
"""
from __future__ import annotations

import argparse
import resource
import statistics
import time

from benchdoc import bench_model, machine, publish  # first (before jax); bench/ is on sys.path when a script here runs
import jax
import numpy as np

from roofline import matmul_gflops
from marljax.build import Policy, build_trainer, build_workflow, init_state
from marljax.config import load_config, resolve
from marljax.core import sharding
from marljax.rl.step import Sample, pack

SETTINGS = ["workflow=single", "rl.minibatch=balanced", "lora.rank=16"]  # on the paper's config: one set, AdamW


def step_flops(cfg, rows: int, length: int, resp: int, full: bool, remat: str) -> tuple[float, float]:
    """(model FLOPs, executed FLOPs) of one step over rows × length tokens, resp response tokens per row."""
    dense = 0
    for name in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
        i, o = cfg.linear_shape(name)
        dense += int(np.prod(i)) * int(np.prod(o))
    dense *= cfg.num_layers
    attn = cfg.num_layers * 2 * cfg.num_heads * cfg.head_dim * length / 2  # multiply-adds per token
    head = cfg.hidden_size * cfg.vocab_size
    tokens = rows * length
    model = tokens * (2 * dense * (3 if full else 2) + 2 * attn * 3) + rows * resp * 2 * head * (3 if full else 2)
    recompute = {"full": tokens * 2 * (dense + attn), "dots": tokens * 2 * attn, "none": 0.0}[remat]
    return model, model + recompute


def random_batch(rows: int, length: int) -> dict:
    """One role's batch of `rows` random sequences, half prompt and half response tokens."""
    rng = np.random.default_rng(0)
    half = length // 2
    return {"generator": pack([Sample("generator", rng.integers(10, 40000, half).tolist(),
                                      rng.integers(10, 40000, half - 1).tolist(), float(rng.normal()))
                               for _ in range(rows)])}


class Contender:
    """The trainer `train` builds (`marljax.build`) for the paper's config with `SETTINGS`, LoRA rank 16 or
    full fine-tuning (`lora.enabled`) and `rl.remat`, over `model` on this process's devices, with its
    fresh state, stepped in place."""

    def __init__(self, model, batch: dict, lora: bool, remat: str):
        cfg = resolve(load_config(None, [*SETTINGS, f"lora.enabled={lora}", f"rl.remat={remat}"]))
        mesh = sharding.make_mesh(cfg.mesh)
        policy = Policy(mesh, sharding.get_rules(cfg.mesh, mesh), model, None, cfg.lora.build())
        workflow, policy_map = build_workflow(cfg)
        params = policy.init_params(cfg, policy_map.sets)
        self.batch = batch
        self.trainer, shardings = build_trainer(cfg, policy, workflow, policy_map, params)
        self.state = init_state(self.trainer, params, shardings)

    def step(self) -> tuple[float, int, float]:
        """One `Trainer.update`: (seconds, minor page faults, kernel CPU seconds)."""
        r0, t = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        self.state, _ = self.trainer.update(self.state, self.batch, np.float32(1e-5), recompute_old=False)
        jax.block_until_ready(self.state.params)
        seconds, r1 = time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF)
        return seconds, r1.ru_minflt - r0.ru_minflt, r1.ru_stime - r0.ru_stime


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--write", action="store_true", help="replace the section in docs/benchmarks.md")
    ap.add_argument("--smoke", action="store_true", help="a tiny random model (benchdoc.smoke_config): seconds")
    args = ap.parse_args()
    model = bench_model("smollm2-135m-instruct", args.smoke)
    settle = 0 if args.smoke else 1  # seconds
    cfg = model.config
    batch = random_batch(args.batch, args.length)
    contenders = {(mode, remat): Contender(model, batch, mode.startswith("LoRA"), remat)
                  for mode in ("LoRA r16", "full fine-tuning") for remat in ("full", "dots")}
    times = {m: [] for m in contenders}
    faults = {m: [] for m in contenders}  # (minor page faults, kernel CPU s) per step
    roofs = []
    for rep in range(args.repeats + 1):
        for key, c in contenders.items():
            time.sleep(settle)  # a step frees GB of buffers in the background: let that settle before timing
            roof = matmul_gflops(reps=20)
            time.sleep(settle)
            seconds, minflt, stime = c.step()
            if rep:  # the first round compiles
                times[key].append(seconds)
                faults[key].append((minflt, stime))
                roofs.append(roof)
    time.sleep(settle)
    roofs.append(matmul_gflops(reps=20))
    roof, peak = statistics.median(roofs), max(roofs)
    length, resp = batch["generator"].tokens_bt.shape[1], batch["generator"].resp_mask_br.shape[1]
    n_tokens = args.batch * length
    lines = ["## Train step (SmolLM2-135M, CPU)", "",
             f"`python bench/train_step.py --batch {args.batch} --length {args.length} --repeats {args.repeats}` "
             f"on {time.strftime('%Y-%m-%d %H:%M')}, {machine()}, jax {jax.__version__}; one `Trainer.update` "
             f"(PPO loss, per-role diagnostics, AdamW) on {args.batch} × {length} tokens ({resp} response "
             "tokens per row), the contenders alternating, median step times. XLA fp32 matmul roof sampled "
             f"before every step: median {roof:.0f}, range {min(roofs):.0f}–{peak:.0f} GFLOP/s. Model and "
             "executed FLOPs as the script's docstring counts them.", "",
             "| mode | remat | step s | tokens/s | model GFLOP/s | MFU (median roof) | MFU (peak roof) "
             "| executed GFLOP/s | page faults | kernel CPU s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for (mode, remat), ts in times.items():
        s = statistics.median(ts)
        model_f, exec_f = step_flops(cfg, args.batch, length, resp, not mode.startswith("LoRA"), remat)
        lines.append(f"| {mode} | {remat} | {s:.2f} | {n_tokens / s:.0f} | {model_f / s / 1e9:.1f} | "
                     f"{100 * model_f / s / 1e9 / roof:.0f}% | {100 * model_f / s / 1e9 / peak:.0f}% | "
                     f"{exec_f / s / 1e9:.1f} | {statistics.median(f for f, _ in faults[(mode, remat)]) / 1e3:.0f}k | "
                     f"{statistics.median(k for _, k in faults[(mode, remat)]):.2f} |")
    publish("\n".join(lines) + "\n", args.write)


if __name__ == "__main__":
    main()
