"""Uncached attention on CPU: dense vs blockwise (several chunk lengths), forward + backward of one layer at
SmolLM2-135M's shapes (9 heads, 3 KV heads, head_dim 64), `--batch` rows, per sequence length. Prints the median
time of each contender over alternating repeats, its ratio to dense, and the compiled temp memory; this is
how `attention.DENSE_MAX_LENGTH` and `attention.BLOCK` were chosen (docs/scale_out.md).

    python bench/attention.py [--batch 1] [--lengths 256 512 1024 2048 4096] [--blocks 128 256 512] [--repeats 3]
"""
from __future__ import annotations

import argparse
import statistics
import time

from benchdoc import machine  # first (before jax); bench/ is on sys.path when a script here runs
import jax
import jax.numpy as jnp
import numpy as np

from marljax.models.attention import blockwise_attention, causal_attention

H, K, DH = 9, 3, 64


def contender(block: int | None):
    """jitted gradient of sum(attention · w) w.r.t. q, k, v: dense when `block` is None."""
    def attend(q, k, v, pos):
        if block is None:
            return causal_attention(q, k, v, pos, None, "dense")
        return blockwise_attention(q, k, v, pos, jnp.ones(pos.shape, bool), block)
    return jax.jit(jax.grad(lambda q, k, v, pos, w: jnp.sum(attend(q, k, v, pos) * w), argnums=(0, 1, 2)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096])
    ap.add_argument("--blocks", type=int, nargs="+", default=[128, 256, 512])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch", type=int, default=1)
    a = ap.parse_args()
    print(machine(malloc=False))
    rng = np.random.default_rng(0)
    for T in a.lengths:
        q, w = (jnp.asarray(rng.normal(size=(a.batch, T, H, DH)), jnp.float32) for _ in range(2))
        k, v = (jnp.asarray(rng.normal(size=(a.batch, T, K, DH)), jnp.float32) for _ in range(2))
        args = (q, k, v, jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (a.batch, T)), w)
        names = ["dense"] + [f"blockwise-{b}" for b in a.blocks]
        fns = [contender(None)] + [contender(b) for b in a.blocks]
        temp = [f.lower(*args).compile().memory_analysis().temp_size_in_bytes for f in fns]
        for f in fns:
            jax.block_until_ready(f(*args))  # compile and warm up
        times = {n: [] for n in names}
        for _ in range(a.repeats):  # alternate the contenders: the machine drifts
            for n, f in zip(names, fns):
                t0 = time.perf_counter()
                jax.block_until_ready(f(*args))
                times[n].append(time.perf_counter() - t0)
        dense = statistics.median(times["dense"])
        for n, t in zip(names, temp):
            med = statistics.median(times[n])
            print(f"T={T:5d} {n:14s} {med * 1e3:9.1f} ms  ×{med / dense:5.2f} of dense  temp {t / 2**20:8.1f} MiB",
                  flush=True)


if __name__ == "__main__":
    main()
