"""Host-side continuous batching: decode slots, admission with page reservation, shared prompt prefixes,
one page pool per data-parallel rank.

The slots are split evenly over R ranks (slot s belongs to rank s // (slots / R)), and each rank has
its own page pool (`PagePool`; on a mesh, the rank's chip holds it): a sequence's pages all come from its
slot's rank. Decode chunks lay the rows out in rank blocks (`batch`), the layout
`marljax.engine.paged_attention` maps to the rank pools. With R = 1 there is one pool.

Requests wait in submission order. Between decode chunks the scheduler frees the slots (and pages) of
finished sequences and admits waiting requests, head of the queue first, into free slots, while their
rank's pool can hold what they need (`ADMISSIONS`):
  worst_case  everything a request may still write (prompt + max_new − 1 positions, less the pages it
              shares), counting what the rank's running sequences may still take: a running sequence
              never finds its pool empty, but a pool must hold every admitted sequence at its longest
  optimistic  the pages of its first decode chunk (`lookahead` steps), counting the next chunk of every
              running sequence (vLLM's policy): the pool holds the tokens in flight. When a chunk's
              pages run short (`grow`), the rank's running sequences of the latest requests are preempted
              until they fit: their pages freed, their tokens dropped, their requests back at the head of
              the queue, to be prefilled and sampled again from the start. A request draws its t-th token
              with its own key (`marljax.engine.engine`), so its restart yields what it would have; the
              earliest request running on a rank is never preempted (unless alone), so every rank progresses
Either way pages are taken one chunk at a time (`grow`): the pages in use are the tokens in flight. The
head request goes to a rank that already holds its prompt's prefix (and can afford its own pages), else to
the rank that can afford prefix and own pages with the most free slots (the lowest such rank on a tie);
when none can, admission stops.

Shared prefixes: requests with an identical prompt (and parameter set) share one `Prefix` per rank,
prefilled once into that rank's pages (the prompt's full pages plus a template of its last, partial
page): a GRPO group spread over two ranks is prefilled twice, once per rank. Every member shares its
rank's full pages (refcounted) and writes its continuation into its own copy of the partial page; the
last member of the prompt to be admitted (over all ranks) takes its rank's template itself, and the
prompt's prefixes on other ranks are retired then (their template pages freed). The prefix keeps the
prompt's last hidden state, from which each member draws its first token with its own key. Prompts also
share pages over time: a prompt's full pages stay in its rank's prefix cache
(`marljax.engine.prefix_cache`) after its requests finish, and a later prompt on that rank that starts
with the same blocks (of the same parameter set) reuses them and is prefilled from there on. With
`share_prefixes=False` every request is its own prefix (one member, no copy) and nothing is cached.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from marljax.engine.kv_pages import NULL_PAGE, PagePool, pages_for
from marljax.engine.prefix_cache import PrefixCache
from marljax.shapes import bucket

ADMISSIONS = ("worst_case", "optimistic")


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
    row: int | None = None  # its row in the last decode chunk (`batch`)

    @property
    def own_pages(self) -> list[int]:
        return self.pages[len(self.prefix.full_pages):]


@dataclasses.dataclass
class Admission:
    """What one admission round asks of the device: prefill `prefill` (new prefixes), copy page
    copy_src[i] onto copy_dst[i] of rank copy_rank[i]'s pool, then draw the first token of each of `members` (slot,
    sequence)."""

    prefill: list[Prefix]
    copy_rank: list[int]
    copy_src: list[int]
    copy_dst: list[int]
    members: list[tuple[int, Sequence]]


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


class Scheduler:
    """See the module docstring. Request ids are the prompts' indices in `submit` order. `pools`: one
    `PagePool` per rank, of equal size; `num_slots` a multiple of their number. `admission`: `ADMISSIONS`;
    `lookahead`: the decode steps of a chunk (what optimistic admission reserves for). `stable`: decode
    rows stay put from chunk to chunk (`batch`); only without per-row adapters, whose rows go by set."""

    def __init__(self, pools: list[PagePool], num_slots: int, page_size: int, max_new: int, share_prefixes: bool,
                 num_groups: int = 1, admission: str = "worst_case", lookahead: int = 1, stable: bool = False):
        self.optimistic, self.lookahead = admission == "optimistic", lookahead  # `Engine` checks `admission`
        self.stable = stable
        self.preemptions = 0  # sequences preempted (optimistic admission)
        self.pools, self.page_size, self.max_new = pools, page_size, max_new
        self.ranks, self.rank_slots = len(pools), num_slots // len(pools)
        self.share = share_prefixes
        self.slots: list[Sequence | None] = [None] * num_slots
        self.waiting: list[int] = []
        self.prompts: list[tuple[int, ...]] = []
        self.groups: list[int] = []  # each request's parameter set (0 … num_groups − 1)
        self.num_groups = num_groups
        self.pending: dict = {}  # key (set and prompt, or request id without sharing) -> its requests waiting
        self.prefixes: dict = {}  # (rank, key) -> Prefix whose pages it still holds (its key is pending)
        self.tokens: list[list[int]] = []
        self.logprobs: list[list[float]] = []
        self.hit: list[bool] = []
        self.prefill_tokens = 0  # prompt tokens prefilled (real, not padding)
        self.finished: list[int] = []  # requests finished since `take_finished`
        self.caches = [PrefixCache(pool, page_size) for pool in pools] if share_prefixes else None
        self.rows: list[tuple[int, int]] = []  # (row, slot) of the last `batch`

    # ---- requests ------------------------------------------------------------------------------
    @property
    def submitted(self) -> int:
        return len(self.prompts)

    def submit(self, prompt: list[int], group: int = 0) -> int:
        """Queue a request of parameter set `group`; its id (submission order)."""
        if not 0 <= group < self.num_groups:
            raise ValueError(f"group {group} is not one of the stream's {self.num_groups} parameter sets.")
        r = len(self.prompts)
        self.waiting.append(r)
        self.prompts.append(tuple(prompt))
        self.groups.append(group)
        self.tokens.append([])
        self.logprobs.append([])
        self.hit.append(False)
        key = self._key(r)
        self.pending[key] = self.pending.get(key, 0) + 1
        return r

    def worst_pages(self, prompt_len: int) -> int:
        """Pages one request with a prompt of `prompt_len` tokens may hold at most, sharing nothing."""
        return self._prefix_pages(prompt_len) + self._own_worst(prompt_len)

    def take_finished(self) -> list[int]:
        """Requests finished since the last call."""
        done, self.finished = self.finished, []
        return done

    def rank_of(self, slot: int) -> int:
        return slot // self.rank_slots

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens found in the prefix caches (not prefilled)."""
        return sum(c.hit_tokens for c in self.caches) if self.caches else 0

    def _key(self, request: int):
        return (self.groups[request], self.prompts[request]) if self.share else request

    def _prefix_pages(self, prompt_len: int) -> int:
        return pages_for(prompt_len, self.page_size)

    def _own_worst(self, prompt_len: int) -> int:
        return pages_for(prompt_len + self.max_new - 1, self.page_size) - prompt_len // self.page_size

    def _own_need(self, prompt_len: int) -> int:
        """Own pages a request of this prompt length needs to be admitted (module docstring)."""
        if not self.optimistic:
            return self._own_worst(prompt_len)
        last = min(prompt_len + self.lookahead, prompt_len + self.max_new - 1)  # positions it writes, + 1
        return pages_for(last, self.page_size) - prompt_len // self.page_size

    def _short(self, q: Sequence, steps: int) -> int:
        """Pages sequence q lacks for its next `steps` decode steps."""
        return max(0, (min(q.pos + steps, q.limit) - 1) // self.page_size + 1 - len(q.pages))

    @property
    def running(self) -> list[tuple[int, Sequence]]:
        """(slot, sequence) of the running sequences by rank, then by parameter set (per-row adapters need
        rows sorted by set), then by slot."""
        return sorted(((s, q) for s, q in enumerate(self.slots) if q is not None),
                      key=lambda x: (self.rank_of(x[0]), x[1].prefix.group))

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def _evictable(self, rank: int) -> int:
        return self.caches[rank].evictable() if self.caches else 0

    def _alloc(self, rank: int, n: int) -> list[int]:
        """n fresh pages of `rank`'s pool, evicting cached prompt pages no request uses when its free list
        is short."""
        pool = self.pools[rank]
        if n > pool.free and self.caches:
            self.caches[rank].evict(n - pool.free)
        return pool.alloc(n)

    def prefilled(self, prefixes: list[Prefix]) -> None:
        """The prefixes' pages now hold their prompts' KV: keep their full pages in their rank's cache."""
        if self.caches:
            for p in prefixes:
                self.caches[p.rank].insert(p.group, p.prompt, p.full_pages)

    def _reserved(self, rank: int) -> int:
        """Pages `rank`'s running sequences may still take (optimistic: in their next chunk)."""
        return sum(self._short(q, self.lookahead) if self.optimistic else
                   self._own_worst(len(q.prefix.prompt)) - len(q.own_pages)
                   for s, q in enumerate(self.slots) if q is not None and self.rank_of(s) == rank)

    def _free_slots(self, rank: int) -> list[int]:
        return [s for s in range(rank * self.rank_slots, (rank + 1) * self.rank_slots) if self.slots[s] is None]

    def demand(self) -> int:
        """Pages one rank's pool needs to admit waiting requests into every free slot now, the most over
        the ranks. Per rank an upper bound: its pages in use, plus what its running sequences may still
        take, plus the worst case of the costliest requests it could be given (as many as its free
        slots, among those the free slots of all ranks can admit; a prompt's first request that has no
        prefix on the rank pays its prefix pages). Exact with one rank."""
        free = [len(self._free_slots(rank)) for rank in range(self.ranks)]
        heads = self.waiting[: sum(free)]
        most = 0
        for rank, pool in enumerate(self.pools):
            costs, fresh = [], set()
            for r in heads:
                key, n = self._key(r), len(self.prompts[r])
                costs.append(self._own_need(n))
                if (rank, key) not in self.prefixes and key not in fresh:
                    fresh.add(key)
                    costs[-1] += self._prefix_pages(n)
            top = sum(sorted(costs, reverse=True)[: free[rank]])
            most = max(most, pool.in_use - self._evictable(rank) + self._reserved(rank) + top)
        return most

    # ---- admission -----------------------------------------------------------------------------
    def admit(self) -> Admission:
        """Fill free slots with waiting requests, in order, while a rank's pool can hold what they need."""
        adm = Admission([], [], [], [], [])
        free = [self._free_slots(rank) for rank in range(self.ranks)]
        budget = [pool.free + self._evictable(k) - self._reserved(k) for k, pool in enumerate(self.pools)]
        retired = []  # (rank, pages) to release after the round: this round's prefill and copies still read them
        while self.waiting:
            r = self.waiting[0]
            key, prompt_len = self._key(r), len(self.prompts[r])
            own_need, prefix_need = self._own_need(prompt_len), self._prefix_pages(prompt_len)
            rank = self._place(key, own_need, prefix_need, free, budget)
            if rank is None:
                break
            self.waiting.pop(0)
            prefix = self.prefixes.get((rank, key))
            if prefix is None:
                prefix = self.prefixes[(rank, key)] = self._new_prefix(r, rank)
                adm.prefill.append(prefix)
                budget[rank] -= prefix_need
            budget[rank] -= own_need
            self.pools[rank].retain(prefix.full_pages)
            self.pending[key] -= 1
            last = self.pending[key] == 0
            own = []
            if prefix.partial_page is not None:
                if last:  # the prompt's last request takes its rank's template page (and its reference)
                    own = [prefix.partial_page]
                else:
                    own = self._alloc(rank, 1)
                    adm.copy_rank.append(rank)
                    adm.copy_src.append(prefix.partial_page)
                    adm.copy_dst.append(own[0])
            if last:
                del self.pending[key]
                retired += self._retire(key, rank)
            seq = Sequence(r, prefix, prefix.full_pages + own, prompt_len + self.max_new - 1)
            slot = free[rank].pop(0)
            self.slots[slot] = seq
            adm.members.append((slot, seq))
        for rank, pages in retired:
            self.pools[rank].release(pages)
        if self.waiting and not adm.members and not self.running:
            raise RuntimeError(f"request {self.waiting[0]} cannot be admitted: the free pages of every rank's "
                               "pool are held by prompts whose other rollouts wait; give the engine more pages.")
        return adm

    def _place(self, key, own_need: int, prefix_need: int, free: list[list[int]], budget: list[int]) -> int | None:
        """The rank the request of `key` goes to (module docstring), or None when no rank can take it."""
        held = [k for k in range(self.ranks) if (k, key) in self.prefixes and free[k] and budget[k] >= own_need]
        fit = held or [k for k in range(self.ranks) if free[k] and budget[k] >= own_need + prefix_need]
        return min(fit, key=lambda k: (-len(free[k]), k)) if fit else None

    def _new_prefix(self, request: int, rank: int) -> Prefix:
        """Request `request`'s prompt in `rank`'s pool: its cached leading pages, fresh pages for the rest."""
        prompt, group = self.prompts[request], self.groups[request]
        n_full = len(prompt) // self.page_size
        cached = self.caches[rank].lookup(group, prompt) if self.caches else []
        pages = cached + self._alloc(rank, self._prefix_pages(len(prompt)) - len(cached))
        self.prefill_tokens += len(prompt) - len(cached) * self.page_size
        return Prefix(prompt, group, rank, pages[:n_full], pages[n_full] if len(pages) > n_full else None,
                      cached=len(cached))

    def _retire(self, key, rank: int) -> list[tuple[int, list[int]]]:
        """`key` has no request left waiting: drop its prefixes; the references they hold, by rank (on
        `rank`, where its last request took the template page, the full pages only)."""
        out = []
        for k in range(self.ranks):
            p = self.prefixes.pop((k, key), None)
            if p is not None:
                template = [p.partial_page] if k != rank and p.partial_page is not None else []
                out.append((k, p.full_pages + template))
        return out

    def started(self, members: list[tuple[int, Sequence]], tok, logp, stops: set[int]) -> None:
        """Record each admitted member's first token (drawn from its prompt's last hidden state)."""
        for (slot, seq), t, lp in zip(members, tok, logp):
            seq.token, seq.pos, seq.n_gen = int(t), len(seq.prefix.prompt), 1
            self.tokens[seq.request].append(int(t))
            self.logprobs[seq.request].append(float(lp))
            self.hit[seq.request] = int(t) in stops
            if self.hit[seq.request] or self.max_new == 1:
                self._finish(slot)

    def _finish(self, slot: int) -> None:
        self.pools[self.rank_of(slot)].release(self.slots[slot].pages)
        self.finished.append(self.slots[slot].request)
        self.slots[slot] = None

    def _preempt(self, slot: int) -> None:
        """Free the slot and pages of its sequence and queue its request again, from the start."""
        q = self.slots[slot]
        self.pools[self.rank_of(slot)].release(q.pages)
        self.slots[slot] = None
        r = q.request
        self.tokens[r], self.logprobs[r], self.hit[r] = [], [], False
        self.waiting = sorted(self.waiting + [r])
        key = self._key(r)
        self.pending[key] = self.pending.get(key, 0) + 1
        self.preemptions += 1

    # ---- decode chunks -------------------------------------------------------------------------
    def grow(self, steps: int) -> int:
        """Give each running sequence the pages its next `steps` decode steps write (from its rank's
        pool), preempting the latest requests of a rank whose pool runs short (optimistic admission);
        returns the most pages any sequence then holds."""
        for rank, pool in enumerate(self.pools if self.optimistic else []):
            mine = sorted((q.request, s) for s, q in enumerate(self.slots) if q is not None and self.rank_of(s) == rank)
            while sum(self._short(self.slots[s], steps) for _, s in mine) > pool.free + self._evictable(rank):
                if len(mine) == 1:
                    raise RuntimeError(f"request {mine[0][0]} cannot grow alone in rank {rank}'s pool: its pages are "
                                       "held by prompts whose other rollouts wait; give the engine more pages.")
                self._preempt(mine.pop()[1])
        widest = 1
        for s, q in self.running:
            short = self._short(q, steps)
            if short > 0:
                q.pages += self._alloc(self.rank_of(s), short)
            widest = max(widest, len(q.pages))
        return widest

    def batch(self, width: int) -> dict[str, np.ndarray]:
        """The running sequences as a decode chunk's rows, in rank blocks: R blocks of as many rows as the
        busiest rank runs (rounded up to a power of two, at most its slots), rank r's sequences first in
        block r in `running` order, the rest idle. Page tables [rows, width] (pool-local page ids,
        null-padded), next input token, its position, tokens generated so far, request id (its RNG
        stream), liveness, pages held ("held"), and the rows of each rank's parameter sets ("groups" [R·num_groups], `block_groups`). Rows, not slots: a
        chunk computes only as many rows as are running (rounded up), so the tail of a call runs at a
        small batch. `stable`: a sequence keeps its row while the rows per rank stay (`stable_rows`), so a
        decode path that keeps per-row state across chunks refreshes only the new rows. The row → slot map
        is kept for `advance`."""
        slots = [s for s, _ in self.running]
        ranks = [self.rank_of(s) for s in slots]
        at, per_rank = rank_rows(ranks, self.ranks, self.rank_slots)
        if self.stable:
            at = stable_rows(ranks, [self.slots[s].row for s in slots], per_rank)
        rows = self.ranks * per_rank
        out = {"page_table": np.full((rows, width), NULL_PAGE, np.int32), "token": np.zeros(rows, np.int32),
               "pos": np.zeros(rows, np.int32), "n_gen": np.zeros(rows, np.int32),
               "request": np.zeros(rows, np.int32), "live": np.zeros(rows, bool), "held": np.zeros(rows, np.int32),
               "groups": block_groups([(self.rank_of(s), q.prefix.group) for s, q in self.running], self.ranks,
                                      per_rank, self.num_groups)}
        self.rows = list(zip(at, slots))
        for r, s in self.rows:
            q = self.slots[s]
            q.row = r
            out["page_table"][r, : len(q.pages)] = q.pages
            out["token"][r], out["pos"][r], out["n_gen"][r] = q.token, q.pos, q.n_gen
            out["request"][r], out["live"][r], out["held"][r] = q.request, True, len(q.pages)
        return out

    def advance(self, tok_bc, logp_bc, n_gen_b, token_b, pos_b, hit_b, done_b) -> None:
        """Take a decode chunk's results (rows as the last `batch` laid them out); finished sequences free
        their slots and pages."""
        for r, s in self.rows:
            q = self.slots[s]
            new = int(n_gen_b[r]) - q.n_gen
            self.tokens[q.request] += tok_bc[r, :new].tolist()
            self.logprobs[q.request] += logp_bc[r, :new].tolist()
            q.n_gen, q.token, q.pos = int(n_gen_b[r]), int(token_b[r]), int(pos_b[r])
            self.hit[q.request] = bool(hit_b[r])
            if done_b[r]:
                self._finish(s)
        self.rows = []
