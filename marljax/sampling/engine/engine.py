"""The rollout engine: continuous batching over decode slots with a paged KV cache.

`Engine(model, num_slots=…)` decodes through `Stream`s: `engine.stream(SamplingParams(…), layers=…)`
takes requests at any time (`submit(prompt, key)`), and each `step()` admits waiting requests into free
slots (`Scheduler.admit`), prefills the new prompts into their pages (once per distinct prompt when
prefixes are shared), draws each newcomer's first token, runs one jitted chunk of `chunk_steps` decode
steps over the running sequences, and returns the requests that finished. `engine.generate(prompts,
params, layers=…)` is one stream run to the end; it returns what `marljax.sampling.generate` returns
(`SampleOutput`: per prompt its generated ids, stop token included if hit, their logprobs under the
tempered distribution they were drawn from, and whether a stop hit).

Data-parallel ranks (`ranks`, on a mesh: its batch ranks, `marljax.core.sharding.batch_ranks`): the slots
are split evenly over the ranks and each rank has its own page pool (`init_pages(..., ranks)`: on a mesh
every chip holds its own rank's pages only); a sequence's pages come from its slot's rank and prompts
are prefilled per rank (`marljax.sampling.engine.scheduler`). Prefill and decode batches are laid out in rank
blocks: R blocks of equal rows, block r's page tables indexing pool r (`kv_pages.per_rank`).

Shapes are static per chunk and bucketed: prefill rows (per rank) and prompt length to powers of two,
the decode rows (per rank: the busiest rank's running sequences, at most its slots; the tail of a call
runs at a small batch) too, the page-table width in pages two per doubling (`shapes.page_bucket`:
attention reads the pages in flight, rounded up), and the pool; a run compiles a handful of times. Each
rank's pool is `num_pages` pages, or (None) all grow together (in eighths of a doubling, `Stream._grow`) to
what the busiest rank's admitted sequences may need at worst (optimistic `admission`: in their next
chunk); the pools are kept for the engine's next stream.
`prefill_tokens` bounds one prefill call to rows × chunk ≤ that many positions (chunked prefill): long
prompts are prefilled chunk after chunk, each attending the pages the chunks before it wrote, so a
30k-token Eval-Opt history costs the activations of one chunk, not of the whole prompt.

Randomness is per request, not per batch: a request draws its t-th token with fold_in(key, t), its own
key whatever else is in flight (`generate`: request i's key is fold_in(key(seed), i)), so outputs do not
depend on the slot count, the chunk length, the pool or the other prompts.
Suffixes: the legend in marljax/models/decoder.py (rows b, requests q, raw key words u, page tables bw).
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from marljax.core import sharding
from marljax.sampling.engine.draw import SampleOutput, SamplingParams, sample_rows
from marljax.sampling.engine.kv_pages import (NULL_PAGE, PagePool, copy_pages, grow_pages, init_pages, page_bytes, pages_for,
                                     pool_pages)
from marljax.sampling.engine.paged_attention import (CHUNK_PATHS, chunk_cache_attention, chunk_writes, dense_cache,
                                            gather_dense, init_dense, interleave, length_groups,
                                            paged_cache_attention, refresh_dense, resolve_paged_attention,
                                            write_dense, write_pages)
from marljax.core.shapes import bucket, bucket_rows, page_bucket
from marljax.models.decoder import Decoder
from marljax.models.lora import stack_adapters
from marljax.sampling.engine.batch import DecodeBatch, DecodeState, PrefillBatch, block_groups, rank_rows, to_host
from marljax.sampling.engine.scheduler import ADMISSIONS, Scheduler

PREFILL_CHUNK_MIN = 16  # positions: the shortest prefill call (prompt lengths bucket up from here)
# Decode steps per jitted chunk. 32, not 16: half the chunks' fixed work (host scheduling, the chunk path's
# dense copy) for a few more idle row-steps; 1.03x the rate of 16 on the 32 x 8 GSM8K bench (mean of three
# repeats in two runs, 0.996-1.056; docs/benchmarks.md "Rollout engine (SmolLM2-135M, GSM8K 32 x 8").
CHUNK_STEPS = 32
NUM_SLOTS = 64  # sequences decoded at once, the default of every caller that does not size its own


@dataclasses.dataclass
class EngineStats:
    """Work and memory of the last `generate` call."""

    prefill_tokens: int = 0  # real prompt tokens prefilled (a shared prompt counts once; cached pages none)
    cached_tokens: int = 0  # prompt tokens whose pages came from the prefix cache
    prefill_calls: int = 0  # jitted prefill calls (one per admission round, or per chunk of one)
    decode_chunks: int = 0
    decode_steps: int = 0  # row-steps run (a chunk's rows: the running sequences rounded up)
    decode_rows: int = 0  # the running sequences of each decode chunk, summed over chunks
    generated_tokens: int = 0
    # the sum over ranks of each rank's most pages in use at once (the tokens in flight): an upper bound
    # of the most in use at once over all ranks (the ranks peak at different times), exact with one rank
    peak_pages: int = 0
    peak_kv_bytes: int = 0  # peak_pages × bytes of a page across layers
    pool_bytes: int = 0  # the page pools of all ranks as allocated
    # the chunk attention path's dense copy of the decode rows' pages (rows × width pages across layers,
    # held beside the pool from chunk to chunk while the rows stay): its largest, 0 on the other paths
    peak_dense_bytes: int = 0
    # running rows the chunk path gathered from their pages into its dense copy (of `decode_rows`): every
    # one of a chunk whose rows or width changed, else only those holding new sequences (`Stream._dense`)
    dense_row_gathers: int = 0
    preemptions: int = 0  # sequences preempted and restarted (optimistic admission, a fixed pool running short)


class Engine:
    """See the module docstring. `num_slots`: all ranks' slots (a multiple of `ranks`). `num_pages` fixes
    each rank's pool (requests wait for pages; a prompt that cannot fit alone is refused); None lets
    them grow. `attention`: the paged-attention path (`marljax.sampling.engine.paged_attention.PAGED_ATTENTIONS`;
    auto: the TPU kernel on a TPU). `admission` (`marljax.sampling.engine.scheduler.ADMISSIONS`): what a request must
    find free to be admitted, its worst case or its first chunk (optimistic: a pool sized by the tokens in
    flight, preempting the latest requests when it runs short; a growable pool grows instead)."""

    def __init__(self, model: Decoder, *, num_slots: int = NUM_SLOTS, page_size: int = 16,
                 num_pages: int | None = None, chunk_steps: int = CHUNK_STEPS, share_prefixes: bool = True,
                 attention: str = "auto", prefill_tokens: int | None = None, ranks: int = 1,
                 admission: str = "worst_case", length_groups: int = 1):
        if min(num_slots, page_size, chunk_steps, ranks, length_groups) < 1:
            raise ValueError(f"num_slots={num_slots}, page_size={page_size}, chunk_steps={chunk_steps}, "
                             f"ranks={ranks} and length_groups={length_groups} must be ≥ 1.")
        if admission not in ADMISSIONS:
            raise ValueError(f"admission {admission!r}; choose from {ADMISSIONS}.")
        if num_slots % ranks:
            raise ValueError(f"num_slots={num_slots} is not a multiple of ranks={ranks}: every rank needs as many "
                             "slots.")
        if prefill_tokens is not None and prefill_tokens < PREFILL_CHUNK_MIN:
            raise ValueError(f"prefill_tokens={prefill_tokens}: a prefill call needs at least "
                             f"{PREFILL_CHUNK_MIN} positions (None: one call per admission).")
        self.model, self.num_slots, self.page_size = model, num_slots, page_size
        self.num_pages, self.chunk_steps, self.share_prefixes = num_pages, chunk_steps, share_prefixes
        self.attention, self.prefill_tokens, self.ranks = attention, prefill_tokens, ranks
        self.admission, self.length_groups = admission, length_groups
        self.graphdef, self.state = nnx.split(model)
        self.stats = EngineStats()
        self._spare = None  # a pool no stream holds, reused by the next one

    def stream(self, params: SamplingParams, *, layers: list[dict] | None = None,
               adapters: Sequence[dict] | None = None, lora_scale: float = 1.0) -> Stream:
        """A stream decoding with `params`' settings (its seed is unused: requests bring their keys) and
        `layers` (per-layer weights, `marljax.sampling.layer_weights`: a LoRA adapter folded in; else the
        model's own). With `adapters` (G LoRA adapters of one format), every request names its set
        (`submit(..., group=g)`) and one batch mixes them: each row adds its own adapter's
        lora_scale·(x A) B to the shared `layers` (`Decoder.hidden`'s `lora_groups`), no merged copy per
        set. The adapters' ragged matmul needs each group's rows contiguous: with rank blocks, the groups
        are (rank, set), the adapters stacked once per rank (`batch.block_groups`)."""
        return Stream(self, params, self.model.layer_list() if layers is None else layers,
                      None if adapters is None else stack_adapters(adapters), lora_scale)

    def generate(self, prompts: list[list[int]], params: SamplingParams, *, layers: list[dict] | None = None
                 ) -> SampleOutput:
        """Sample a continuation of every prompt (see the module docstring)."""
        if not prompts:
            return SampleOutput([], [], [])
        if any(len(p) == 0 for p in prompts):
            raise ValueError("generate() got an empty prompt; every prompt needs at least one token.")
        run = self.stream(params, layers=layers)
        base = jax.random.key(params.seed)
        keys_qu = np.asarray(jax.random.key_data(jax.vmap(lambda i: jax.random.fold_in(base, i))(
            jnp.arange(len(prompts)))))
        try:
            for p, k in zip(prompts, keys_qu):
                run.submit(p, k)
            while not run.idle:
                run.step()
        finally:
            run.close()
        self.stats = run.stats
        s = run.sched
        return SampleOutput(tokens=s.tokens, logprobs=s.logprobs, finished=s.hit)

    def prefill(self, pages, layers, prefixes, lora):
        """Write each prompt's KV into its prefix's pages: the pool, the prompts' last hidden states [n, D]
        (in `prefixes`' order) and the number of jitted calls. Rows in rank blocks (each prefix in its
        rank's block, the rest idle on the null page); `lora`: the stream's stacked adapters, rows sorted
        by set (one rank). Chunked prefill (`prefill_tokens`): one call per chunk of positions, each
        attending the pages the chunks before it wrote, so a call holds rows × chunk tokens however long
        the prompts are."""
        order = sorted(range(len(prefixes)), key=lambda i: (prefixes[i].rank, prefixes[i].group))
        at, per_rank = rank_rows([prefixes[i].rank for i in order], self.ranks)
        n, row = self.ranks * per_rank, np.zeros(len(prefixes), np.int64)  # row[i]: prefixes[i]'s row
        row[order] = at
        ps = self.page_size
        rows = [None] * n  # the prefix of each row (None: idle)
        for i, p in enumerate(prefixes):
            rows[row[i]] = p
        start = [p.cached * ps if p else 0 for p in rows]  # tokens found in the prefix cache: not prefilled again
        todo = [len(p.prompt) - s if p else 0 for p, s in zip(rows, start)]
        T = bucket(max(todo), PREFILL_CHUNK_MIN)
        C = prefill_chunk(self.prefill_tokens, n, T)
        width = page_bucket(pages_for(max(start) + T, ps))
        table_bw = np.zeros((n, width), np.int32)
        for i, p in enumerate(rows):
            if p is not None:
                own = p.full_pages + ([p.partial_page] if p.partial_page is not None else [])
                table_bw[i, : len(own)] = own
        if lora is not None:
            num_sets = jax.tree.leaves(lora["lora"])[0].shape[0] // self.ranks
            lora = {**lora, "lora_groups": block_groups([(p.rank, p.group) for p in prefixes], self.ranks, per_rank,
                                                         num_sets)}
        hidden_be, starts = None, range(0, max(todo), C)
        for c0 in starts:
            tokens_bc = np.zeros((n, C), np.int32)
            start_b = np.zeros(n, np.int32)
            last_b = np.zeros(n, np.int32)
            ends_here = np.zeros(n, bool)  # rows whose last prompt token is in this chunk
            for i, (p, s, m) in enumerate(zip(rows, start, todo)):
                if p is None:
                    continue
                part = p.prompt[s + c0: s + min(m, c0 + C)]
                tokens_bc[i, : len(part)] = part
                start_b[i] = s + c0
                ends_here[i] = c0 <= m - 1 < c0 + C
                last_b[i] = min(max(m - 1 - c0, 0), C - 1)
            batch = PrefillBatch(tokens_bt=tokens_bc, start_b=start_b, table_bw=table_bw, last_b=last_b)
            pages, h_be = prefill_program(self.graphdef, self.state, layers, pages, batch, lora,
                                          attention=self.attention)
            hidden_be = h_be if hidden_be is None else jnp.where(ends_here[:, None], h_be, hidden_be)
        return pages, hidden_be[row], len(starts)

    def release(self) -> None:
        """Free the pool kept for the next stream (`take_pool`), its device buffers at once (not when Python
        collects them): for a caller that runs other work between its sampling calls and needs the memory
        more than the allocation it saves (the trainer's update after a rollout)."""
        _delete(self._spare)
        self._spare = None

    @property
    def spare_pages(self) -> int | None:
        """Pages per rank of the pool kept for the next stream (`keep_pool`), None when none is kept."""
        return None if self._spare is None else pool_pages(self._spare)

    def keep_pool(self, pages: list[dict]) -> None:
        """Keep a stream's page pool (its KV no longer read) for the engine's next stream (`take_pool`)."""
        self._spare = pages

    def take_pool(self, num_pages: int) -> list[dict]:
        """A page pool of `num_pages` pages per rank for a new stream: the kept one if it is that size,
        else a fresh one (the kept one dropped)."""
        spare, self._spare = self._spare, None
        if spare is not None and pool_pages(spare) == num_pages:
            return spare
        return init_pages(self.model.config, num_pages, self.page_size, ranks=self.ranks)


class Stream:
    """Requests decoding on one engine with fixed weights and sampling settings (module docstring)."""

    def __init__(self, engine: Engine, params: SamplingParams, layers: list[dict], lora: dict | None,
                 lora_scale: float):
        self.engine, self.params, self.layers = engine, params, layers
        num_groups = 1 if lora is None else jax.tree.leaves(lora)[0].shape[0]
        self.lora = None if lora is None else {  # one copy per rank block (`batch.block_groups`), on its shard
            "lora": jax.tree.map(lambda x: sharding.constrain(jnp.tile(x, (engine.ranks,) + (1,) * (x.ndim - 1)),
                                                              ("batch",) + (None,) * (x.ndim - 1)), lora),
            "lora_scale": jnp.float32(lora_scale)}
        cfg, ps = engine.model.config, engine.page_size
        self.growable = not engine.num_pages
        spare = engine.spare_pages or 2
        self.pools = [PagePool(engine.num_pages or spare) for _ in range(engine.ranks)]  # one per rank
        self.pages = engine.take_pool(self.num_pages)
        self.sched = Scheduler(self.pools, engine.num_slots, ps, params.max_new_tokens, engine.share_prefixes,
                               num_groups, engine.admission, engine.chunk_steps, stable=lora is None)
        self.dense, self.dense_seqs = None, []  # the chunk path's dense caches and the sequence of each row
        self.keys_qu = np.zeros((0, 0), np.uint32)
        self.stops = tuple(sorted(set(params.stop_token_ids))) or (-1,)
        self.sampling = dict(temperature=float(params.temperature), top_p=float(params.top_p),
                             top_k=int(params.top_k))
        self.stats = EngineStats(pool_bytes=engine.ranks * self.num_pages * page_bytes(cfg, ps))

    @property
    def num_pages(self) -> int:
        """Pages of each rank's pool (the null page included)."""
        return self.pools[0].num_pages

    @property
    def idle(self) -> bool:
        return self.sched.idle

    def submit(self, prompt: list[int], key, group: int = 0) -> int:
        """Queue one request of parameter set `group` (with `adapters`; else 0) drawn with `key` (a typed
        PRNG key or its raw key data); returns its id (0, 1, … in submission order)."""
        cfg, max_new = self.engine.model.config, self.params.max_new_tokens
        if not prompt:
            raise ValueError("submit() got an empty prompt; every prompt needs at least one token.")
        if len(prompt) + max_new > cfg.max_position:
            raise ValueError(f"prompt ({len(prompt)} tokens) + max_new_tokens ({max_new}) exceeds the model's "
                             f"max_position {cfg.max_position}.")
        need = self.sched.worst_pages(len(prompt))
        if not self.growable and need > self.num_pages - 1:
            raise ValueError(f"a prompt of {len(prompt)} tokens + max_new_tokens {max_new} needs {need} pages of "
                             f"{self.engine.page_size}; a rank's pool has {self.num_pages - 1}.")
        if isinstance(key, jax.Array) and jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
            key = jax.random.key_data(key)
        key = np.asarray(key, np.uint32)
        if len(self.keys_qu) == self.sched.submitted:
            grown = np.zeros((max(8, 2 * len(self.keys_qu)), key.size), np.uint32)
            if len(self.keys_qu):
                grown[: len(self.keys_qu)] = self.keys_qu
            self.keys_qu = grown
        self.keys_qu[self.sched.submitted] = key
        return self.sched.submit(prompt, group)

    def result(self, request: int) -> tuple[list[int], list[float], bool]:
        """A request's generated ids, their logprobs, and whether it hit a stop token."""
        s = self.sched
        return s.tokens[request], s.logprobs[request], s.hit[request]

    def step(self) -> list[int]:
        """Admit, prefill and decode one chunk (module docstring); the ids of the requests that finished."""
        e, sched, stats = self.engine, self.sched, self.stats
        if self.growable:
            self._grow(sched.demand())
        adm = sched.admit()
        if adm.prefill:
            self.pages, hidden_be, calls = e.prefill(self.pages, self.layers, adm.prefill, self.lora)
            for i, prefix in enumerate(adm.prefill):
                prefix.hidden = hidden_be[i]
            sched.prefilled(adm.prefill)
            stats.prefill_calls += calls
        if adm.copy_src:  # in rank blocks, padded with null-page-onto-itself copies (few compiles)
            at, n = rank_rows(adm.copy_rank, e.ranks)
            src, dst = np.full((2, e.ranks * n), NULL_PAGE, np.int32)
            src[at], dst[at] = adm.copy_src, adm.copy_dst
            self.pages = copy_pages(self.pages, src, dst)
        if adm.members:
            rows = bucket(len(adm.members))
            hidden_be = jnp.stack([seq.prefix.hidden for _, seq in adm.members]
                                  + [adm.members[0][1].prefix.hidden] * (rows - len(adm.members)))
            req = np.zeros(rows, np.int32)
            req[: len(adm.members)] = [seq.request for _, seq in adm.members]
            tok, logp = _first_tokens(e.graphdef, e.state, hidden_be, self.keys_qu[req], **self.sampling)
            sched.started(adm.members, np.asarray(tok), np.asarray(logp), set(self.params.stop_token_ids))
        if sched.running:
            width = page_bucket(sched.grow(e.chunk_steps))
            b = sched.batch(width)
            rows = b.rows
            lora = None if self.lora is None else {**self.lora, "lora_groups": b.lora_groups}
            order, widths, dense, table = None, None, None, b.table_bw
            if resolve_paged_attention(e.attention) in CHUNK_PATHS:
                order, widths = length_groups(b.held_b, e.ranks, e.length_groups)
                if len(widths) == 1:
                    dense, table = self._dense(b)
                    widths = (table.shape[1],)
                else:
                    self.dense = None
                held = rows // len(widths) * sum(widths) * page_bytes(e.model.config, e.page_size)
                stats.peak_dense_bytes = max(stats.peak_dense_bytes, held)
            if table is not b.table_bw:
                b = b.replace(table_bw=table)
            self.pages, self.dense, out = decode_chunk(
                e.graphdef, e.state, self.layers, self.pages, dense, b, self.keys_qu[b.request_b],
                jnp.int32(self.params.max_new_tokens), lora, order, steps=e.chunk_steps, stops=self.stops,
                attention=e.attention, widths=widths, **self.sampling)
            out = to_host(out)
            stats.decode_chunks += 1
            stats.decode_rows += len(sched.rows)
            stats.decode_steps += int(out.step) * rows
            sched.advance(out)
            if not sched.running:  # an idle stream holds no dense copy (streams of other sets may step now)
                self.dense = None
        cfg = e.model.config
        stats.prefill_tokens = sched.prefill_tokens
        stats.cached_tokens = sched.cached_tokens
        stats.preemptions = sched.preemptions
        stats.generated_tokens = sum(len(t) for t in sched.tokens)
        stats.peak_pages = sum(pool.peak_in_use for pool in self.pools)
        stats.peak_kv_bytes = stats.peak_pages * page_bytes(cfg, e.page_size)
        stats.pool_bytes = e.ranks * self.num_pages * page_bytes(cfg, e.page_size)
        return sched.take_finished()

    def close(self, *, release: bool = False) -> None:
        """The stream is done: its dense caches are freed and its pool handed back to the engine for the next
        stream, or with `release` freed too (`Engine.release`). Idempotent."""
        _delete(self.dense)
        if self.pages is not None:
            self.engine.keep_pool(self.pages)
        self.pages, self.dense, self.layers, self.lora = None, None, None, None
        if release:
            self.engine.release()

    def _dense(self, b: DecodeBatch) -> tuple[list[dict], np.ndarray]:
        """The chunk path's dense caches for decode batch `b` (`scheduler.batch`, rows in place) and the
        page table they stand for. The last chunk's caches are kept where the rows are as many and the
        width is enough (the width never shrinks then: a narrower one would gather every row again), and
        only the rows that hold a new sequence are gathered into them (`refresh_dense`; the scheduler's
        stable rows keep the others in place); else every row is gathered anew (`gather_dense`)."""
        table = b.table_bw
        rows, width = table.shape
        seqs = [None] * rows
        for r, s in self.sched.rows:
            seqs[r] = self.sched.table.slots[s]
        dense, self.dense = self.dense, None
        kept = 0 if dense is None else dense[0]["k"].shape[-1] // self.engine.page_size
        if dense is not None and dense[0]["k"].shape[0] == rows and kept >= width:
            table = np.pad(table, ((0, 0), (0, kept - width)), constant_values=NULL_PAGE)
            fresh = [r for r, q in enumerate(seqs) if q is not None and q is not self.dense_seqs[r]]
            if fresh:  # in rank blocks (`refresh_dense`), padded with rows past the block (dropped)
                per = rows // self.engine.ranks
                at, n = rank_rows([r // per for r in fresh], self.engine.ranks)
                fresh_b = np.full(self.engine.ranks * n, per, np.int32)
                fresh_b[at] = [r % per for r in fresh]
                fresh_bw = np.full((self.engine.ranks * n, kept), NULL_PAGE, np.int32)
                fresh_bw[at] = table[fresh]
                dense = refresh_dense(dense, self.pages, fresh_b, fresh_bw)
        else:
            dense = None  # freed before its successor is gathered
            fresh = [r for r, q in enumerate(seqs) if q is not None]
            dense = gather_dense(self.pages, table)
        self.stats.dense_row_gathers += len(fresh)
        self.dense_seqs = seqs
        return dense, table

    def _grow(self, pages_needed: int) -> None:
        """Grow every rank's pool to hold `pages_needed` besides the null page: to a `shapes.bucket_rows` size
        (eight per doubling: under 12.5% over the need above 128 pages, where a power of two wastes up to
        half the pool) and by at least a quarter (each size is a copy of the pool and a compile)."""
        if pages_needed + 1 <= self.num_pages:
            return
        n = bucket_rows(max(pages_needed + 1, self.num_pages * 5 // 4))
        self.pages = grow_pages(self.pages, n - self.num_pages)
        for pool in self.pools:
            pool.grow(n)


def _delete(tree) -> None:
    """Free the device buffers of `tree`'s arrays now (they must not be read again)."""
    for x in jax.tree.leaves(tree):
        if isinstance(x, jax.Array) and not x.is_deleted():
            x.delete()


def prefill_chunk(budget: int | None, rows: int, length: int) -> int:
    """Positions per prefill call for `rows` prompt rows whose longest part to prefill is `length` (both
    bucketed): all of it, or under a `budget` of positions per call the largest power of two
    ≥ PREFILL_CHUNK_MIN with rows × chunk ≤ budget (PREFILL_CHUNK_MIN when even that is over)."""
    if budget is None:
        return length
    return min(length, max(PREFILL_CHUNK_MIN, 1 << (budget // rows).bit_length() - 1))


@functools.partial(jax.jit, static_argnums=0, donate_argnums=3, static_argnames="attention")
def prefill_program(graphdef, state, layers, pages, batch: PrefillBatch, lora, *, attention="auto"):
    """Row i's tokens at positions batch.start_b[i] …, attending its pages before them too (a cached
    prefix), written into `pages`; the new pages and the hidden state at row i's token batch.last_b[i]."""
    model = nnx.merge(graphdef, state)
    n, T = batch.tokens_bt.shape
    positions_bt = batch.start_b[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    h_bte, pages = model.hidden(batch.tokens_bt, positions_bt, cache=pages, layers=layers,
                                cache_attention=paged_cache_attention(batch.table_bw, attention), **(lora or {}))
    return pages, jnp.take_along_axis(h_bte, batch.last_b[:, None, None], axis=1)[:, 0]


@functools.partial(jax.jit, static_argnums=0, static_argnames=("temperature", "top_p", "top_k"))
def _first_tokens(graphdef, state, hidden_be, keys_bu, *, temperature, top_p, top_k):
    model = nnx.merge(graphdef, state)
    return sharding.replicate(sample_rows(model.logits(hidden_be), keys_bu, jnp.zeros(hidden_be.shape[0], jnp.int32),
                                          temperature, top_p, top_k))  # the host reads them: on every host


@functools.partial(jax.jit, static_argnums=0, donate_argnums=(3, 4),
                   static_argnames=("steps", "temperature", "top_p", "top_k", "stops", "attention", "widths"))
def decode_chunk(graphdef, model_state, layers, pages, dense, batch: DecodeBatch, keys_bu, max_new, lora, order_b, *,
                 steps, temperature, top_p, top_k, stops, attention="auto", widths=None):
    """Up to `steps` decode steps over the rows of `batch` (`Scheduler.batch`; fewer steps when all rows
    are done), carrying one `DecodeState`. A row stops on a stop token or at max_new tokens; a done row
    keeps rewriting its last position with the token it read there (inside its own pages), so it never
    writes past what the scheduler gave it. `keys_bu`: each row's request key. `lora`: None, or the
    stream's stacked adapters with the rows of each set ({"lora", "lora_scale", "lora_groups"}). The
    chunk path: with one length group, `dense` (the rows' dense caches, `Stream._dense`; returned
    updated, for the next chunk); else the groups (`paged_attention.length_groups`: rows `order_b`,
    page-table `widths`) gathered here. Returns (pages, dense, the final state without its `kv`)."""
    model = nnx.merge(graphdef, model_state)
    stop_ids = jnp.asarray(stops, jnp.int32)
    path = resolve_paged_attention(attention)
    chunk = path in CHUNK_PATHS
    if chunk:
        groups = _chunk_groups(model.config, pages, dense, batch, order_b, steps, widths)
        kv = groups.kv
    else:
        kv = pages

    def cond(s: DecodeState):
        return (s.step < steps) & ~jnp.all(s.done_b)

    def body(s: DecodeState) -> DecodeState:
        if chunk:
            attend = chunk_cache_attention(groups.rows, batch.pos_b, s.step, kernel=path == "cpu_kernel")
            cache = [{"dense": d, "new": new} for d, new in zip(groups.caches, s.kv)]
        else:
            attend, cache = paged_cache_attention(batch.table_bw, attention), s.kv
        h, kv = model.hidden(s.token_b[:, None], s.pos_b[:, None], cache=cache, layers=layers,
                             cache_attention=attend, **(lora or {}))
        tok, logp = sample_rows(model.logits(h[:, 0]), keys_bu, s.n_gen_b, temperature, top_p, top_k)
        active = ~s.done_b
        hit = active & jnp.isin(tok, stop_ids)
        n_gen = s.n_gen_b + active
        done = s.done_b | hit | (n_gen >= max_new)
        return DecodeState(step=s.step + 1, kv=[layer["new"] for layer in kv] if chunk else kv,
                           token_b=jnp.where(done, s.token_b, tok), pos_b=s.pos_b + ~done, n_gen_b=n_gen,
                           hit_b=s.hit_b | hit, done_b=done,
                           tok_bc=s.tok_bc.at[:, s.step].set(jnp.where(active, tok, 0)),
                           logp_bc=s.logp_bc.at[:, s.step].set(jnp.where(active, logp, 0.0)))

    s = jax.lax.while_loop(cond, body, DecodeState.start(batch, kv, steps))
    if chunk:  # the buffers' writes into the pages (and into `dense`, for the next chunk)
        pages, dense = _chunk_write_back(pages, groups, s, batch.pos_b, steps, len(widths) == 1)
    else:
        pages, dense = s.kv, None
    return pages, dense, sharding.replicate(s.replace(kv=None))  # the host reads it: on every host


@dataclasses.dataclass(frozen=True)
class _ChunkGroups:
    """The chunk path's length groups in one decode chunk: each group's rows and page table, its dense
    caches per layer, and each group's buffer of the chunk's new keys and values per layer (`kv`)."""

    rows: list
    tables: list
    caches: list
    kv: list


def _chunk_groups(config, pages, dense, batch: DecodeBatch, order_b, steps: int, widths) -> _ChunkGroups:
    """`decode_chunk`'s groups on the chunk path: one group of the rows in place (their caches `dense`,
    kept from chunk to chunk), or the length groups (rows `order_b`, tables `widths` wide) gathered."""
    B = batch.token_b.shape[0]
    if len(widths) == 1:
        rows, tables, caches = [slice(None)], [batch.table_bw], [[layer] for layer in dense]
        sizes = [B]
    else:
        n = B // len(widths)
        rows = [order_b[g * n: (g + 1) * n] for g in range(len(widths))]
        tables = [batch.table_bw[r, :w] for r, w in zip(rows, widths)]
        caches = [[dense_cache(layer["kv"], table) for table in tables] for layer in pages]
        sizes = [n] * len(widths)
    kv = [list(g) for g in zip(*[init_dense(config, m, steps, pages[0]["kv"].dtype) for m in sizes])]
    return _ChunkGroups(rows=rows, tables=tables, caches=caches, kv=kv)


def _chunk_write_back(pages, groups: _ChunkGroups, s: DecodeState, pos_b, steps: int, in_place: bool):
    """The chunk's new keys and values (`s.kv`) written into the pages, and with the rows in place into
    their dense caches too (for the next chunk): (pages, dense or None)."""
    last_b = jnp.where(s.done_b, s.pos_b, s.pos_b - 1)  # a running row's last write: one before its next
    new_pages, new_dense = [], []
    for layer, caches_l, kv_l in zip(pages, groups.caches, s.kv):
        pool = layer["kv"]
        for rows, table, cache, new in zip(groups.rows, groups.tables, caches_l, kv_l):
            k_btkd, v_btkd, at_bt = chunk_writes(new, pos_b[rows], last_b[rows], steps)
            pool = write_pages(pool, interleave(k_btkd, v_btkd), table, at_bt)
            if in_place:
                new_dense.append(write_dense(cache, k_btkd, v_btkd, at_bt))
        new_pages.append({"kv": pool})
    return new_pages, new_dense or None


# The decode chunk under the name `marljax.aot` compiles it by (beside `prefill_program`).
decode_program = decode_chunk
