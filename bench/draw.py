"""The per-step token draw: `marljax.sampling.engine.draw.sample_rows` (two-stage Gumbel-max, `blocked_categorical`)
against the same per-row draw by `jax.random.categorical` (a Gumbel number per vocabulary entry: what it
did before), on XLA CPU.

    python bench/draw.py [--samples 5] [--write] [--smoke]     # the "## Token draw" section of docs/benchmarks.md

Rows × vocabulary: 64 × 49,152 (a SmolLM2 decode step of 64 sequences) and 64 × 151,936 (Qwen3's
vocabulary); T = 0.7, top-p 1, top-k off, each row its own key folded with its token index (as the
engine draws), plus its logprob. The contenders alternate within each sample; each sample times 10
calls after a warm call; median and range of ms per call. Compile time excluded.
"""
import argparse
import statistics
import time

from benchdoc import machine, publish  # first (before jax); bench/ is on sys.path when a script here runs
import jax
import jax.numpy as jnp
import numpy as np

from marljax.sampling.engine import draw

SHAPES = [(64, 49152), (64, 151936)]
TEMPERATURE = 0.7


def full_vocab_rows(logits_bv, keys_bk, n_gen_b):
    """`sample_rows` with each row's token drawn by `jax.random.categorical` over the whole vocabulary."""
    def one(logits_v, key_data, t):
        key = jax.random.fold_in(jax.random.wrap_key_data(key_data), t)
        return jax.random.categorical(key, logits_v / TEMPERATURE).astype(jnp.int32)

    tok_b = jax.vmap(one)(logits_bv, keys_bk, n_gen_b)
    return tok_b, draw.logprob_of(logits_bv, tok_b, TEMPERATURE)


CONTENDERS = {
    "blocked (sample_rows)": jax.jit(lambda l, k, n: draw.sample_rows(l, k, n, TEMPERATURE, 1.0, 0)),
    "jax.random.categorical": jax.jit(full_vocab_rows),
}


def ms(fn, *args, reps: int = 10) -> float:
    jax.block_until_ready(fn(*args))
    t = time.perf_counter()
    for _ in range(reps):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / reps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=5)
    ap.add_argument("--write", action="store_true", help="replace the section in docs/benchmarks.md")
    ap.add_argument("--smoke", action="store_true", help="one tiny shape: seconds")
    args = ap.parse_args()
    rows = []
    for b, v in [(2, 256)] if args.smoke else SHAPES:
        logits = jnp.asarray(np.random.default_rng(0).standard_normal((b, v), np.float32) * 3)
        keys = jax.random.key_data(jax.random.split(jax.random.key(0), b))
        n_gen = jnp.zeros(b, jnp.int32)
        times = {name: [] for name in CONTENDERS}
        for _ in range(args.samples):
            for name, fn in CONTENDERS.items():
                times[name].append(ms(fn, logits, keys, n_gen))
        rows.append((b, v, times))
        print(b, v, {name: round(statistics.median(t), 1) for name, t in times.items()}, flush=True)
    names = list(CONTENDERS)
    lines = ["## Token draw (XLA CPU)", "",
             f"`python bench/draw.py --samples {args.samples}` on {time.strftime('%Y-%m-%d %H:%M')}, {machine()}, "
             f"jax {jax.__version__}; load average {__import__('os').getloadavg()[0]:.1f} at the end. ms per "
             f"call (one token and its logprob per row, T = {TEMPERATURE}), median (range) over {args.samples} "
             "samples of 10 calls, the contenders alternated; compile excluded. Both draw exactly from the "
             "tempered softmax (tests/test_sampling.py checks the blocked draw's frequencies).", "",
             f"| rows × vocabulary | {names[0]} | {names[1]} | ratio |", "|---|---|---|---|"]
    for b, v, times in rows:
        med = {name: statistics.median(t) for name, t in times.items()}
        cell = lambda name: f"{med[name]:.1f} ({min(times[name]):.1f}–{max(times[name]):.1f})"  # noqa: E731
        lines.append(f"| {b} × {v:,} | {cell(names[0])} | {cell(names[1])} | {med[names[1]] / med[names[0]]:.1f}× |")
    publish("\n".join(lines + [""]), args.write)


if __name__ == "__main__":
    main()
