"""Decode slots and page pools, one pool per data-parallel rank (`marljax.sampling.engine.scheduler`): which
sequence holds each slot, the pages it holds, what the running sequences may still take (the reservation
admission counts), fresh pages (evicting unused cached prompt pages when a pool's free list is short),
and freeing a finished or preempted sequence's slot and pages.

Slot s belongs to rank s // (slots / R), and a sequence's pages all come from its slot's rank's pool.
"""
from __future__ import annotations

import dataclasses

from marljax.sampling.engine.kv_pages import PagePool, pages_for
from marljax.sampling.engine.prefix_cache import PrefixCache


@dataclasses.dataclass
class Prefix:
    """A prompt prefilled once into one rank's pool: its pages (one reference held here until the prompt's
    last waiting request is admitted)."""

    prompt: tuple[int, ...]
    group: int  # the parameter set its KV was computed with
    rank: int  # the pool its pages are in
    full_pages: list[int]
    partial_page: int | None
    cached: int = 0  # leading full pages found in the prefix cache (their tokens are not prefilled)
    hidden: object = None  # the prompt's last hidden state [D] (a device array), set after its prefill


@dataclasses.dataclass
class Sequence:
    """One request in a decode slot."""

    request: int
    prefix: Prefix
    pages: list[int]  # the page table: the prefix's full pages, then this sequence's own pages
    limit: int  # positions it may write: prompt + max_new − 1
    token: int = 0  # the next input token (the last one generated)
    pos: int = 0  # the position that token is written at
    n_gen: int = 0
    done: bool = False
    row: int | None = None  # its row in the last decode chunk (`batch.BatchLayout`)

    @property
    def own_pages(self) -> list[int]:
        return self.pages[len(self.prefix.full_pages):]


class SlotTable:
    """See the module docstring. `pools`: one `PagePool` per rank, of equal size; `num_slots` a multiple of
    their number. `caches`: one `PrefixCache` per rank, or None (nothing cached). `optimistic`: the
    running sequences reserve the pages of their next `lookahead` decode steps, else their worst case."""

    def __init__(self, pools: list[PagePool], num_slots: int, page_size: int, max_new: int,
                 caches: list[PrefixCache] | None, optimistic: bool, lookahead: int):
        self.pools, self.page_size, self.max_new = pools, page_size, max_new
        self.ranks, self.rank_slots = len(pools), num_slots // len(pools)
        self.caches, self.optimistic, self.lookahead = caches, optimistic, lookahead
        self.slots: list[Sequence | None] = [None] * num_slots

    def rank_of(self, slot: int) -> int:
        return slot // self.rank_slots

    def free_slots(self, rank: int) -> list[int]:
        return [s for s in range(rank * self.rank_slots, (rank + 1) * self.rank_slots) if self.slots[s] is None]

    @property
    def running(self) -> list[tuple[int, Sequence]]:
        """(slot, sequence) of the running sequences by rank, then by parameter set (per-row adapters need
        rows sorted by set), then by slot."""
        return sorted(((s, q) for s, q in enumerate(self.slots) if q is not None),
                      key=lambda x: (self.rank_of(x[0]), x[1].prefix.group))

    def on_rank(self, rank: int) -> list[tuple[int, Sequence]]:
        """(slot, sequence) of `rank`'s running sequences, by slot."""
        return [(s, q) for s, q in enumerate(self.slots) if q is not None and self.rank_of(s) == rank]

    # ---- pages a request needs -------------------------------------------------------------------
    def prefix_pages(self, prompt_len: int) -> int:
        return pages_for(prompt_len, self.page_size)

    def own_worst(self, prompt_len: int) -> int:
        """Own pages a request may hold at most: those its continuation writes past its prompt's full pages."""
        return pages_for(prompt_len + self.max_new - 1, self.page_size) - prompt_len // self.page_size

    def worst_pages(self, prompt_len: int) -> int:
        """Pages one request with a prompt of `prompt_len` tokens may hold at most, sharing nothing."""
        return self.prefix_pages(prompt_len) + self.own_worst(prompt_len)

    def own_need(self, prompt_len: int) -> int:
        """Own pages a request of this prompt length needs to be admitted (`scheduler`'s docstring)."""
        if not self.optimistic:
            return self.own_worst(prompt_len)
        last = min(prompt_len + self.lookahead, prompt_len + self.max_new - 1)  # positions it writes, + 1
        return pages_for(last, self.page_size) - prompt_len // self.page_size

    def short(self, q: Sequence, steps: int) -> int:
        """Pages sequence q lacks for its next `steps` decode steps."""
        return max(0, (min(q.pos + steps, q.limit) - 1) // self.page_size + 1 - len(q.pages))

    def reserved(self, rank: int) -> int:
        """Pages `rank`'s running sequences may still take (optimistic: in their next chunk)."""
        return sum(self.short(q, self.lookahead) if self.optimistic else
                   self.own_worst(len(q.prefix.prompt)) - len(q.own_pages) for _, q in self.on_rank(rank))

    # ---- pages ------------------------------------------------------------------------------------
    def evictable(self, rank: int) -> int:
        """Cached prompt pages of `rank`'s pool that no request uses (what eviction can free)."""
        return self.caches[rank].evictable() if self.caches else 0

    def alloc(self, rank: int, n: int) -> list[int]:
        """n fresh pages of `rank`'s pool, evicting cached prompt pages no request uses when its free list
        is short."""
        pool = self.pools[rank]
        if n > pool.free and self.caches:
            self.caches[rank].evict(n - pool.free)
        return pool.alloc(n)

    def cache(self, prefixes: list[Prefix]) -> None:
        """The prefixes' pages now hold their prompts' KV: keep their full pages in their rank's cache."""
        if self.caches:
            for p in prefixes:
                self.caches[p.rank].insert(p.group, p.prompt, p.full_pages)

    def grow(self, steps: int) -> int:
        """Give each running sequence the pages its next `steps` decode steps write, from its rank's pool
        (which must hold them); returns the most pages any sequence then holds."""
        widest = 1
        for s, q in self.running:
            short = self.short(q, steps)
            if short > 0:
                q.pages += self.alloc(self.rank_of(s), short)
            widest = max(widest, len(q.pages))
        return widest

    def vacate(self, slot: int) -> Sequence:
        """Free a slot and release its sequence's pages; the sequence."""
        q = self.slots[slot]
        self.pools[self.rank_of(slot)].release(q.pages)
        self.slots[slot] = None
        return q
