"""Attention over KV pages, and the cache hook the decoder calls: a gather path in pure JAX, a dense copy
per decode chunk (CPU) and the TPU's ragged paged-attention kernel, chosen by backend.

`paged_cache_attention(page_table_bw, impl)` is the decoder's `cache_attention` for one forward pass:
each layer writes its T new keys and values at their positions through the page table, then every query
attends the keys at positions ≤ its own. `impl` (`PAGED_ATTENTIONS`):
  gather  reads each row's W pages with a gather ([B, W·page_size] keys) and runs the decoder's softmax
          (`marljax.models.attention.attention`, float32), so a paged row equals a dense-cache row; the
          page-table width W is what the engine buckets per call, so attention reads the pages of the
          sequences in flight (their longest one, rounded up), not a padded maximum length
  kernel  `jax.experimental.pallas.ops.tpu.ragged_paged_attention`: the Mosaic kernel reads the pages
          of each row up to its own length straight from HBM (online softmax, float32); compiled for a
          TPU (also ahead of time for a TPU topology, `marljax.aot`), in Pallas' TPU interpreter on any
          other backend (see `KERNEL_MODES`). It takes each row's T queries as its last T positions
          (the engine's prefill rows start at 0, its decode rows hold one query): `kernel_cache_attention`
  chunk   decode only (`marljax.sampling.engine.engine.decode_chunk`; prefill takes the gather path): the rows'
          pages are gathered into dense caches (`dense_cache`, the layout `models.attention.attention`
          reads in place), which stay read-only through the chunk: each step writes its keys and values
          into a buffer of the chunk's `steps` columns and attends the dense cache and the buffer as two
          segments (`chunk_cache_attention`); at the end the buffer's writes go into the pages and the
          dense caches (`chunk_writes`). The caches are kept
          for the next chunk: rows stay put (`batch.stable_rows`) and only the rows that hold a new
          sequence are gathered again (`refresh_dense`), all of them when the rows or the width change.
          `Engine(length_groups=G > 1)` sorts the rows by length into groups (`length_groups`), each
          with its own cache as wide as its longest row and its own buffer. Off by default: on
          the 32 × 8 GSM8K bench it ran 179 tok/s against 214 with one group (2026-12-05; each width
          tuple is a compile, and new tuples compiled during the timed run), docs/benchmarks.md.
          On XLA CPU a gather per step costs more than the attention it feeds (SmolLM2-135M, 64 rows:
          6.8 ms per layer dense, 44 ms gathered; engine throughput 1.7× with chunk, docs/benchmarks.md);
          the price is a dense copy of the rows in flight beside the pool (`EngineStats.peak_dense_bytes`)
  cpu_kernel  the chunk path with each segment's attention (the dense cache up to the row's first
          position of the chunk, the buffer up to the step) through `marljax.sampling.engine.cpu_attention`'s kernel,
          which reads each row's real columns once at memory speed, and the segments combined by their
          log-sum-exps (`chunk_cache_attention(..., kernel=True)`): XLA CPU runs the masked dense form's
          small per-(row, KV head) products far under the memory bandwidth and over the padded width
          (docs/benchmarks.md "CPU decode attention kernel"). On one device only (no mesh of several:
          XLA cannot partition the kernel); built on first use with the host's C++ compiler
  auto    by the backend the code is traced for (`models.attention.target_backend`): the kernel on a
          TPU; on a CPU cpu_kernel on one device, chunk where a mesh spans several devices or the kernel
          cannot be built; gather on a GPU (and any other backend)

Pool layout (`marljax.sampling.engine.kv_pages`), per layer {"kv": [R, pages, page_size, 2·kv_heads, head_dim]}:
R rank pools, keys at the even and values at the odd combined heads (the kernel's layout, which the
gather path reads as well: no conversion per step). Rows are split evenly over the R pools in order (row
b belongs to pool b·R // B) and their page tables index their own pool. On a mesh
(`sharding.use_mesh`) the rows split like the batch and the R pools with them (R = the batch ranks: each
chip holds its rows' pages only, and writes and reads them per shard; R = 1: the pool is replicated and
XLA writes every new key on every chip); heads split over `tensor` when the KV heads divide. The kernel
runs per shard (`jax.shard_map`: XLA cannot partition a Pallas kernel).
Shapes: q [B, T, H, Dh]; k, v [B, T, K, Dh]; pool [R, N, page_size, 2K, Dh]; page_table [B, W] int32
(pool-local page ids); positions [B, T] int32. Suffixes: the legend in marljax/models/decoder.py (a pool
is `pool_amijd`: ranks, pages, positions within a page, combined KV heads, head dimension).
"""
from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np

from marljax.core import sharding
from marljax.core.shapes import page_bucket
from marljax.models.attention import attention, segmented_attention, target_backend
from marljax.models.decoder import ModelConfig
from marljax.models.precision import set_at
from marljax.sampling.engine import cpu_attention
from marljax.sampling.engine.kv_pages import per_rank

PAGED_ATTENTIONS = ("auto", "gather", "chunk", "cpu_kernel", "kernel")
CHUNK_PATHS = ("chunk", "cpu_kernel")  # decode over a dense copy of the rows' pages and a buffer per chunk
# The kernel's block sizes: KV pages and queries per grid step. Its own table of tuned sizes
# (`ragged_paged_attention.tuned_block_sizes`) keys on the device it runs on, which a CPU host compiling
# for a TPU is not; these are that table's entries for 16-position pages at its longest contexts on v5
# and v6 (Qwen3's 32 query / 8 KV heads of 128). Its untuned default, 128 pages, overflows v5e's scoped
# VMEM for 16 combined KV heads (measured: CompileTimeScopedVmemOom).
KERNEL_KV_PAGES, KERNEL_QUERIES = 16, 32
# How the kernel runs: compiled by Mosaic (TPU), in Pallas' TPU interpreter (any backend; jax 0.10.2's
# interpreter cannot run this kernel yet: it reads a reshaped VMEM ref, `tests/test_engine.py` pins
# that), or as the kernel module's own pure-JAX reference on the same arguments (checks the arguments
# and the layout on CPU).
KERNEL_MODES = ("mosaic", "interpret", "reference")


def resolve_paged_attention(name: str, backend: str | None = None) -> str:
    """The path `name` runs as on `backend` (default: the backend being traced for)."""
    if name not in PAGED_ATTENTIONS:
        raise ValueError(f"paged attention {name!r}; choose from {PAGED_ATTENTIONS} (auto: the kernel on a "
                         "TPU, cpu_kernel on a CPU, gather on a GPU).")
    several = jax.sharding.get_abstract_mesh().size > 1
    backend = backend or target_backend()
    if name == "cpu_kernel" and (several or backend != "cpu"):
        raise ValueError(f"paged attention 'cpu_kernel' runs on one CPU device (a C++ handler XLA cannot "
                         f"partition), not on {'a mesh of several devices' if several else backend}; use "
                         "'chunk' or 'auto'.")
    if name != "auto":
        return name
    if backend == "cpu":
        return "chunk" if several or cpu_attention.unavailable() else "cpu_kernel"
    return {"tpu": "kernel"}.get(backend, "gather")


def interleave(k_btkd, v_btkd):
    """[B, T, 2K, Dh]: keys at the even and values at the odd heads (the pool's layout)."""
    B, T, K, Dh = k_btkd.shape
    return jnp.stack([k_btkd, v_btkd.astype(k_btkd.dtype)], axis=3).reshape(B, T, 2 * K, Dh)


def flat_pages(pool_amijd, page_table_bw):
    """The pool as one page axis [R·N, page_size, 2K, Dh] and the rows' page ids in it [B, W]: for a
    kernel that takes one page axis (run per shard, `per_shard`, where it holds its own pools only)."""
    R, N = pool_amijd.shape[:2]
    B = page_table_bw.shape[0]
    return pool_amijd.reshape(R * N, *pool_amijd.shape[2:]), page_table_bw + rank_base(jnp.arange(B), B, R, N)[:, None]


def rank_base(rows, B: int, R: int, N: int):
    """Where rows' rank pools start in the flat page axis of R pools of N pages (row b of B is pool b·R // B's)."""
    return jnp.asarray(rows, jnp.int32) * R // B * N


def write_pages(pool_amijd, new_btjd, page_table_bw, positions_bt):
    """`pool` with new_btjd[b, t] written at position positions_bt[b, t] of row b's pages (per rank)."""
    def write(pages_mijd, new_btjd, table_bw, positions_bt):
        page_size = pages_mijd.shape[1]
        page_bt = jnp.take_along_axis(table_bw, positions_bt // page_size, axis=1)
        return set_at(pages_mijd, (page_bt, positions_bt % page_size), new_btjd)
    return per_rank(write, pool_amijd, new_btjd, page_table_bw, positions_bt, merge=False)


# ---- the chunk path's dense caches: per layer {"k": [B, K, Dh, S], "v": [B, K, S, Dh]}, the forms
# `marljax.models.attention.attention` reads in place; column = position, as in the pages
def dense_cache(pool_amijd, page_table_bw):
    """Rows' pages as one dense cache of W·page_size columns."""
    return per_rank(_dense, pool_amijd, page_table_bw)


def _dense(pages_mijd, table_bw):
    B, W = table_bw.shape
    page_size, J, Dh = pages_mijd.shape[1:]
    kv_bsjd = pages_mijd[table_bw].reshape(B, W * page_size, J, Dh)
    return {"k": kv_bsjd[:, :, 0::2].transpose(0, 2, 3, 1), "v": kv_bsjd[:, :, 1::2].transpose(0, 2, 1, 3)}


def init_dense(config: ModelConfig, rows: int, columns: int, dtype) -> list[dict]:
    """Zeroed dense caches of `rows` rows and `columns` columns for every layer (a decode chunk's buffers of
    its new keys and values, `chunk_cache_attention`); sharded on a mesh."""
    B, K, Dh, S = rows, config.num_kv_heads, config.head_dim, columns
    return [{"k": sharding.constrain(jnp.zeros((B, K, Dh, S), dtype), ("batch", "act_kv_heads", "head_dim", "length")),
             "v": sharding.constrain(jnp.zeros((B, K, S, Dh), dtype), ("batch", "act_kv_heads", "length", "head_dim"))}
            for _ in range(config.num_layers)]


def write_dense(kv, k_btkd, v_btkd, positions_bt):
    """The dense cache `kv` with row b's new keys and values at its columns positions_bt[b] (a scatter, in
    place under jit)."""
    rows_bt = jnp.broadcast_to(jnp.arange(positions_bt.shape[0])[:, None], positions_bt.shape)
    return {"k": set_at(kv["k"], (rows_bt, slice(None), slice(None), positions_bt), k_btkd),
            "v": set_at(kv["v"], (rows_bt, slice(None), positions_bt), v_btkd)}


@jax.jit
def gather_dense(pages, page_table_bw):
    """`dense_cache` of every layer's pool: the chunk path's per-layer caches of a decode chunk's rows."""
    return [dense_cache(layer["kv"], page_table_bw) for layer in pages]


@functools.partial(jax.jit, donate_argnums=0)
def refresh_dense(dense, pages, rows_b, table_bw):
    """The chunk path's dense caches of a decode chunk's B rows (R rank blocks; one cache per layer,
    `dense_cache`) with some rows gathered again from their pages: rows_b [R·n] and table_bw [R·n, W]
    in R blocks of n, block r naming rows of rank block r (block-local; ≥ B / R: padding, dropped) and
    their page ids in pool r. A chunk whose other rows hold the sequences they held in the chunk before
    reads what they wrote there. In place (`dense` is donated), per rank (`per_rank`)."""
    def refresh(pages_mijd, old, rows_b, table_bw):
        fresh = _dense(pages_mijd, table_bw)
        return {name: set_at(old[name], rows_b, fresh[name], mode="drop") for name in old}
    return [per_rank(refresh, layer["kv"], old, rows_b, table_bw) for old, layer in zip(dense, pages)]


def chunk_writes(new, first_b, last_b, steps: int):
    """What a decode chunk wrote, from its buffer `new` (`chunk_cache_attention`; column j = the keys and
    values a row wrote at step j): each row's positions first_b … last_b (at most `steps`; the last one
    repeated past them, where a done row kept rewriting it) and their keys and values ([B, steps, K, Dh]).
    A done row's later columns are dropped: they rewrote its last position over a context holding it
    twice, the first write is the one computed as it ran."""
    cols_bt = jnp.minimum(jnp.arange(steps, dtype=jnp.int32)[None], (last_b - first_b)[:, None])
    k_btkd = jnp.take_along_axis(new["k"], cols_bt[:, None, None, :], axis=3).transpose(0, 3, 1, 2)
    v_btkd = jnp.take_along_axis(new["v"], cols_bt[:, None, :, None], axis=2).transpose(0, 2, 1, 3)
    return k_btkd, v_btkd, first_b[:, None] + cols_bt


def chunk_cache_attention(group_rows, first_b, step, kernel: bool = False):
    """The decoder's `cache_attention` hook for step `step` of a decode chunk over each layer's
    {"dense": the groups' dense caches, "new": the groups' buffers}: group g (rows group_rows[g], in order
    when they are a permutation, `length_groups`) writes its rows' new keys and values at column `step`
    of its buffer ({"k": [n, K, Dh, steps], "v": [n, K, steps, Dh]}, `init_dense`) and attends
    its dense cache's columns before each row's first position of the chunk (`first_b`) and the buffer's
    columns ≤ step, as two segments (`segmented_attention`). The dense caches stay read-only during the
    chunk: a step writes B × K × Dh numbers at one column of a small buffer, not a scatter into each
    layer's whole cache, which in bfloat16 XLA CPU ran through a copy of the cache per layer and step
    (the engine's bfloat16 rate 1.30x, float32 0.97x within the noise: docs/benchmarks.md "Rollout
    engine (SmolLM2-135M, GSM8K 8 × 8, CPU)", session 26). `kernel`: the two segments through the CPU
    kernel (`cpu_attention.segmented_decode_attention`, each row's real columns only) instead of XLA's
    masked dense form."""
    inverse_b = None if isinstance(group_rows[0], slice) else jnp.argsort(jnp.concatenate(group_rows))

    def hook(q_bthd, k_btkd, v_btkd, kv, positions_bt):
        outs, written = [], []
        for rows, cache, new in zip(group_rows, kv["dense"], kv["new"]):
            dt = new["k"].dtype
            new = {"k": jax.lax.dynamic_update_slice(new["k"], k_btkd[rows].transpose(0, 2, 3, 1).astype(dt),
                                                     (0, 0, 0, step)),
                   "v": jax.lax.dynamic_update_slice(new["v"], v_btkd[rows].transpose(0, 2, 1, 3).astype(dt),
                                                     (0, 0, step, 0))}
            start_b = first_b[rows]
            n, steps = start_b.shape[0], new["v"].shape[2]
            if kernel:
                upto = jnp.full((n,), step + 1, jnp.int32)
                outs.append(cpu_attention.segmented_decode_attention(
                    q_bthd[rows], [(cache["k"], cache["v"], start_b), (new["k"], new["v"], upto)]))
            else:
                before = jnp.arange(cache["v"].shape[2], dtype=jnp.int32)[None, None, :] < start_b[:, None, None]
                upto = jnp.broadcast_to(jnp.arange(steps, dtype=jnp.int32)[None, None, :] <= step, (n, 1, steps))
                outs.append(segmented_attention(q_bthd[rows], [(cache["k"], cache["v"], before),
                                                               (new["k"], new["v"], upto)]))
            written.append(new)
        out = outs[0] if inverse_b is None else jnp.concatenate(outs)[inverse_b]
        return out, {"dense": kv["dense"], "new": written}
    return hook


# The chunk path's length groups: at most `Engine(length_groups=…)` of them, each at least this many rows
# per rank (smaller groups would add ops per step for little less reading).
LENGTH_GROUP_ROWS = 8


def length_groups(held_b, ranks: int, most: int) -> tuple[np.ndarray, tuple[int, ...]]:
    """A decode chunk's rows (R rank blocks, `scheduler.batch`) in G groups by length: each rank block's
    rows sorted by the pages they hold (`held_b`) and cut into G equal parts, group g taking part g of
    every block, rank-major (so its rows split evenly over the rank pools in order, as `kv_pages.per_rank`
    reads them). G: the largest power of two ≤ `most` that divides a block into parts of at least
    `LENGTH_GROUP_ROWS` rows (else 1: the rows in place). Returns the order (group g's rows are order[g·n:(g+1)·n]) and each
    group's page-table width (`page_bucket` of its rows' most pages)."""
    held_b = np.asarray(held_b)
    per_rank = len(held_b) // ranks
    G = 1
    while 2 * G <= most and per_rank % (2 * G) == 0 and per_rank // (2 * G) >= LENGTH_GROUP_ROWS:
        G *= 2
    if G == 1:  # rows in place: the decoder's own dense attention (`engine.decode_chunk`)
        return np.arange(len(held_b), dtype=np.int32), (page_bucket(max(1, int(held_b.max(initial=0)))),)
    m = per_rank // G
    blocks = [r * per_rank + np.argsort(held_b[r * per_rank: (r + 1) * per_rank], kind="stable") for r in range(ranks)]
    order = np.concatenate([b[g * m: (g + 1) * m] for g in range(G) for b in blocks]).astype(np.int32)
    n = ranks * m
    widths = tuple(page_bucket(max(1, int(held_b[order[g * n: (g + 1) * n]].max()))) for g in range(G))
    return order, widths


def gather_attention(q_bthd, pool_amijd, page_table_bw, positions_bt):
    """Grouped-query attention of each query over its row's keys at positions ≤ its own (gathered, per
    rank: `per_rank`)."""
    return per_rank(lambda pages_mijd, q_bthd, table_bw, positions_bt: _gathered(q_bthd, pages_mijd, table_bw,
                                                                                positions_bt),
                    pool_amijd, q_bthd, page_table_bw, positions_bt)


def _gathered(q_bthd, pages_mijd, table_bw, positions_bt):
    B, W = table_bw.shape
    page_size, J, Dh = pages_mijd.shape[1:]
    S = W * page_size
    kv_bsjd = pages_mijd[table_bw].reshape(B, S, J, Dh)
    k_bkds = kv_bsjd[:, :, 0::2].transpose(0, 2, 3, 1)
    v_bksd = kv_bsjd[:, :, 1::2].transpose(0, 2, 1, 3)
    mask_bts = jnp.arange(S, dtype=jnp.int32)[None, None, :] <= positions_bt[:, :, None]  # column = position
    return attention(q_bthd, k_bkds, v_bksd, mask_bts)


def kernel_cache_attention(q_bthd, new_btjd, pool_amijd, page_table_bw, positions_bt, *, mode: str | None = None):
    """Write the new keys and values into the pool, then the ragged paged-attention kernel over rows
    whose T queries are their last T positions (row b attends its first positions_bt[b, −1] + 1 keys,
    query t the keys up to its own position); per shard on a mesh. `mode`: `KERNEL_MODES` (default:
    mosaic when tracing for a TPU, else interpret). Returns (attention [B, T, H, Dh], the pool)."""
    return per_shard(functools.partial(_kernel, mode=_kernel_mode(mode)), q_bthd, new_btjd, pool_amijd,
                     page_table_bw, positions_bt)


def per_shard(attend, q_bthd, new_btjd, pool_amijd, page_table_bw, positions_bt):
    """Write, then `attend(q, pages [R·N, …], page ids [B, W], positions)` once per shard on a mesh, rows
    split like the batch: (attention, pool). Rank pools (R > 1) must split over the mesh as the rows do:
    each shard writes and reads its own pool. One pool (R = 1) is replicated: XLA writes every new key
    on every chip (a partitioned scatter) before the shards read it."""
    heads = "act_kv_heads"
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and "tensor" in mesh.axis_names and (pool_amijd.shape[3] // 2) % mesh.shape["tensor"]:
        heads = None  # fewer KV heads than tensor ranks: every shard takes all heads
    q_axes = ("batch", "length", None if heads is None else "act_heads", "head_dim")
    pool_axes = ("batch", None, None, heads, "head_dim")
    R, B = pool_amijd.shape[0], q_bthd.shape[0]

    def read(q_bthd, pool_amijd, page_table_bw, positions_bt):
        return attend(q_bthd, *flat_pages(pool_amijd, page_table_bw), positions_bt)

    def write_read(q_bthd, new_btjd, pool_amijd, page_table_bw, positions_bt):
        if pool_amijd.shape[0] * B != R * q_bthd.shape[0]:
            raise ValueError(f"{R} rank pools on a mesh must split like the {B} rows (per shard: "
                             f"{pool_amijd.shape[0]} pools, {q_bthd.shape[0]} rows).")
        pool_amijd = write_pages(pool_amijd, new_btjd, page_table_bw, positions_bt)
        return read(q_bthd, pool_amijd, page_table_bw, positions_bt), pool_amijd

    if R == 1:
        pool_amijd = write_pages(pool_amijd, new_btjd, page_table_bw, positions_bt)
        return sharding.shard_map_logical(
            read, (q_bthd, pool_amijd, page_table_bw, positions_bt),
            (q_axes, pool_axes, ("batch", None), ("batch", "length")), q_axes), pool_amijd
    return sharding.shard_map_logical(
        write_read, (q_bthd, new_btjd, pool_amijd, page_table_bw, positions_bt),
        (q_axes, ("batch", "length", heads, "head_dim"), pool_axes, ("batch", None), ("batch", "length")),
        (q_axes, pool_axes), out_like=(0, 2))


def _kernel_mode(mode: str | None) -> str:
    mode = mode or ("mosaic" if target_backend() == "tpu" else "interpret")
    if mode not in KERNEL_MODES:
        raise ValueError(f"kernel mode {mode!r}; choose from {KERNEL_MODES}.")
    return mode


def _kernel(q_bthd, pages_mijd, page_table_bw, positions_bt, *, mode: str):
    from jax.experimental.pallas import tpu as pltpu
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as ragged

    B, T, H, Dh = q_bthd.shape
    W = page_table_bw.shape[1]
    args = (q_bthd.reshape(B * T, H, Dh), pages_mijd, positions_bt[:, -1] + 1, page_table_bw,
            jnp.arange(B + 1, dtype=jnp.int32) * T, jnp.full((1,), B, jnp.int32))
    if mode == "reference":
        out = ragged.ref_ragged_paged_attention(*args, sm_scale=Dh ** -0.5)
    else:
        call = functools.partial(ragged.ragged_paged_attention, *args, sm_scale=Dh ** -0.5,
                                 num_kv_pages_per_block=min(W, KERNEL_KV_PAGES),
                                 num_queries_per_block=min(B * T, KERNEL_QUERIES))
        with pltpu.force_tpu_interpret_mode() if mode == "interpret" else contextlib.nullcontext():
            out = call()
    return out.reshape(B, T, H, Dh)


def paged_cache_attention(page_table_bw, impl: str = "auto"):
    """The decoder's `cache_attention` hook over one layer's pool {"kv"} (see the module docstring; chunk
    reads through gather here)."""
    impl = resolve_paged_attention(impl)

    def hook(q_bthd, k_btkd, v_btkd, kv, positions_bt):
        new_btjd = interleave(k_btkd, v_btkd)
        if impl == "kernel":
            attn, pool = kernel_cache_attention(q_bthd, new_btjd, kv["kv"], page_table_bw, positions_bt)
        else:
            pool = write_pages(kv["kv"], new_btjd, page_table_bw, positions_bt)
            attn = gather_attention(q_bthd, pool, page_table_bw, positions_bt)
        return attn, {"kv": pool}
    return hook
