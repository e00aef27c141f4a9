"""The KV page pool: fixed-size pages of keys and values for every layer, and the host-side allocator.

A sequence's KV lives in pages of `page_size` positions; its page table lists them in order, so position
p is at offset p % page_size of page table[p // page_size]. Page 0 is the null page: never handed out,
it absorbs the writes of padded rows and positions (page tables are filled with 0 past a sequence's
pages) and is never read for a real position. Pages are refcounted: a prompt's full pages can be shared
by every sequence that continues that prompt (`marljax.sampling.engine.scheduler`).

Device layout, per layer: {"kv": [ranks, pages, page_size, 2·kv_heads, head_dim]}, keys at the even and
values at the odd combined heads: the layout of the TPU's ragged paged-attention kernel, which the gather
path reads too (`marljax.sampling.engine.paged_attention`); a gather of a page table [B, W] reads
[B, W·page_size, 2·kv_heads, head_dim] with no transpose of the pool. `ranks` pools of `pages` pages
each: a data-parallel engine on a mesh keeps one pool per batch rank (split over the mesh like the
rows; rows are split evenly over the ranks in order and their page tables index their rank's pool, so
each chip holds only its own rows' pages; the host scheduler keeps one `PagePool` per rank,
`marljax.sampling.engine.scheduler`); with one rank it is replicated over the batch ranks.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from marljax.core import sharding
from marljax.models.decoder import ModelConfig
from marljax.models.precision import set_at

NULL_PAGE = 0
POOL_AXES = ("batch", None, None, "act_kv_heads", "head_dim")  # a layer's pool, by logical axis


def init_pages(config: ModelConfig, num_pages: int, page_size: int, dtype=None, ranks: int = 1) -> list[dict]:
    """Zeroed page pool for every layer (see the module docstring for the layout); inside
    `sharding.use_mesh` split like the rows (`POOL_AXES`: each rank's pool on its batch shard)."""
    dt = dtype or config.jnp_dtype
    shape = pool_shape(config, num_pages, page_size, ranks)
    return [{"kv": sharding.constrain(jnp.zeros(shape, dt), POOL_AXES)} for _ in range(config.num_layers)]


def pool_shape(config: ModelConfig, num_pages: int, page_size: int, ranks: int = 1) -> tuple[int, ...]:
    """One layer's pool: [ranks, pages, page_size, 2·kv_heads, head_dim]."""
    return (ranks, num_pages, page_size, 2 * config.num_kv_heads, config.head_dim)


def pool_pages(pages: list[dict]) -> int:
    """Pages in each rank's pool (the null page included)."""
    return pages[0]["kv"].shape[1]


def page_bytes(config: ModelConfig, page_size: int, dtype=None) -> int:
    """Bytes of one page across all layers, keys and values."""
    itemsize = jnp.dtype(dtype or config.jnp_dtype).itemsize
    return 2 * config.num_layers * page_size * config.num_kv_heads * config.head_dim * itemsize


def pages_for(positions: int, page_size: int) -> int:
    """Pages that hold positions 0 … positions − 1."""
    return -(-positions // page_size)


def per_rank(fn, pool_amijd, *rows, merge: bool = True):
    """`fn(pool [N, …], *row_args)` for each rank pool and its rows, vmapped over the R ranks: every leaf of
    `rows` splits its leading axis into R equal blocks (block r goes with pool r); with `merge` the
    outputs' leading axes [R, n] are merged back into one. A gather or scatter with the rank as a batch
    dimension: on a mesh whose batch shards hold their own pools and rows, XLA partitions it with no
    communication, where one over the flat page axis (global page ids) is replicated on every chip."""
    R = pool_amijd.shape[0]

    def split(x):
        if x.shape[0] % R:
            raise ValueError(f"{x.shape[0]} rows cannot be split evenly over {R} rank pools.")
        return x.reshape(R, x.shape[0] // R, *x.shape[1:])

    out = jax.vmap(fn)(pool_amijd, *jax.tree.map(split, rows))
    return jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), out) if merge else out


@functools.partial(jax.jit, donate_argnums=0)
def copy_pages(pages: list[dict], src, dst) -> list[dict]:
    """Copy page src[i] onto page dst[i] in every layer, src and dst [R·n] in R blocks of n, block r
    naming pages of pool r (`per_rank`; pad with null-page-onto-itself copies). In place: the pool is
    donated."""
    def copy(pages_mijd, src, dst):
        return set_at(pages_mijd, dst, pages_mijd[src])
    return [{name: per_rank(copy, a, src, dst, merge=False) for name, a in layer.items()} for layer in pages]


@functools.partial(jax.jit, static_argnums=1)
def grow_pages(pages: list[dict], extra: int) -> list[dict]:
    """The pool with `extra` zeroed pages appended to each rank's pool (page ids are kept)."""
    return [{name: jnp.concatenate([a, jnp.zeros(a.shape[:1] + (extra,) + a.shape[2:], a.dtype)], axis=1)
             for name, a in layer.items()} for layer in pages]


class PagePool:
    """Host-side allocator over pages 1 … num_pages − 1 with reference counts; tracks the peak in use."""

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"num_pages={num_pages}: the pool needs the null page and at least one more.")
        self.num_pages = num_pages
        self.refs = [0] * num_pages
        self.free_list = list(range(num_pages - 1, NULL_PAGE, -1))  # pops the lowest page first
        self.peak_in_use = 0

    @property
    def free(self) -> int:
        return len(self.free_list)

    @property
    def in_use(self) -> int:
        return self.num_pages - 1 - len(self.free_list)

    def grow(self, num_pages: int) -> None:
        """Pages num_pages_before … num_pages − 1 become free (handed out after the free ones)."""
        self.free_list = list(range(num_pages - 1, self.num_pages - 1, -1)) + self.free_list
        self.refs += [0] * (num_pages - self.num_pages)
        self.num_pages = num_pages

    def alloc(self, n: int) -> list[int]:
        """n fresh pages (reference count 1); RuntimeError when fewer are free (the scheduler reserves
        pages before it admits a sequence, so this is a bug, not a full pool)."""
        if n > len(self.free_list):
            raise RuntimeError(f"page pool exhausted: {n} pages asked, {len(self.free_list)} free.")
        out = [self.free_list.pop() for _ in range(n)]
        for p in out:
            self.refs[p] = 1
        self.peak_in_use = max(self.peak_in_use, self.in_use)
        return out

    def retain(self, pages: list[int]) -> None:
        """One more reference to each page (a sequence sharing them)."""
        for p in pages:
            if self.refs[p] <= 0:
                raise RuntimeError(f"retain of page {p}, which is not allocated.")
            self.refs[p] += 1

    def release(self, pages: list[int]) -> None:
        """Drop one reference to each page; a page with none left returns to the free list."""
        for p in pages:
            if self.refs[p] <= 0:
                raise RuntimeError(f"release of page {p}, which is not allocated.")
            self.refs[p] -= 1
            if self.refs[p] == 0:
                self.free_list.append(p)
