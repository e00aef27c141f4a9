"""What one decode step's attention costs on this CPU, in the form the samplers use and in rewrites of it.

Times a jitted loop over `--layers` layers of decode attention (one query per row, SmolLM2-135M's 9 query
and 3 KV heads of 64, float32, keys [B, K, S, Dh] and values [B, K, Dh, S] as the dense cache holds them,
each layer its own arrays) at `--rows` × `--columns`, the contenders alternated; median of `--samples`,
compile excluded. Each rewrite is checked against the current form first (max abs difference printed).
  current    `marljax.models.attention.attention(..., "cache")`: scores, mask, softmax, value product
  late_norm  unnormalised exponentials into the value product, divided after (`bkgd,bksd->bkgs` scores)
  keys_rows  keys as the rows of the scores product (`bksd,bkgd->bksg`), softmax over that axis
  mul_sum    scores as a multiply and a sum over the head dimension

    nice python bench/decode_attention.py [--rows 128] [--columns 432] [--layers 30] [--samples 5]
"""
from __future__ import annotations

import argparse
import statistics
import time

from benchdoc import machine  # first (before jax); bench/ is on sys.path when a script here runs
import jax
import jax.numpy as jnp
import numpy as np

from marljax.models.attention import attention

H, K, DH = 9, 3, 64
G = H // K
FLOOR = float(jnp.finfo(jnp.float32).min)


def current(q_bthd, k_bksd, v_bkds, mask_bs):
    return attention(q_bthd, k_bksd, v_bkds, mask_bs[:, None], "cache")


def late_norm(q_bthd, k_bksd, v_bkds, mask_bs):
    B, S = mask_bs.shape
    s = jnp.einsum("bkgd,bksd->bkgs", q_bthd.reshape(B, K, G, DH) * DH ** -0.5, k_bksd)
    s = jnp.where(mask_bs[:, None, None], s, FLOOR)
    e = jnp.exp(s - jnp.max(s, -1, keepdims=True))
    o = jnp.einsum("bkgs,bkds->bkgd", e, v_bkds) / jnp.sum(e, -1, keepdims=True)
    return o.reshape(B, 1, H, DH)


def keys_rows(q_bthd, k_bksd, v_bkds, mask_bs):
    B, S = mask_bs.shape
    s = jnp.einsum("bksd,bkgd->bksg", k_bksd, q_bthd.reshape(B, K, G, DH)) * DH ** -0.5
    p = jax.nn.softmax(jnp.where(mask_bs[:, None, :, None], s, FLOOR), axis=2)
    return jnp.einsum("bksg,bkds->bkgd", p, v_bkds).reshape(B, 1, H, DH)


def mul_sum(q_bthd, k_bksd, v_bkds, mask_bs):
    B, S = mask_bs.shape
    s = jnp.sum(q_bthd.reshape(B, K, G, 1, DH) * k_bksd[:, :, None], -1) * DH ** -0.5
    p = jax.nn.softmax(jnp.where(mask_bs[:, None, None], s, FLOOR), axis=-1)
    return jnp.einsum("bkgs,bkds->bkgd", p, v_bkds).reshape(B, 1, H, DH)


CONTENDERS = {"current": current, "late_norm": late_norm, "keys_rows": keys_rows, "mul_sum": mul_sum}


def layers_of(attend, layers: int):
    """A jitted loop over `layers` layers of `attend`, each layer's query depending on the one before."""
    @jax.jit
    def run(q_bthd, ks, vs, mask_bs):
        out = jnp.zeros_like(q_bthd)
        for i in range(layers):
            out = out + attend(q_bthd + 1e-3 * out, ks[i], vs[i], mask_bs)
        return out
    return run


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--columns", type=int, default=432)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--samples", type=int, default=5)
    a = ap.parse_args()
    print(machine(malloc=False))
    B, S = a.rows, a.columns
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(B, 1, H, DH)), jnp.float32)
    ks = [jnp.asarray(rng.normal(size=(B, K, S, DH)), jnp.float32) for _ in range(a.layers)]
    vs = [jnp.asarray(rng.normal(size=(B, K, DH, S)), jnp.float32) for _ in range(a.layers)]
    mask = jnp.arange(S)[None] <= jnp.asarray(rng.integers(S // 4, S, size=(B, 1)))
    runs = {name: layers_of(f, a.layers) for name, f in CONTENDERS.items()}
    ref = np.asarray(runs["current"](q, ks, vs, mask))
    for name, run in runs.items():
        print(f"{name}: max |difference| from current {np.abs(np.asarray(run(q, ks, vs, mask)) - ref).max():.2e}")
    times = {name: [] for name in runs}
    for _ in range(a.samples):
        for name, run in runs.items():
            t = time.perf_counter()
            jax.block_until_ready(run(q, ks, vs, mask))
            times[name].append(time.perf_counter() - t)
    gb = 2 * a.layers * B * K * S * DH * 4 / 1e9
    print(f"\n{B} rows × {S} columns × {a.layers} layers: {gb:.2f} GB of keys and values per step")
    print("| contender | ms per step (median) | range | GB/s of keys and values |\n|---|---|---|---|")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {1e3 * med:.1f} | {1e3 * min(ts):.1f}–{1e3 * max(ts):.1f} | {gb / med:.1f} |")


if __name__ == "__main__":
    main()
