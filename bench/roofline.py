"""The machine's measured roof for the benchmarks and for `marljax.matrix`'s `cpu` accelerator: XLA float32
matmul GFLOP/s, memory GB/s (a jitted elementwise pass over a 256 MiB float32 array: one read and one
write per element) and the memory size.

    python bench/roofline.py [--samples 10] [--write]     # the "## CPU roof" section of docs/benchmarks.md

The machine drifts (others share it), so it samples each rate `--samples` times, 1 s apart, and reports
median and range.
"""
import argparse
import os
import statistics
import time

from benchdoc import machine, publish  # first (before jax); bench/ is on sys.path when a script here runs
import jax
import jax.numpy as jnp

_square = jax.jit(lambda x: x @ x)
_scale = jax.jit(lambda x: x * 2.0)


def matmul_gflops(n: int = 1024, reps: int = 10) -> float:
    a = jnp.ones((n, n), jnp.float32)
    _square(a).block_until_ready()
    t = time.perf_counter()
    for _ in range(reps):
        _square(a).block_until_ready()
    return 2 * n ** 3 * reps / (time.perf_counter() - t) / 1e9


def memory_gbs(mib: int = 256, reps: int = 10) -> float:
    """Bytes read + written per second by an elementwise pass over a `mib` MiB float32 array."""
    a = jnp.ones((mib * 2 ** 20 // 4,), jnp.float32)
    _scale(a).block_until_ready()
    t = time.perf_counter()
    for _ in range(reps):
        _scale(a).block_until_ready()
    return 2 * a.nbytes * reps / (time.perf_counter() - t) / 1e9


def memory_gb() -> float:
    """MemTotal of /proc/meminfo, in GB."""
    kib = next(int(line.split()[1]) for line in open("/proc/meminfo") if line.startswith("MemTotal:"))
    return kib * 1024 / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=10)
    ap.add_argument("--write", action="store_true", help="replace the section in docs/benchmarks.md")
    args = ap.parse_args()
    flops, bandwidth = [], []
    for _ in range(args.samples):
        time.sleep(1)
        flops.append(matmul_gflops())
        time.sleep(1)
        bandwidth.append(memory_gbs())
    fmt = lambda xs: f"median **{statistics.median(xs):.0f}**, range {min(xs):.0f}–{max(xs):.0f}"  # noqa: E731
    publish("\n".join([
        "## CPU roof", "",
        f"`python bench/roofline.py --samples {args.samples}` on {time.strftime('%Y-%m-%d %H:%M')}, {machine()}, "
        f"jax {jax.__version__}; {args.samples} samples each, 1 s apart, on a machine others share (load average "
        f"{os.getloadavg()[0]:.1f} at the end).", "",
        f"- XLA float32 matmul (1024², 10 calls per sample): {fmt(flops)} GFLOP/s",
        f"- memory (elementwise pass over 256 MiB float32, read + write): {fmt(bandwidth)} GB/s",
        f"- memory size: {memory_gb():.1f} GB", "",
        "`marljax/matrix.py`'s `cpu` accelerator takes the medians and the memory size.", ""]), args.write)


if __name__ == "__main__":
    main()
