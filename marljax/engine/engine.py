"""The rollout engine: continuous batching over decode slots with a paged KV cache.

`Engine(model, num_slots=…).generate(prompts, SamplingParams(…), layers=…)` returns what
`marljax.sampling.generate` returns (`SampleOutput`: per prompt its generated ids, stop token included
if hit, their logprobs under the tempered distribution they were drawn from, and whether a stop hit).
The host loop: admit waiting requests into free slots (`Scheduler.admit`), prefill the new prompts into
their pages (once per distinct prompt when prefixes are shared), draw each newcomer's first token, then
run one jitted chunk of `chunk_steps` decode steps over the running sequences; repeat until every
request is done.

Shapes are static per chunk and bucketed to powers of two: prefill rows and prompt length, the decode
rows (the running sequences, at most `num_slots`: the tail of a call runs at a small batch) and the
page-table width in pages (attention reads the pages in flight, rounded up); a run compiles a handful
of times.

Randomness is per request, not per batch: request i of a call draws its t-th token with
fold_in(fold_in(key(seed), i), t), whatever else is in flight, so outputs do not depend on the slot
count, the chunk length, or the other prompts (a prompt's output changes only with its index or seed).
Seeded samples therefore differ from `marljax.sampling.generate`'s (one draw for the whole batch per
step); greedy outputs are the same.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from marljax.engine.kv_pages import PagePool, copy_pages, init_pages, page_bytes, pages_for, pool_pages
from marljax.engine.paged_attention import paged_cache_attention
from marljax.engine.scheduler import Scheduler
from marljax.models.decoder import Decoder
from marljax.sampling import SampleOutput, SamplingParams, choose
from marljax.shapes import bucket


@dataclasses.dataclass
class EngineStats:
    """Work and memory of the last `generate` call."""

    prefill_tokens: int = 0  # real prompt tokens prefilled (a shared prompt counts once)
    prefill_calls: int = 0
    decode_chunks: int = 0
    decode_steps: int = 0  # row-steps run (a chunk's rows: the running sequences rounded up)
    generated_tokens: int = 0
    peak_pages: int = 0  # most pages in use at once (the tokens in flight)
    peak_kv_bytes: int = 0  # peak_pages × bytes of a page across layers
    pool_bytes: int = 0  # the page pool as allocated


class Engine:
    """See the module docstring. `num_pages` sizes the pool (0 or None: enough for every slot's worst
    case in each call, plus one page per prompt for shared prefixes). `attention`: the paged-attention
    path (`marljax.engine.paged_attention.PAGED_ATTENTIONS`; auto: the TPU kernel on a TPU)."""

    def __init__(self, model: Decoder, *, num_slots: int = 64, page_size: int = 16, num_pages: int | None = None,
                 chunk_steps: int = 16, share_prefixes: bool = True, attention: str = "auto"):
        if num_slots < 1 or page_size < 1 or chunk_steps < 1:
            raise ValueError(f"num_slots={num_slots}, page_size={page_size} and chunk_steps={chunk_steps} "
                             "must be ≥ 1.")
        self.model, self.num_slots, self.page_size = model, num_slots, page_size
        self.num_pages, self.chunk_steps, self.share_prefixes = num_pages, chunk_steps, share_prefixes
        self.attention = attention
        self.graphdef, self.state = nnx.split(model)
        self.stats = EngineStats()
        self._pages = None

    def _pool(self, num_pages: int) -> list[dict]:
        if self._pages is None or pool_pages(self._pages) != num_pages:
            self._pages = init_pages(self.model.config, num_pages, self.page_size)
        return self._pages

    def generate(self, prompts: list[list[int]], params: SamplingParams, *, layers: list[dict] | None = None
                 ) -> SampleOutput:
        """Sample a continuation of every prompt (see the module docstring). `layers`: per-layer weights
        (`marljax.sampling.layer_weights`, a LoRA adapter folded in), else the model's own."""
        if not prompts:
            return SampleOutput([], [], [])
        if any(len(p) == 0 for p in prompts):
            raise ValueError("generate() got an empty prompt; every prompt needs at least one token.")
        cfg = self.model.config
        longest = max(len(p) for p in prompts)
        if longest + params.max_new_tokens > cfg.max_position:
            raise ValueError(f"prompt ({longest} tokens) + max_new_tokens ({params.max_new_tokens}) "
                             f"exceeds the model's max_position {cfg.max_position}.")
        ps, max_new = self.page_size, params.max_new_tokens
        num_pages = self.num_pages or 1 + self.num_slots * pages_for(longest + max_new, ps) + len(prompts)
        pool = PagePool(num_pages)
        pages, self._pages = self._pool(num_pages), None  # donated below; kept again at the end
        sched = Scheduler(pool, self.num_slots, ps, max_new, self.share_prefixes)
        sched.submit(prompts)
        if layers is None:
            layers = self.model.layer_list()
        stops = tuple(sorted(set(params.stop_token_ids))) or (-1,)
        sampling = dict(temperature=float(params.temperature), top_p=float(params.top_p), top_k=int(params.top_k))
        base = jax.random.key(params.seed)
        keys_nk = np.asarray(jax.random.key_data(jax.vmap(lambda i: jax.random.fold_in(base, i))(
            jnp.arange(len(prompts)))))
        stats = EngineStats(pool_bytes=num_pages * page_bytes(cfg, ps))
        while not sched.idle:
            adm = sched.admit()
            if adm.prefill:
                pages, hidden_nd = self._prefill(pages, layers, adm.prefill)
                for i, prefix in enumerate(adm.prefill):
                    prefix.hidden = hidden_nd[i]
                stats.prefill_calls += 1
            if adm.copy_src:
                pages = copy_pages(pages, jnp.asarray(adm.copy_src, jnp.int32), jnp.asarray(adm.copy_dst, jnp.int32))
            if adm.members:
                rows = bucket(len(adm.members))
                hidden_md = jnp.stack([seq.prefix.hidden for _, seq in adm.members]
                                      + [adm.members[0][1].prefix.hidden] * (rows - len(adm.members)))
                req = np.zeros(rows, np.int32)
                req[: len(adm.members)] = [seq.request for _, seq in adm.members]
                tok, logp = _first_tokens(self.graphdef, self.state, hidden_md, keys_nk[req], **sampling)
                sched.started(adm.members, np.asarray(tok), np.asarray(logp), set(params.stop_token_ids))
            if not sched.running:
                continue
            width = bucket(sched.grow(self.chunk_steps))
            rows = min(bucket(len(sched.running)), self.num_slots)
            b = sched.batch(rows, width)
            pages, out = _decode_chunk(self.graphdef, self.state, layers, pages, b["page_table"], b["token"],
                                       b["pos"], b["n_gen"], b["live"], keys_nk[b["request"]],
                                       jnp.int32(max_new), steps=self.chunk_steps, stops=stops,
                                       attention=self.attention, **sampling)
            out = jax.tree.map(np.asarray, out)
            stats.decode_chunks += 1
            stats.decode_steps += int(out["steps"]) * rows
            sched.advance(out["tok"], out["logp"], out["n_gen"], out["token"], out["pos"], out["hit"], out["done"])
        self._pages = pages
        stats.prefill_tokens = sched.prefill_tokens
        stats.generated_tokens = sum(len(t) for t in sched.tokens)
        stats.peak_pages = pool.peak_in_use
        stats.peak_kv_bytes = pool.peak_in_use * page_bytes(cfg, ps)
        self.stats = stats
        return SampleOutput(tokens=sched.tokens, logprobs=sched.logprobs, finished=sched.hit)

    def _prefill(self, pages, layers, prefixes):
        """Write each prompt's KV into its prefix's pages; the prompts' last hidden states [n, D]."""
        n, T = bucket(len(prefixes)), bucket(max(len(p.prompt) for p in prefixes), 16)
        width = pages_for(T, self.page_size)
        tokens_nt = np.zeros((n, T), np.int32)
        table_nw = np.zeros((n, width), np.int32)
        last_n = np.zeros(n, np.int32)
        for i, p in enumerate(prefixes):
            tokens_nt[i, : len(p.prompt)] = p.prompt
            own = p.full_pages + ([p.partial_page] if p.partial_page is not None else [])
            table_nw[i, : len(own)] = own
            last_n[i] = len(p.prompt) - 1
        return _prefill(self.graphdef, self.state, layers, pages, tokens_nt, table_nw, last_n,
                        attention=self.attention)


def sample_rows(logits_bv, keys_bk, n_gen_b, temperature: float, top_p: float, top_k: int):
    """Each row's next token, drawn with its own key folded with its token index, and its logprob
    under the tempered distribution (the raw logits at temperature 0), as `marljax.sampling`."""
    def one(logits_v, key_data, t):
        key = jax.random.fold_in(jax.random.wrap_key_data(key_data), t)
        return choose(logits_v[None], key, temperature, top_p, top_k)[0]

    tok_b = jax.vmap(one)(logits_bv, keys_bk, n_gen_b)
    tempered_bv = logits_bv / temperature if temperature > 0 else logits_bv
    logit_b = jnp.take_along_axis(tempered_bv, tok_b[:, None], 1)[:, 0]
    return tok_b, logit_b - jax.nn.logsumexp(tempered_bv, axis=-1)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=3, static_argnames="attention")
def _prefill(graphdef, state, layers, pages, tokens_nt, table_nw, last_n, *, attention="auto"):
    model = nnx.merge(graphdef, state)
    n, T = tokens_nt.shape
    positions_nt = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (n, T))
    h_ntd, pages = model.hidden(tokens_nt, positions_nt, cache=pages, layers=layers,
                                cache_attention=paged_cache_attention(table_nw, attention))
    return pages, jnp.take_along_axis(h_ntd, last_n[:, None, None], axis=1)[:, 0]


@functools.partial(jax.jit, static_argnums=0, static_argnames=("temperature", "top_p", "top_k"))
def _first_tokens(graphdef, state, hidden_md, keys_mk, *, temperature, top_p, top_k):
    model = nnx.merge(graphdef, state)
    return sample_rows(model.logits(hidden_md), keys_mk, jnp.zeros(hidden_md.shape[0], jnp.int32),
                       temperature, top_p, top_k)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=3,
                   static_argnames=("steps", "temperature", "top_p", "top_k", "stops", "attention"))
def _decode_chunk(graphdef, state, layers, pages, table_sw, token_s, pos_s, n_gen_s, live_s, keys_sk, max_new, *,
                  steps, temperature, top_p, top_k, stops, attention="auto"):
    """Up to `steps` decode steps over every slot (fewer when all are done). A slot stops on a stop token
    or at max_new tokens; a done slot keeps rewriting its last position with the token it read there
    (inside its own pages), so it never writes past what the scheduler gave it."""
    model = nnx.merge(graphdef, state)
    S = token_s.shape[0]
    stop_ids = jnp.asarray(stops, jnp.int32)
    attend = paged_cache_attention(table_sw, attention)

    def cond(carry):
        return (carry["i"] < steps) & ~jnp.all(carry["done"])

    def body(c):
        h, pages = model.hidden(c["token"][:, None], c["pos"][:, None], cache=c["pages"], layers=layers,
                                cache_attention=attend)
        tok, logp = sample_rows(model.logits(h[:, 0]), keys_sk, c["n_gen"], temperature, top_p, top_k)
        active = ~c["done"]
        hit = active & jnp.isin(tok, stop_ids)
        n_gen = c["n_gen"] + active
        done = c["done"] | hit | (n_gen >= max_new)
        return {"i": c["i"] + 1, "pages": pages,
                "tok": c["tok"].at[:, c["i"]].set(jnp.where(active, tok, 0)),
                "logp": c["logp"].at[:, c["i"]].set(jnp.where(active, logp, 0.0)),
                "n_gen": n_gen, "hit": c["hit"] | hit, "done": done,
                "token": jnp.where(done, c["token"], tok), "pos": c["pos"] + ~done}

    carry = {"i": jnp.int32(0), "pages": pages, "tok": jnp.zeros((S, steps), jnp.int32),
             "logp": jnp.zeros((S, steps), jnp.float32), "n_gen": n_gen_s, "hit": jnp.zeros(S, bool),
             "done": ~live_s, "token": token_s, "pos": pos_s}
    c = jax.lax.while_loop(cond, body, carry)
    pages = c.pop("pages")
    c["steps"] = c.pop("i")
    return pages, c
