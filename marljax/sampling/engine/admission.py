"""Admission and preemption (`marljax.sampling.engine.scheduler`'s docstring has the policy): the requests waiting in
submission order, their shared prompt prefixes per rank, which rank each goes to and what one admission
round asks of the device (`Admission`), the pages a rank needs to admit into every free slot (`demand`),
and, under optimistic admission, preempting the latest requests of a rank whose pool runs short.
"""
from __future__ import annotations

import dataclasses

from marljax.sampling.engine.slots import Prefix, Sequence, SlotTable

ADMISSIONS = ("worst_case", "optimistic")


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


class Admitter:
    """See the module docstring. Request ids are the prompts' indices in `queue` order. `share`: requests
    with an identical prompt (and parameter set) share one prefix per rank; else every request is its own."""

    def __init__(self, table: SlotTable, share: bool):
        self.table, self.share = table, share
        self.prompts: list[tuple[int, ...]] = []
        self.groups: list[int] = []  # each request's parameter set
        self.waiting: list[int] = []
        self.pending: dict = {}  # key (set and prompt, or request id without sharing) -> its requests waiting
        self.prefixes: dict = {}  # (rank, key) -> Prefix whose pages it still holds (its key is pending)
        self.prefill_tokens = 0  # prompt tokens prefilled (real, not padding)
        self.preemptions = 0  # sequences preempted (optimistic admission)

    def queue(self, prompt: tuple[int, ...], group: int) -> int:
        """Queue a request; its id."""
        r = len(self.prompts)
        self.waiting.append(r)
        self.prompts.append(prompt)
        self.groups.append(group)
        self._wait(r)
        return r

    def key(self, request: int):
        return (self.groups[request], self.prompts[request]) if self.share else request

    def _wait(self, request: int) -> None:
        key = self.key(request)
        self.pending[key] = self.pending.get(key, 0) + 1

    def demand(self) -> int:
        """Pages one rank's pool needs to admit waiting requests into every free slot now, the most over
        the ranks. Per rank an upper bound: its pages in use, plus what its running sequences may still
        take, plus the worst case of the costliest requests it could be given (as many as its free
        slots, among those the free slots of all ranks can admit; a prompt's first request that has no
        prefix on the rank pays its prefix pages). Exact with one rank."""
        t = self.table
        free = [len(t.free_slots(rank)) for rank in range(t.ranks)]
        heads = self.waiting[: sum(free)]
        most = 0
        for rank, pool in enumerate(t.pools):
            costs, fresh = [], set()
            for r in heads:
                key, n = self.key(r), len(self.prompts[r])
                costs.append(t.own_need(n))
                if (rank, key) not in self.prefixes and key not in fresh:
                    fresh.add(key)
                    costs[-1] += t.prefix_pages(n)
            top = sum(sorted(costs, reverse=True)[: free[rank]])
            most = max(most, pool.in_use - t.evictable(rank) + t.reserved(rank) + top)
        return most

    def admit(self) -> Admission:
        """Fill free slots with waiting requests, in order, while a rank's pool can hold what they need."""
        t, adm = self.table, Admission([], [], [], [], [])
        free = [t.free_slots(rank) for rank in range(t.ranks)]
        budget = [pool.free + t.evictable(k) - t.reserved(k) for k, pool in enumerate(t.pools)]
        retired = []  # (rank, pages) to release after the round: this round's prefill and copies still read them
        while self.waiting:
            r = self.waiting[0]
            key, prompt_len = self.key(r), len(self.prompts[r])
            own_need, prefix_need = t.own_need(prompt_len), t.prefix_pages(prompt_len)
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
            t.pools[rank].retain(prefix.full_pages)
            own, retire = self._member_pages(key, prefix, adm)
            retired += retire
            seq = Sequence(r, prefix, prefix.full_pages + own, prompt_len + t.max_new - 1)
            slot = free[rank].pop(0)
            t.slots[slot] = seq
            adm.members.append((slot, seq))
        for rank, pages in retired:
            t.pools[rank].release(pages)
        if self.waiting and not adm.members and not t.running:
            raise RuntimeError(f"request {self.waiting[0]} cannot be admitted: the free pages of every rank's "
                               "pool are held by prompts whose other rollouts wait; give the engine more pages.")
        return adm

    def _member_pages(self, key, prefix: Prefix, adm: Admission) -> tuple[list[int], list]:
        """A request of `key` admitted onto `prefix`: its own pages (its copy of the prompt's partial page,
        queued in `adm`, or the template itself for the prompt's last request), and the references to
        release after the round when it was the last (`_retire`)."""
        self.pending[key] -= 1
        last = self.pending[key] == 0
        own = []
        if prefix.partial_page is not None:
            if last:  # the prompt's last request takes its rank's template page (and its reference)
                own = [prefix.partial_page]
            else:
                own = self.table.alloc(prefix.rank, 1)
                adm.copy_rank.append(prefix.rank)
                adm.copy_src.append(prefix.partial_page)
                adm.copy_dst.append(own[0])
        if not last:
            return own, []
        del self.pending[key]
        return own, self._retire(key, prefix.rank)

    def _place(self, key, own_need: int, prefix_need: int, free: list[list[int]], budget: list[int]) -> int | None:
        """The rank the request of `key` goes to (`scheduler`'s docstring), or None when no rank can take it."""
        ranks = range(self.table.ranks)
        held = [k for k in ranks if (k, key) in self.prefixes and free[k] and budget[k] >= own_need]
        fit = held or [k for k in ranks if free[k] and budget[k] >= own_need + prefix_need]
        return min(fit, key=lambda k: (-len(free[k]), k)) if fit else None

    def _new_prefix(self, request: int, rank: int) -> Prefix:
        """Request `request`'s prompt in `rank`'s pool: its cached leading pages, fresh pages for the rest."""
        t, prompt, group = self.table, self.prompts[request], self.groups[request]
        n_full = len(prompt) // t.page_size
        cached = t.caches[rank].lookup(group, prompt) if t.caches else []
        pages = cached + t.alloc(rank, t.prefix_pages(len(prompt)) - len(cached))
        self.prefill_tokens += len(prompt) - len(cached) * t.page_size
        return Prefix(prompt, group, rank, pages[:n_full], pages[n_full] if len(pages) > n_full else None,
                      cached=len(cached))

    def _retire(self, key, rank: int) -> list[tuple[int, list[int]]]:
        """`key` has no request left waiting: drop its prefixes; the references they hold, by rank (on
        `rank`, where its last request took the template page, the full pages only)."""
        out = []
        for k in range(self.table.ranks):
            p = self.prefixes.pop((k, key), None)
            if p is not None:
                template = [p.partial_page] if k != rank and p.partial_page is not None else []
                out.append((k, p.full_pages + template))
        return out

    # ---- preemption (optimistic admission) ---------------------------------------------------------
    def make_room(self, steps: int) -> list[int]:
        """Preempt the latest requests of each rank whose pool cannot give its running sequences the pages
        of their next `steps` decode steps, until it can; the preempted requests (queued again)."""
        t, preempted = self.table, []
        for rank, pool in enumerate(t.pools):
            mine = sorted((q.request, s) for s, q in t.on_rank(rank))
            while sum(t.short(t.slots[s], steps) for _, s in mine) > pool.free + t.evictable(rank):
                if len(mine) == 1:
                    raise RuntimeError(f"request {mine[0][0]} cannot grow alone in rank {rank}'s pool: its pages are "
                                       "held by prompts whose other rollouts wait; give the engine more pages.")
                preempted.append(self._preempt(mine.pop()[1]))
        return preempted

    def _preempt(self, slot: int) -> int:
        """Free the slot and pages of its sequence and queue its request again, from the start; the request."""
        r = self.table.vacate(slot).request
        self.waiting = sorted(self.waiting + [r])
        self._wait(r)
        self.preemptions += 1
        return r
