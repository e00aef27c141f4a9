"""The machine's measured roof for the benchmarks: XLA float32 matmul GFLOP/s."""
import time

import jax
import jax.numpy as jnp


_square = jax.jit(lambda x: x @ x)


def matmul_gflops(n: int = 1024, reps: int = 10) -> float:
    a = jnp.ones((n, n), jnp.float32)
    _square(a).block_until_ready()
    t = time.perf_counter()
    for _ in range(reps):
        _square(a).block_until_ready()
    return 2 * n ** 3 * reps / (time.perf_counter() - t) / 1e9
