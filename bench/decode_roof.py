"""How fast can one decode step of SmolLM2-135M be on this machine: the ceiling the rollout bench lives under.

For each `--rows` B it times, jitted and warm (median of `--samples`, compile excluded):
  matmuls  the step's linear maps only (q, k, v, o, gate, up, down in every layer, and the tied output
           projection), the model's real weights, chained as in the model: the floor of any sampler that
           computes a step in float32 with XLA, whatever its batching, cache or attention
  step     the model's whole step (`Decoder.hidden` over a dense cache of `--length` columns + `logits`):
           what the static sampler (bench/static_sampler.py) runs per step, minus the draw
Tokens/s bounds are B over the step time: every row yields a token per step. A sampler decoding B rows at
a time cannot beat B / matmuls-time; continuous batching and paged KV only remove work beyond it
(finished rows decoded on, padded columns attended, prompts prefilled more than once).

    nice python bench/decode_roof.py [--rows 64 256] [--length 256] [--samples 5] [--write] [--smoke]
"""
from __future__ import annotations

import argparse
import statistics
import time

from benchdoc import bench_model, machine, publish  # first (before jax); bench/ is on sys.path when a script here runs
import jax
import jax.numpy as jnp
import numpy as np

from marljax.sampling import layer_weights
from static_sampler import dense_cache_attention, init_cache


def linear_flops(cfg) -> int:
    """Multiply-adds × 2 of one token's linear maps and output projection."""
    return 2 * (cfg.num_params() - cfg.vocab_size * cfg.hidden_size * (0 if cfg.tie_embeddings else 1)
                - cfg.num_layers * 2 * cfg.hidden_size - cfg.hidden_size)


def matmuls(layers, embed_ve, h_be):
    """One step's linear maps over B rows (weights flattened to 2-D), chained through a residual."""
    total = jnp.float32(0)
    for w in layers:
        flat = {k: w[k].reshape(-1, w[k].shape[-1]) if k == "wo" else w[k].reshape(w[k].shape[0], -1)
                for k in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")}
        q = h_be @ flat["wq"]
        total += jnp.sum(h_be @ flat["wk"]) + jnp.sum(h_be @ flat["wv"])
        h_be = h_be + q @ flat["wo"]
        h_be = h_be + (jax.nn.silu(h_be @ flat["w_gate"]) * (h_be @ flat["w_up"])) @ flat["w_down"]
    return total + jnp.sum(jnp.einsum("be,ve->bv", h_be, embed_ve))


def timed(fn, *args, samples: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(samples):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--length", type=int, default=256, help="cache columns the whole step attends")
    ap.add_argument("--samples", type=int, default=5)
    ap.add_argument("--write", action="store_true", help="replace the section in docs/benchmarks.md")
    ap.add_argument("--smoke", action="store_true", help="a tiny random model (benchdoc.smoke_config): seconds")
    args = ap.parse_args()
    model = bench_model("smollm2-135m-instruct", args.smoke)
    cfg, layers = model.config, layer_weights(model)
    embed = model.embed[...]
    mm = jax.jit(matmuls)

    @jax.jit
    def step(layers, cache, token_b, pos_b):
        h, cache = model.hidden(token_b[:, None], pos_b[:, None], cache=cache, cache_attention=dense_cache_attention,
                                layers=layers)
        return model.logits(h[:, 0]), cache

    flops = linear_flops(cfg)
    rng = np.random.default_rng(0)
    rows_out = []
    for B in args.rows:
        h = jnp.asarray(rng.standard_normal((B, cfg.hidden_size)) * 0.1, jnp.float32)
        t_mm = timed(mm, layers, embed, h, samples=args.samples)
        cache = init_cache(cfg, B, args.length)
        token = jnp.asarray(rng.integers(100, 40000, B), jnp.int32)
        pos = jnp.full(B, args.length - 1, jnp.int32)  # attends all columns
        t_step = timed(step, layers, cache, token, pos, samples=args.samples)
        rows_out.append((B, t_mm, t_step))
        print(f"rows {B}: matmuls {t_mm * 1e3:.1f} ms, step {t_step * 1e3:.1f} ms", flush=True)
    cmd = (f"nice python bench/decode_roof.py --rows {' '.join(map(str, args.rows))} --length {args.length} "
           f"--samples {args.samples}")
    lines = ["## Decode roof (SmolLM2-135M, float32, CPU)", "",
             f"`{cmd}` on {time.strftime('%Y-%m-%d %H:%M')}, {machine()}, jax {jax.__version__}. One decode step "
             f"timed jitted and warm (median of {args.samples}; compile excluded). *matmuls*: the step's linear maps "
             f"and tied output projection only ({flops / 1e6:.0f} MFLOP per token), the floor of any float32 XLA "
             f"sampler at that batch; *step*: the model's whole step over a dense cache of {args.length} columns "
             "(attention, norms, logits; no draw). Bounds in tokens/s are rows over the step time.", "",
             "| rows | matmuls ms | matmul GFLOP/s | bound tok/s (matmuls) | step ms | bound tok/s (step) |",
             "|---|---|---|---|---|---|"]
    for B, t_mm, t_step in rows_out:
        lines.append(f"| {B} | {t_mm * 1e3:.1f} | {B * flops / t_mm / 1e9:.0f} | {B / t_mm:.0f} | "
                     f"{t_step * 1e3:.1f} | {B / t_step:.0f} |")
    publish("\n".join(lines), args.write)


if __name__ == "__main__":
    main()
