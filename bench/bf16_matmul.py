"""XLA CPU matmul rates at the decoder's shapes: float32, bfloat16 with a bfloat16 output, and bfloat16 with
a float32 output rounded to bfloat16 after (what `decoder.linear` does, models/precision.py).

    python bench/bf16_matmul.py [--samples 5] [--write] [--smoke]   # "## bf16 matmuls" of docs/benchmarks.md

Shapes: SmolLM2-135M's MLP up (576 → 1536) and down (1536 → 576) and its logits (576 → 49152), at 64
rows (a decode step of 64 sequences) and 1024 rows (prefill or a train step's mini-batch). The three
variants alternate within each sample (the machine drifts); each sample times 10 calls after a warm
call; median and range over the samples. Compile time excluded. Also counted: the share of outputs where
each bfloat16 variant differs from the float64 product rounded to bfloat16 (both accumulate in float32;
they differ from it only where summation order moves a value across a rounding boundary).
"""
import argparse
import statistics
import time

from benchdoc import machine, publish  # first (before jax); bench/ is on sys.path when a script here runs
import jax
import jax.numpy as jnp
import numpy as np

SHAPES = [(64, 576, 1536), (64, 1536, 576), (64, 576, 49152), (1024, 576, 1536), (1024, 1536, 576)]
VARIANTS = {
    "float32": (jnp.float32, jax.jit(lambda x, w: jnp.dot(x, w))),
    "bf16 out": (jnp.bfloat16, jax.jit(lambda x, w: jnp.dot(x, w))),
    "f32 out, rounded": (jnp.bfloat16, jax.jit(
        lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16))),
}


def seconds(fn, x, w, reps: int = 10) -> float:
    fn(x, w).block_until_ready()
    t = time.perf_counter()
    for _ in range(reps):
        out = fn(x, w)
    out.block_until_ready()
    return (time.perf_counter() - t) / reps


def misrounded(out, x, w) -> float:
    """Share of `out`'s entries that differ from the float64 product of x and w rounded to bfloat16."""
    exact = np.asarray(jnp.asarray(np.asarray(x, np.float64) @ np.asarray(w, np.float64), jnp.bfloat16))
    return float(np.mean(np.asarray(out) != exact))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=5)
    ap.add_argument("--write", action="store_true", help="replace the section in docs/benchmarks.md")
    ap.add_argument("--smoke", action="store_true", help="one tiny shape: seconds")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    rows = []
    for m, k, n in [(8, 16, 32)] if args.smoke else SHAPES:
        x32, w32 = rng.standard_normal((m, k), np.float32), rng.standard_normal((k, n), np.float32) / np.sqrt(k)
        inputs = {name: (jnp.asarray(x32, dt), jnp.asarray(w32, dt)) for name, (dt, _) in VARIANTS.items()}
        rates = {name: [] for name in VARIANTS}
        for _ in range(args.samples):
            for name, (_, fn) in VARIANTS.items():
                rates[name].append(2 * m * k * n / seconds(fn, *inputs[name]) / 1e9)
        bf = inputs["bf16 out"]
        diff = [misrounded(VARIANTS[name][1](*bf), *bf) for name in ("bf16 out", "f32 out, rounded")]
        rows.append((m, k, n, rates, diff))
        print(m, k, n, {name: round(statistics.median(r)) for name, r in rates.items()}, diff, flush=True)
    lines = ["## bf16 matmuls (XLA CPU)", "",
             f"`python bench/bf16_matmul.py --samples {args.samples}` on {time.strftime('%Y-%m-%d %H:%M')}, "
             f"{machine()}, jax {jax.__version__}; load average {__import__('os').getloadavg()[0]:.1f} at the end. "
             f"GFLOP/s, median (range) over {args.samples} samples of 10 calls, the variants alternated; compile "
             "excluded. `f32 out, rounded` is what `decoder.linear` runs in bfloat16 (models/precision.py); "
             "misrounded: the share of outputs that differ from the float64 product rounded to bfloat16, for "
             "bf16 out / f32 out, rounded.", "",
             "| rows × in → out | float32 | bf16 out | f32 out, rounded | rounded / bf16 out | misrounded |",
             "|---|---|---|---|---|---|"]
    for m, k, n, rates, diff in rows:
        med = {name: statistics.median(r) for name, r in rates.items()}
        cell = lambda name: f"{med[name]:.0f} ({min(rates[name]):.0f}–{max(rates[name]):.0f})"  # noqa: E731
        lines.append(f"| {m} × {k} → {n} | {cell('float32')} | {cell('bf16 out')} | {cell('f32 out, rounded')} | "
                     f"{med['f32 out, rounded'] / med['bf16 out']:.1f}× | {diff[0]:.1e} / {diff[1]:.1e} |")
    publish("\n".join(lines + [""]), args.write)


if __name__ == "__main__":
    main()
