"""Attention over KV pages (gather-based, pure JAX: the CPU path) and the cache hook the decoder calls.

`paged_cache_attention(page_table_bw)` is the decoder's `cache_attention` for one forward pass: each
layer writes its T new keys and values at their positions through the page table, then every query
attends the keys at positions ≤ its own, read by gathering the row's W pages ([B, W·page_size] keys).
The page-table width W is what the engine buckets per call, so attention reads the pages of the
sequences in flight (their longest one, rounded up), not a padded maximum length. The softmax is the
decoder's (`marljax.models.attention.attention`, float32), so a paged row equals a dense-cache row.
Shapes: q [B, T, H, Dh]; k, v [B, T, K, Dh]; pages [N, page_size, K, Dh]; page_table [B, W] int32;
positions [B, T] int32.
"""
from __future__ import annotations

import jax.numpy as jnp

from marljax.models.attention import attention


def write_pages(pages_npkd, new_btkd, page_table_bw, positions_bt):
    """`pages` with new_btkd[b, t] written at position positions_bt[b, t] of row b's pages."""
    page_size = pages_npkd.shape[1]
    page_bt = jnp.take_along_axis(page_table_bw, positions_bt // page_size, axis=1)
    return pages_npkd.at[page_bt, positions_bt % page_size].set(new_btkd.astype(pages_npkd.dtype))


def paged_attention(q_bthd, k_pages, v_pages, page_table_bw, positions_bt):
    """Grouped-query attention of each query over its row's keys at positions ≤ its own."""
    B, W = page_table_bw.shape
    page_size, K, Dh = k_pages.shape[1:]
    S = W * page_size
    k_bskd = k_pages[page_table_bw].reshape(B, S, K, Dh)
    v_bskd = v_pages[page_table_bw].reshape(B, S, K, Dh)
    mask_bts = jnp.arange(S, dtype=jnp.int32)[None, None, :] <= positions_bt[:, :, None]
    return attention(q_bthd, k_bskd.transpose(0, 2, 1, 3), v_bskd.transpose(0, 2, 3, 1), mask_bts, "cache")


def paged_cache_attention(page_table_bw):
    """The decoder's `cache_attention` hook over one layer's pages {"k", "v"} (see module docstring)."""
    def hook(q_bthd, k_btkd, v_btkd, kv, positions_bt):
        kv = {"k": write_pages(kv["k"], k_btkd, page_table_bw, positions_bt),
              "v": write_pages(kv["v"], v_btkd, page_table_bw, positions_bt)}
        return paged_attention(q_bthd, kv["k"], kv["v"], page_table_bw, positions_bt), kv
    return hook
