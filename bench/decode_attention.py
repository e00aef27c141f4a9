"""What one decode step's attention costs on this CPU, in the form the samplers use and in rewrites of it.

Times a jitted loop over `--layers` layers of decode attention (one query per row, SmolLM2-135M's 9 query
and 3 KV heads of 64, `--dtype` keys, values and queries, each layer its own keys and values, in the layout
each contender reads) at `--rows` × `--columns`, each row attending its first L columns (L drawn
uniformly from [columns/4, columns], as rows of varied lengths in one batch), the contenders alternated;
median of `--samples`, compile excluded. Each rewrite is checked against the current form first (max abs
difference printed).
  current    `marljax.models.attention.attention` over its layout ("keys_ds": keys [B, K, Dh, S], values
             [B, K, S, Dh]): scores, mask, softmax, value product
  cpu_kernel `marljax.sampling.engine.cpu_attention.segmented_decode_attention` over the same arrays (one segment,
             each row's length): the engine's CPU kernel, which reads each row's first L columns only
  keys_sd    the same over the dense cache's layout before 2026-12-06 (keys [B, K, S, Dh], values
             [B, K, Dh, S]; written out here since it left the package); the rewrites below read it too
  late_norm  unnormalised exponentials into the value product, divided after (`bkgd,bksd->bkgs` scores)
  keys_rows  keys as the rows of the scores product (`bksd,bkgd->bksg`), softmax over that axis
  mul_sum    scores as a multiply and a sum over the head dimension

    nice python bench/decode_attention.py [--rows 128] [--columns 432] [--layers 30] [--samples 5]
                                          [--dtype float32|bfloat16] [--contenders current cpu_kernel …]
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
from marljax.models.precision import dot_f32
from marljax.sampling.engine.cpu_attention import segmented_decode_attention

H, K, DH = 9, 3, 64
G = H // K
FLOOR = float(jnp.finfo(jnp.float32).min)


def current(q_bthd, k, v, mask_bs):
    return attention(q_bthd, k, v, mask_bs[:, None])


def cpu_kernel(q_bthd, k, v, mask_bs):
    return segmented_decode_attention(q_bthd, [(k, v, mask_bs.sum(axis=1, dtype=jnp.int32))])


def keys_sd(q_bthd, k_bksd, v_bkds, mask_bs):
    """`current`'s float32 scores, floor, softmax and value product over keys [B, K, S, Dh]."""
    B, S = mask_bs.shape
    s = dot_f32("bkgd,bksd->bkgs", q_bthd.reshape(B, K, G, DH), k_bksd) * DH ** -0.5
    p = jax.nn.softmax(jnp.where(mask_bs[:, None, None], s, FLOOR), axis=-1)
    o = dot_f32("bkgs,bkds->bkgd", p.astype(v_bkds.dtype), v_bkds).astype(v_bkds.dtype)
    return o.reshape(B, 1, H, DH)


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


CONTENDERS = {"current": current, "cpu_kernel": cpu_kernel, "keys_sd": keys_sd, "late_norm": late_norm,
              "keys_rows": keys_rows, "mul_sum": mul_sum}
# keys and values [B, S, K, Dh] -> each contender's layout
LAYOUTS = {"keys_ds": ((0, 2, 3, 1), (0, 2, 1, 3)), "keys_sd": ((0, 2, 1, 3), (0, 2, 3, 1))}


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
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--contenders", nargs="+", choices=list(CONTENDERS), default=list(CONTENDERS))
    a = ap.parse_args()
    print(machine(malloc=False))
    B, S = a.rows, a.columns
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(B, 1, H, DH)), a.dtype)
    kv = [rng.normal(size=(2, B, S, K, DH)).astype(np.float32) for _ in range(a.layers)]
    mask = jnp.arange(S)[None] <= jnp.asarray(rng.integers(S // 4, S, size=(B, 1)))
    runs = {name: layers_of(CONTENDERS[name], a.layers) for name in dict.fromkeys(["current", *a.contenders])}
    arrays = {lay: ([jnp.asarray(k.transpose(kt), a.dtype) for k, _ in kv],
                    [jnp.asarray(v.transpose(vt), a.dtype) for _, v in kv]) for lay, (kt, vt) in LAYOUTS.items()}
    layout = {name: "keys_ds" if name in ("current", "cpu_kernel") else "keys_sd" for name in runs}
    ref = np.asarray(runs["current"](q, *arrays["keys_ds"], mask), np.float32)
    for name, run in runs.items():
        diff = np.abs(np.asarray(run(q, *arrays[layout[name]], mask), np.float32) - ref).max()
        print(f"{name}: max |difference| from current {diff:.2e}")
    times = {name: [] for name in runs}
    for _ in range(a.samples):
        for name, run in runs.items():
            t = time.perf_counter()
            jax.block_until_ready(run(q, *arrays[layout[name]], mask))
            times[name].append(time.perf_counter() - t)
    gb = 2 * a.layers * B * K * S * DH * jnp.dtype(a.dtype).itemsize / 1e9
    real = float(mask.mean())
    print(f"\n{B} rows × {S} columns × {a.layers} layers, {a.dtype}: {gb:.2f} GB of keys and values per step, "
          f"{real * gb:.2f} GB of them in the rows' lengths (mean {real * S:.0f} columns)")
    print("| contender | ms per step (median) | range | GB/s of the whole width | GB/s of the rows' lengths |\n"
          "|---|---|---|---|---|")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {1e3 * med:.1f} | {1e3 * min(ts):.1f}–{1e3 * max(ts):.1f} | {gb / med:.1f} | "
              f"{real * gb / med:.1f} |")


if __name__ == "__main__":
    main()
