"""Host-side continuous batching: decode slots, admission with page reservation, shared prompt prefixes,
one page pool per data-parallel rank.

The slots are split evenly over R ranks (slot s belongs to rank s // (slots / R)), and each rank has
its own page pool (`PagePool`; on a mesh, the rank's chip holds it): a sequence's pages all come from its
slot's rank. Decode chunks lay the rows out in rank blocks (`batch`), the layout
`marljax.sampling.engine.paged_attention` maps to the rank pools. With R = 1 there is one pool.

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
              with its own key (`marljax.sampling.engine.engine`), so its restart yields what it would have; the
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
(`marljax.sampling.engine.prefix_cache`) after its requests finish, and a later prompt on that rank that starts
with the same blocks (of the same parameter set) reuses them and is prefilled from there on. With
`share_prefixes=False` every request is its own prefix (one member, no copy) and nothing is cached.

`Scheduler` composes one part per job: the slots and page pools (`marljax.sampling.engine.slots.SlotTable`:
reservation, allocation, freeing), the prefix caches (`marljax.sampling.engine.prefix_cache`), admission and
preemption (`marljax.sampling.engine.admission.Admitter`: the queue, prefixes, placement, demand), and the batch
layout (`marljax.sampling.engine.batch.BatchLayout`); it keeps each request's results.
"""
from __future__ import annotations

from marljax.sampling.engine.admission import ADMISSIONS, Admission, Admitter
from marljax.sampling.engine.batch import BatchLayout, DecodeBatch, DecodeState
from marljax.sampling.engine.kv_pages import PagePool
from marljax.sampling.engine.prefix_cache import PrefixCache
from marljax.sampling.engine.slots import Prefix, Sequence, SlotTable

__all__ = ["ADMISSIONS", "Scheduler"]


class Scheduler:
    """See the module docstring. Request ids are the prompts' indices in `submit` order. `pools`: one
    `PagePool` per rank, of equal size; `num_slots` a multiple of their number. `admission`: `ADMISSIONS`;
    `lookahead`: the decode steps of a chunk (what optimistic admission reserves for). `stable`: decode
    rows stay put from chunk to chunk (`BatchLayout`); only without per-row adapters, whose rows go by set.

    Parts: `table` (`SlotTable`), `admitter` (`Admitter`), `layout` (`BatchLayout`). Results per request:
    `tokens`, `logprobs`, `hit` (a stop token drawn)."""

    def __init__(self, pools: list[PagePool], num_slots: int, page_size: int, max_new: int, share_prefixes: bool,
                 num_groups: int = 1, admission: str = "worst_case", lookahead: int = 1, stable: bool = False):
        if admission not in ADMISSIONS:
            raise ValueError(f"admission {admission!r}; choose from {ADMISSIONS}.")
        self.optimistic, self.max_new, self.num_groups = admission == "optimistic", max_new, num_groups
        caches = [PrefixCache(pool, page_size) for pool in pools] if share_prefixes else None
        self.table = SlotTable(pools, num_slots, page_size, max_new, caches, self.optimistic, lookahead)
        self.admitter = Admitter(self.table, share_prefixes)
        self.layout = BatchLayout(len(pools), self.table.rank_slots, num_groups, stable)
        self.tokens: list[list[int]] = []
        self.logprobs: list[list[float]] = []
        self.hit: list[bool] = []
        self.finished: list[int] = []  # requests finished since `take_finished`

    # ---- requests and results ----------------------------------------------------------------------
    @property
    def submitted(self) -> int:
        return len(self.tokens)

    def submit(self, prompt: list[int], group: int = 0) -> int:
        """Queue a request of parameter set `group`; its id (submission order)."""
        if not 0 <= group < self.num_groups:
            raise ValueError(f"group {group} is not one of the stream's {self.num_groups} parameter sets.")
        self.tokens.append([])
        self.logprobs.append([])
        self.hit.append(False)
        return self.admitter.queue(tuple(prompt), group)

    def take_finished(self) -> list[int]:
        """Requests finished since the last call."""
        done, self.finished = self.finished, []
        return done

    @property
    def idle(self) -> bool:
        return not self.admitter.waiting and not self.running

    @property
    def running(self) -> list[tuple[int, Sequence]]:
        """(slot, sequence) of the running sequences (`SlotTable.running`)."""
        return self.table.running

    @property
    def rows(self) -> list[tuple[int, int]]:
        """(row, slot) of the last `batch`."""
        return self.layout.rows

    @property
    def prefill_tokens(self) -> int:
        """Prompt tokens prefilled (real, not padding)."""
        return self.admitter.prefill_tokens

    @property
    def preemptions(self) -> int:
        """Sequences preempted (optimistic admission)."""
        return self.admitter.preemptions

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens found in the prefix caches (not prefilled)."""
        caches = self.table.caches
        return sum(c.hit_tokens for c in caches) if caches else 0

    def worst_pages(self, prompt_len: int) -> int:
        """Pages one request with a prompt of `prompt_len` tokens may hold at most, sharing nothing."""
        return self.table.worst_pages(prompt_len)

    def _finish(self, slot: int) -> None:
        self.finished.append(self.table.vacate(slot).request)

    # ---- admission -------------------------------------------------------------------------------
    def demand(self) -> int:
        """Pages one rank's pool needs to admit waiting requests into every free slot now (`Admitter.demand`)."""
        return self.admitter.demand()

    def admit(self) -> Admission:
        """Fill free slots with waiting requests, in order, while a rank's pool can hold what they need."""
        return self.admitter.admit()

    def prefilled(self, prefixes: list[Prefix]) -> None:
        """The prefixes' pages now hold their prompts' KV: keep their full pages in their rank's cache."""
        self.table.cache(prefixes)

    def started(self, members: list[tuple[int, Sequence]], tok, logp, stops: set[int]) -> None:
        """Record each admitted member's first token (drawn from its prompt's last hidden state)."""
        for (slot, seq), t, lp in zip(members, tok, logp):
            seq.token, seq.pos, seq.n_gen = int(t), len(seq.prefix.prompt), 1
            self.tokens[seq.request].append(int(t))
            self.logprobs[seq.request].append(float(lp))
            self.hit[seq.request] = int(t) in stops
            if self.hit[seq.request] or self.max_new == 1:
                self._finish(slot)

    # ---- decode chunks -----------------------------------------------------------------------------
    def grow(self, steps: int) -> int:
        """Give each running sequence the pages its next `steps` decode steps write (from its rank's
        pool), preempting the latest requests of a rank whose pool runs short (optimistic admission: their
        results dropped, to be drawn again from the start); returns the most pages any sequence then holds."""
        for r in self.admitter.make_room(steps) if self.optimistic else []:
            self.tokens[r], self.logprobs[r], self.hit[r] = [], [], False
        return self.table.grow(steps)

    def batch(self, width: int) -> DecodeBatch:
        """The running sequences as a decode chunk's rows (`BatchLayout.lay_out`), page tables `width` pages
        wide; the row → slot map is kept for `advance`."""
        return self.layout.lay_out(self.running, self.table.rank_of, width)

    def advance(self, out: DecodeState) -> None:
        """Take a decode chunk's results (host arrays; rows as the last `batch` laid them out); finished
        sequences free their slots and pages."""
        for r, s in self.layout.rows:
            q = self.table.slots[s]
            new = int(out.n_gen_b[r]) - q.n_gen
            self.tokens[q.request] += out.tok_bc[r, :new].tolist()
            self.logprobs[q.request] += out.logp_bc[r, :new].tolist()
            q.n_gen, q.token, q.pos = int(out.n_gen_b[r]), int(out.token_b[r]), int(out.pos_b[r])
            self.hit[q.request] = bool(out.hit_b[r])
            if out.done_b[r]:
                self._finish(s)
        self.layout.rows = []
