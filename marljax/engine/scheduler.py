"""Host-side continuous batching: decode slots, admission with page reservation, shared prompt prefixes.

Requests wait in submission order. Between decode chunks the scheduler frees the slots (and pages) of
finished sequences and admits waiting requests into free slots. A request is admitted only when the
pool can hold everything it may still write (its worst case: prompt + max_new − 1 positions, less the
pages it shares), counting what the sequences already running may still need; so a running sequence
never finds the pool empty, and pages are still taken one chunk at a time (`grow`): the pages in use
are the tokens in flight.

Shared prefixes: requests with an identical prompt form one `Prefix`, prefilled once into its own pages
(the prompt's full pages plus a template of its last, partial page). Every member shares the full pages
(refcounted) and writes its continuation into its own copy of the partial page; the last member to be
admitted takes the template itself. The prefix keeps the prompt's last hidden state, from which each
member draws its first token with its own key. Prompts also share pages over time: a prompt's full pages
stay in the prefix cache (`marljax.engine.prefix_cache`) after its requests finish, and a later prompt
that starts with the same blocks (of the same parameter set) reuses them and is prefilled from there on.
With `share_prefixes=False` every request is its own prefix (one member, no copy) and nothing is cached.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from marljax.engine.kv_pages import NULL_PAGE, PagePool, pages_for
from marljax.engine.prefix_cache import PrefixCache


@dataclasses.dataclass
class Prefix:
    """A prompt prefilled once: its pages (one reference held here until its last member is admitted)."""

    prompt: tuple[int, ...]
    group: int  # the parameter set its KV was computed with
    full_pages: list[int]
    partial_page: int | None
    waiting: int  # members not yet admitted
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

    @property
    def own_pages(self) -> list[int]:
        return self.pages[len(self.prefix.full_pages):]


@dataclasses.dataclass
class Admission:
    """What one admission round asks of the device: prefill `prefill` (new prefixes), copy page src[i]
    onto dst[i], then draw the first token of each of `members` (slot, sequence)."""

    prefill: list[Prefix]
    copy_src: list[int]
    copy_dst: list[int]
    members: list[tuple[int, Sequence]]


class Scheduler:
    """See the module docstring. Request ids are the prompts' indices in `submit` order."""

    def __init__(self, pool: PagePool, num_slots: int, page_size: int, max_new: int, share_prefixes: bool,
                 num_groups: int = 1):
        self.pool, self.page_size, self.max_new = pool, page_size, max_new
        self.share = share_prefixes
        self.slots: list[Sequence | None] = [None] * num_slots
        self.waiting: list[int] = []
        self.prompts: list[tuple[int, ...]] = []
        self.groups: list[int] = []  # each request's parameter set (0 … num_groups − 1)
        self.num_groups = num_groups
        self.prefixes: dict = {}  # key (prompt, or request id without sharing) -> Prefix not fully admitted
        self.tokens: list[list[int]] = []
        self.logprobs: list[list[float]] = []
        self.hit: list[bool] = []
        self.prefill_tokens = 0  # prompt tokens prefilled (real, not padding)
        self.finished: list[int] = []  # requests finished since `take_finished`
        self.cache = PrefixCache(pool, page_size) if share_prefixes else None

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
        prefix = self.prefixes.setdefault(self._key(r), Prefix(tuple(prompt), group, [], None, 0))
        prefix.waiting += 1
        return r

    def worst_pages(self, prompt_len: int) -> int:
        """Pages one request with a prompt of `prompt_len` tokens may hold at most, sharing nothing."""
        return self._prefix_pages(prompt_len) + self._own_worst(prompt_len)

    def take_finished(self) -> list[int]:
        """Requests finished since the last call."""
        done, self.finished = self.finished, []
        return done

    def _key(self, request: int):
        return (self.groups[request], self.prompts[request]) if self.share else request

    def _prefix_pages(self, prompt_len: int) -> int:
        return pages_for(prompt_len, self.page_size)

    def _own_worst(self, prompt_len: int) -> int:
        return pages_for(prompt_len + self.max_new - 1, self.page_size) - prompt_len // self.page_size

    @property
    def running(self) -> list[tuple[int, Sequence]]:
        """(slot, sequence) of the running sequences, grouped by parameter set (the order of a decode
        chunk's rows: per-row adapters need rows sorted by set), then by slot."""
        return sorted(((s, q) for s, q in enumerate(self.slots) if q is not None), key=lambda x: x[1].prefix.group)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def _evictable(self) -> int:
        return self.cache.evictable() if self.cache else 0

    def _alloc(self, n: int) -> list[int]:
        """n fresh pages, evicting cached prompt pages no request uses when the free list is short."""
        if n > self.pool.free and self.cache:
            self.cache.evict(n - self.pool.free)
        return self.pool.alloc(n)

    def prefilled(self, prefixes: list[Prefix]) -> None:
        """The prefixes' pages now hold their prompts' KV: keep their full pages in the prefix cache."""
        if self.cache:
            for p in prefixes:
                self.cache.insert(p.group, p.prompt, p.full_pages)

    def _reserved(self) -> int:
        """Pages the running sequences may still take."""
        return sum(self._own_worst(len(q.prefix.prompt)) - len(q.own_pages) for _, q in self.running)

    def demand(self) -> int:
        """Pages in use, plus what the running sequences may still take, plus what admitting waiting
        requests into every free slot needs at worst: the pool that admits them all now."""
        need, fresh = self.pool.in_use - self._evictable() + self._reserved(), set()
        free_slots = sum(q is None for q in self.slots)
        for r in self.waiting[:free_slots]:
            prefix = self.prefixes[self._key(r)]
            need += self._own_worst(len(prefix.prompt))
            if not prefix.full_pages and prefix.partial_page is None and id(prefix) not in fresh:
                fresh.add(id(prefix))
                need += self._prefix_pages(len(prefix.prompt))
        return need

    # ---- admission -----------------------------------------------------------------------------
    def admit(self) -> Admission:
        """Fill free slots with waiting requests, in order, while the pool can hold their worst case."""
        adm = Admission([], [], [], [])
        free_slots = [s for s, q in enumerate(self.slots) if q is None]
        budget = self.pool.free + self._evictable() - self._reserved()
        while self.waiting and free_slots:
            r = self.waiting[0]
            prefix = self.prefixes[self._key(r)]
            prompt_len = len(prefix.prompt)
            fresh = not prefix.full_pages and prefix.partial_page is None  # no pages yet: prefill it
            need = self._own_worst(prompt_len) + (self._prefix_pages(prompt_len) if fresh else 0)
            if need > budget:
                break
            budget -= need
            self.waiting.pop(0)
            if fresh:
                n_full = prompt_len // self.page_size
                cached = self.cache.lookup(prefix.group, prefix.prompt) if self.cache else []
                pages = cached + self._alloc(self._prefix_pages(prompt_len) - len(cached))
                prefix.full_pages = pages[:n_full]
                prefix.partial_page = pages[n_full] if len(pages) > n_full else None
                prefix.cached = len(cached)
                adm.prefill.append(prefix)
                self.prefill_tokens += prompt_len - len(cached) * self.page_size
            self.pool.retain(prefix.full_pages)
            own = []
            prefix.waiting -= 1
            if prefix.partial_page is not None:
                if prefix.waiting == 0:  # the last member takes the template page (and its reference)
                    own = [prefix.partial_page]
                else:
                    own = self._alloc(1)
                    adm.copy_src.append(prefix.partial_page)
                    adm.copy_dst.append(own[0])
            if prefix.waiting == 0:
                self.pool.release(prefix.full_pages)
                del self.prefixes[self._key(r)]
            seq = Sequence(r, prefix, prefix.full_pages + own, prompt_len + self.max_new - 1)
            slot = free_slots.pop(0)
            self.slots[slot] = seq
            adm.members.append((slot, seq))
        if self.waiting and not adm.members and not self.running:
            raise RuntimeError(f"request {self.waiting[0]} cannot be admitted: the pool's {self.pool.free} free "
                               "pages are held by prompts whose other rollouts wait; give the engine more pages.")
        return adm

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
        self.pool.release(self.slots[slot].pages)
        self.finished.append(self.slots[slot].request)
        self.slots[slot] = None

    # ---- decode chunks -------------------------------------------------------------------------
    def grow(self, steps: int) -> int:
        """Give each running sequence the pages its next `steps` decode steps write; returns the most
        pages any sequence then holds."""
        widest = 1
        for _, q in self.running:
            last = min(q.pos + steps, q.limit) - 1  # the last position this chunk may write
            short = last // self.page_size + 1 - len(q.pages)
            if short > 0:
                q.pages += self._alloc(short)
            widest = max(widest, len(q.pages))
        return widest

    def batch(self, rows: int, width: int) -> dict[str, np.ndarray]:
        """The running sequences, in `running` order, as the first of `rows` rows for a decode chunk (the
        rest idle): page tables [rows, width] (null-padded), next input token, its position, tokens
        generated so far, request id (its RNG stream), liveness, and the rows of each parameter set
        ("groups" [num_groups]). Rows, not slots: a chunk computes only as many rows as are running
        (rounded up by the engine), so the tail of a call runs at a small batch."""
        out = {"page_table": np.full((rows, width), NULL_PAGE, np.int32), "token": np.zeros(rows, np.int32),
               "pos": np.zeros(rows, np.int32), "n_gen": np.zeros(rows, np.int32),
               "request": np.zeros(rows, np.int32), "live": np.zeros(rows, bool),
               "groups": np.zeros(self.num_groups, np.int32)}
        for r, (_, q) in enumerate(self.running):
            out["groups"][q.prefix.group] += 1
            out["page_table"][r, : len(q.pages)] = q.pages
            out["token"][r], out["pos"][r], out["n_gen"][r] = q.token, q.pos, q.n_gen
            out["request"][r], out["live"][r] = q.request, True
        return out

    def advance(self, tok_rk, logp_rk, n_gen_r, token_r, pos_r, hit_r, done_r) -> None:
        """Take a decode chunk's results (rows as `batch` laid them out); finished sequences free their
        slots and pages."""
        for r, (s, q) in enumerate(self.running):
            new = int(n_gen_r[r]) - q.n_gen
            self.tokens[q.request] += tok_rk[r, :new].tolist()
            self.logprobs[q.request] += logp_rk[r, :new].tolist()
            q.n_gen, q.token, q.pos = int(n_gen_r[r]), int(token_r[r]), int(pos_r[r])
            self.hit[q.request] = bool(hit_r[r])
            if done_r[r]:
                self._finish(s)
