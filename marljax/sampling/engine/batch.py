"""The engine's batches and loop state as pytrees (frozen dataclasses): one prefill call's rows
(`PrefillBatch`, `engine.prefill_program`), what the scheduler hands the engine for a decode chunk
(`DecodeBatch`, `Scheduler.batch`) and what the jitted decode chunk carries from step to step and hands
back to the scheduler (`DecodeState`, `engine.decode_chunk`, `Scheduler.advance`).
Suffixes: the legend in marljax/models/decoder.py (rows b, a chunk's steps c, page tables bw).
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from marljax.core.shapes import bucket
from marljax.sampling.engine.kv_pages import NULL_PAGE


@struct.dataclass
class PrefillBatch:
    """One prefill call's rows (`Engine.prefill`: a chunk of positions of each prompt), in rank blocks;
    idle rows hold zeros and the null page.

    tokens_bt  int32 [B, T]: the prompt tokens of this chunk, right-padded
    start_b    int32 [B]: the position of each row's first token (after a cached prefix, earlier chunks)
    table_bw   int32 [B, W]: each row's page table (pool-local page ids, null-padded)
    last_b     int32 [B]: the index in the chunk of the row's last prompt token (its hidden state is kept)
    """

    tokens_bt: Any
    start_b: Any
    table_bw: Any
    last_b: Any


@struct.dataclass
class DecodeBatch:
    """The running sequences as one decode chunk's rows, in rank blocks (`Scheduler.batch`); the rest of
    the rows are idle. Host arrays (numpy).

    table_bw     int32 [B, W]: each row's page table (pool-local page ids, null-padded)
    token_b      int32 [B]: the next input token (the last one generated)
    pos_b        int32 [B]: the position that token is written at
    n_gen_b      int32 [B]: tokens generated so far
    live_b       bool [B]: the row holds a running sequence
    request_b    int32 [B]: the row's request id (its RNG stream)
    held_b       int32 [B]: pages the row's sequence holds
    lora_groups  int32 [R·G]: the rows of each (rank, parameter set) (`batch.block_groups`), what
                 `Decoder.hidden`'s `lora_groups` reads
    """

    table_bw: Any
    token_b: Any
    pos_b: Any
    n_gen_b: Any
    live_b: Any
    request_b: Any
    held_b: Any
    lora_groups: Any

    @property
    def rows(self) -> int:
        return len(self.token_b)


@struct.dataclass
class DecodeState:
    """The decode chunk's loop state (`engine.decode_chunk`), and its result once the loop ends (then `kv`
    is None: the pages and dense caches are returned beside it).

    step     int32 []: decode steps run in this chunk
    kv       the chunk's key/value buffers (the chunk attention paths) or the page pool (the others)
    token_b  int32 [B]: the next input token (the last one drawn)
    pos_b    int32 [B]: the position it is written at
    n_gen_b  int32 [B]: tokens generated so far
    hit_b    bool [B]: the row drew a stop token
    done_b   bool [B]: the row is done (a stop token, max_new tokens, or idle)
    tok_bc   int32 [B, C]: the tokens drawn at each step of the chunk (0 where done)
    logp_bc  float32 [B, C]: their logprobs (0 where done)
    """

    step: Any
    kv: Any
    token_b: Any
    pos_b: Any
    n_gen_b: Any
    hit_b: Any
    done_b: Any
    tok_bc: Any
    logp_bc: Any

    @classmethod
    def start(cls, batch: DecodeBatch, kv, steps: int) -> DecodeState:
        """Before a chunk's first step (inside the jitted chunk): the batch's rows, idle rows done."""
        B = batch.token_b.shape[0]
        return cls(step=jnp.int32(0), kv=kv, token_b=batch.token_b, pos_b=batch.pos_b, n_gen_b=batch.n_gen_b,
                   hit_b=jnp.zeros(B, bool), done_b=~batch.live_b, tok_bc=jnp.zeros((B, steps), jnp.int32),
                   logp_bc=jnp.zeros((B, steps), jnp.float32))


def rank_rows(ranks: list[int], num_ranks: int, cap: int | None = None) -> tuple[list[int], int]:
    """Rows in rank blocks for items of ranks `ranks` (in the order they fill their block): each item's
    row, and the rows per rank (the busiest rank's items rounded up to a power of two, at most `cap`);
    block r is rows [r·per_rank, (r + 1)·per_rank), what `kv_pages.per_rank` pairs with pool r."""
    per_rank = bucket(max(np.bincount(ranks, minlength=num_ranks)))
    per_rank = per_rank if cap is None else min(per_rank, cap)
    rows, used = [], [0] * num_ranks
    for k in ranks:
        rows.append(k * per_rank + used[k])
        used[k] += 1
    return rows, per_rank


def stable_rows(ranks: list[int], previous: list[int | None], per_rank: int) -> list[int]:
    """Rows in rank blocks of `per_rank` that keep each item where it was: its `previous` row where that
    is still in its rank's block, else the lowest row of its block that no item keeps."""
    rows = [p if p is not None and k * per_rank <= p < (k + 1) * per_rank else None
            for k, p in zip(ranks, previous)]
    taken = set(rows)
    free = {k: (r for r in range(k * per_rank, (k + 1) * per_rank) if r not in taken) for k in set(ranks)}
    return [r if r is not None else next(free[k]) for r, k in zip(rows, ranks)]


def block_groups(rank_set: list[tuple[int, int]], num_ranks: int, per_rank: int, num_sets: int) -> np.ndarray:
    """Per-row adapter groups for rows in rank blocks (`rank_rows`), each block's rows sorted by set:
    int32 [R·G], the rows of (rank r, set g) at r·G + g (adapters stacked R times over, rank-major), so
    every group is contiguous. A block's idle rows join its last set's group (their outputs are unread),
    but the last block's, which stay past the groups' sum (no adapter)."""
    groups = np.zeros(num_ranks * num_sets, np.int32)
    for r, g in rank_set:
        groups[r * num_sets + g] += 1
    for r in range(num_ranks - 1):
        groups[r * num_sets + num_sets - 1] += per_rank - groups[r * num_sets: (r + 1) * num_sets].sum()
    return groups


class BatchLayout:
    """Where the running sequences sit in a decode chunk's rows: R rank blocks of as many rows as the
    busiest rank runs (rounded up to a power of two, at most its `rank_slots`), rank r's sequences first
    in block r in `running` order, the rest idle. Rows, not slots: a chunk computes only as many rows as
    are running (rounded up), so the tail of a call runs at a small batch. `stable`: a sequence keeps its
    row while the rows per rank stay (`stable_rows`), so a decode path that keeps per-row state across
    chunks refreshes only the new rows; only without per-row adapters, whose rows go by set."""

    def __init__(self, num_ranks: int, rank_slots: int, num_groups: int, stable: bool):
        self.ranks, self.rank_slots, self.num_groups, self.stable = num_ranks, rank_slots, num_groups, stable
        self.rows: list[tuple[int, int]] = []  # (row, slot) of the last `lay_out`

    def lay_out(self, running: list, rank_of, width: int) -> DecodeBatch:
        """The running sequences ((slot, sequence), `SlotTable.running`; `rank_of`: a slot's rank) as a
        decode chunk's rows, page tables `width` pages wide; each sequence's `row` is set and the row →
        slot map kept (`rows`)."""
        slots = [s for s, _ in running]
        ranks = [rank_of(s) for s in slots]
        at, per_rank = rank_rows(ranks, self.ranks, self.rank_slots)
        if self.stable:
            at = stable_rows(ranks, [q.row for _, q in running], per_rank)
        rows = self.ranks * per_rank
        table_bw = np.full((rows, width), NULL_PAGE, np.int32)
        token_b, pos_b, n_gen_b, request_b, held_b = np.zeros((5, rows), np.int32)
        live_b = np.zeros(rows, bool)
        self.rows = list(zip(at, slots))
        for r, (_, q) in zip(at, running):
            q.row = r
            table_bw[r, : len(q.pages)] = q.pages
            token_b[r], pos_b[r], n_gen_b[r] = q.token, q.pos, q.n_gen
            request_b[r], live_b[r], held_b[r] = q.request, True, len(q.pages)
        groups = block_groups([(k, q.prefix.group) for k, (_, q) in zip(ranks, running)], self.ranks, per_rank,
                              self.num_groups)
        return DecodeBatch(table_bw=table_bw, token_b=token_b, pos_b=pos_b, n_gen_b=n_gen_b, live_b=live_b,
                           request_b=request_b, held_b=held_b, lora_groups=groups)


def to_host(state: DecodeState) -> DecodeState:
    """A finished chunk's state as numpy arrays (what `Scheduler.advance` reads)."""
    return jax.tree.map(np.asarray, state)
