"""A whole LoRA train step at long context on this CPU: SmolLM2-135M shapes (random weights: time and memory
do not depend on them), `S` samples of T tokens each (T − 256 prompt + 256 response), one role, one
`train_batch`, attention `dense` (float32 T×T scores) vs `auto` (blockwise above 512 tokens), with and
without token-budget micro-batches (`rl.micro_batch_tokens` = T: one sample per forward/backward).

Each configuration runs in a fresh process (peak RSS is per process): two steps, the second timed (the
first compiles). Reported: seconds per step, seconds per 1k tokens, peak RSS. Linear means time and
memory per token flat in T; quadratic means they double per doubling.

    python bench/long_context_step.py [--lengths 1024 2048 4096] [--samples 4] [--write] [--smoke]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

CONFIGS = (("dense", 0), ("auto", 0), ("auto", 1))  # (rl.attention, micro-batches of one sample?)
SETTINGS = ["workflow=single", "rl.minibatch=balanced", "lora.rank=16"]  # on the paper's config: one set, AdamW


def one(T: int, samples: int, attention: str, micro: bool, smoke: bool) -> dict:
    """Run in a child: build the trainer as `train` builds it (`marljax.build`) for the paper's config with
    `SETTINGS`, `rl.attention` and `rl.micro_batch_tokens`, take two steps, time the second, report peak RSS."""
    from benchdoc import smoke_config  # first, before jax: host memory as the CLIs keep it
    import resource

    import jax
    import numpy as np
    from flax import nnx

    from marljax.build import Policy, build_trainer, build_workflow, init_state
    from marljax.config import load_config, resolve
    from marljax.core import sharding
    from marljax.models.decoder import Decoder
    from marljax.models.presets import PRESETS
    from marljax.rl.step import Sample, train_batch

    cfg = PRESETS["smollm2-135m-instruct"]
    if smoke:
        cfg = smoke_config(cfg)
    run = resolve(load_config(None, [*SETTINGS, f"rl.attention={attention}",
                                     f"rl.micro_batch_tokens={T if micro else 0}"]))
    mesh = sharding.make_mesh(run.mesh)
    policy = Policy(mesh, sharding.get_rules(run.mesh, mesh), Decoder(cfg, rngs=nnx.Rngs(0)), None, run.lora.build())
    workflow, policy_map = build_workflow(run)
    params = policy.init_params(run, policy_map.sets)
    trainer, shardings = build_trainer(run, policy, workflow, policy_map, params)
    state = init_state(trainer, params, shardings)
    rng = np.random.default_rng(0)
    R = 256
    batch = [Sample("generator", list(rng.integers(1, cfg.vocab_size, T - R - 1)),
                    list(rng.integers(1, cfg.vocab_size, R)), float(rng.normal())) for _ in range(samples)]
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        state, m = train_batch(trainer, state, batch, 1e-4)
        jax.block_until_ready(state.params)
        times.append(time.perf_counter() - t0)
    return {"T": T, "attention": attention, "micro": micro, "step_s": times[1], "first_s": times[0],
            "rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    ap.add_argument("--smoke", action="store_true", help="a tiny model (benchdoc.smoke_config): seconds")
    args = ap.parse_args()
    if args.child:
        T, samples, attention, micro = args.child
        print(json.dumps(one(int(T), int(samples), attention, micro == "1", args.smoke)))
        return
    from benchdoc import machine, publish

    rows = []
    for T in args.lengths:  # contenders alternated within each length
        for attention, micro in CONFIGS:
            out = subprocess.run([sys.executable, __file__, "--child", str(T), str(args.samples), attention,
                                  str(micro), *["--smoke"] * args.smoke], capture_output=True, text=True)
            if out.returncode:
                rows.append({"T": T, "attention": attention, "micro": bool(micro),
                             "error": (out.stderr.strip().splitlines() or ["?"])[-1][:120]})
            else:
                rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(rows[-1], file=sys.stderr, flush=True)
    lines = ["## Long-context train step (CPU)", "",
             f"`python bench/long_context_step.py --lengths {' '.join(map(str, args.lengths))} --samples "
             f"{args.samples}` on {time.strftime('%Y-%m-%d')}, {machine()}. SmolLM2-135M shapes, LoRA rank 16 on "
             f"every layer, {args.samples} samples of T tokens (256 of them response), one `train_batch`; the "
             "second step timed (the first compiles), peak RSS of a fresh process per row. One run per row "
             "on a shared machine (±30%): read the trend over T, not single ratios.", "",
             "| T | attention | micro-batches | s / step | s / 1k tokens | peak RSS GiB |", "|---|---|---|---|---|---|"]
    for r in rows:
        mb = "1 sample each" if r["micro"] else "off"
        if "error" in r:
            lines.append(f"| {r['T']} | {r['attention']} | {mb} | failed: {r['error']} | | |")
        else:
            per_k = r["step_s"] / (r["T"] * args.samples / 1000)
            lines.append(f"| {r['T']} | {r['attention']} | {mb} | {r['step_s']:.1f} | {per_k:.2f} | "
                         f"{r['rss_gib']:.2f} |")
    publish("\n".join(lines) + "\n", args.write)


if __name__ == "__main__":
    main()
