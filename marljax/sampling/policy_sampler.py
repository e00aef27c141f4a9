"""Sampling from a policy's parameter sets on the rollout engine (what the entry points wrap into a
workflow's sampler).

`PolicySampler` holds the frozen base, the per-set weights ({set: LoRA adapter}, or {set: whole model
state} under full fine-tuning), the mesh and the sampling settings. A set's adapter is folded into one
per-layer copy of the weights (`sampling.layer_weights`), made once per call or stream and read by
every decode chunk: decoding then costs the base's matmuls only, and the engine's jits do not recompile
per set. `sample` is one batch call; `stream` takes requests of any set as they come (`PolicyStream`).
The engine keeps one page pool per batch rank of the mesh (`sharding.batch_ranks`: each chip holds its
own rows' pages), so `num_slots` and `max_cache_tokens` are per rank: a rank decodes `num_slots`
sequences at once and its pool holds `max_cache_tokens` KV positions (0: the pools grow as needed).
With `mix_sets` the rows of every LoRA set decode in one batch, each applying its own adapter (per rank
block, `engine.batch.block_groups`).
"""
from __future__ import annotations

import dataclasses

import jax
from flax import nnx

from marljax.core import sharding
from marljax.models.decoder import Decoder
from marljax.sampling import SampleOutput, SamplingParams, layer_weights
from marljax.sampling.engine import Engine
from marljax.sampling.engine.engine import CHUNK_STEPS, NUM_SLOTS, Stream

PAGE_SIZE = 16  # KV positions per page


@dataclasses.dataclass(frozen=True)
class SamplerSettings:
    """Sampling settings every call shares (the temperature is per call)."""

    max_new_tokens: int
    top_p: float
    top_k: int
    stop_token_ids: tuple[int, ...]
    max_cache_tokens: int  # KV positions each batch rank's page pool holds; 0: grows as needed
    num_slots: int = NUM_SLOTS  # sequences each batch rank decodes at once
    prefill_tokens: int = 0  # positions per prefill call (chunked prefill); 0: whole prompts
    chunk_steps: int = CHUNK_STEPS  # decode steps per jitted chunk of the engine
    mix_sets: bool = False  # LoRA sets decode in one batch, each row applying its own adapter
    paged_attention: str = "auto"  # the engine's path (marljax.sampling.engine.paged_attention.PAGED_ATTENTIONS)
    admission: str = "worst_case"  # the engine's admission (marljax.sampling.engine.scheduler.ADMISSIONS)

    def params(self, temperature: float, seed: int = 0) -> SamplingParams:
        return SamplingParams(max_new_tokens=self.max_new_tokens, temperature=temperature, top_p=self.top_p,
                              top_k=self.top_k, stop_token_ids=self.stop_token_ids, seed=seed)


class PolicySampler:
    """Samples continuations from the parameter set a role is routed to.

    `params_by_set`: {set: LoRA adapter} when `lora_scale` is a float, {set: the model's `nnx.Param`
    state} under full fine-tuning (`lora_scale` None). `mesh`, `rules`: where the weights live (see
    `marljax.core.sharding`)."""

    def __init__(self, model: Decoder, params_by_set: dict, lora_scale: float | None, mesh, rules,
                 settings: SamplerSettings):
        self.model = model
        self.params_by_set = params_by_set
        self.lora_scale = lora_scale
        self.mesh, self.rules = mesh, rules
        self.settings = settings
        self.engines: dict[str, Engine] = {}

    def engine(self, set_name: str) -> Engine:
        """The engine set `set_name` decodes on: the base's, shared by every LoRA set; under full
        fine-tuning one per set (its embeddings, norms and head are trained too). One page pool per
        batch rank of the mesh."""
        key = set_name if self.lora_scale is None else ""
        if key not in self.engines:
            model = self.model if self.lora_scale is not None else nnx.merge(
                nnx.graphdef(self.model), self.params_by_set[set_name])
            st = self.settings
            ranks = sharding.batch_ranks(self.mesh, self.rules)
            self.engines[key] = Engine(model, num_slots=ranks * st.num_slots, page_size=PAGE_SIZE, ranks=ranks,
                                       num_pages=st.max_cache_tokens // PAGE_SIZE + 1 if st.max_cache_tokens else None,
                                       prefill_tokens=st.prefill_tokens or None, attention=st.paged_attention,
                                       admission=st.admission, chunk_steps=st.chunk_steps)
        return self.engines[key]

    def sample(self, set_name: str, prompts: list[list[int]], seed: int, temperature: float) -> SampleOutput:
        """One sample per prompt from set `set_name`'s weights at `temperature`; prompt i draws from
        fold_in(key(seed), i) (`Engine.generate`)."""
        with sharding.use_mesh(self.mesh, self.rules):
            return self.engine(set_name).generate(prompts, self.settings.params(temperature, seed),
                                                  layers=self.weights(set_name))

    def release(self) -> None:
        """Free every engine's spare page pool (`Engine.release`)."""
        for engine in self.engines.values():
            engine.release()

    def stream(self, temperature: float) -> PolicyStream:
        """Requests of any set at `temperature`, decoded as they come."""
        return PolicyStream(self, temperature)

    def weights(self, set_name: str) -> list[dict]:
        """Set `set_name`'s per-layer weights for the engine (its LoRA folded into the base)."""
        with sharding.use_mesh(self.mesh, self.rules):
            if self.lora_scale is not None:
                return layer_weights(self.model, self.params_by_set[set_name], self.lora_scale)
            return layer_weights(self.engine(set_name).model)


class PolicyStream:
    """Requests from any parameter set, each decoded from the moment it is submitted: one engine stream
    per set (its folded weights), the busy ones stepped in turn, a decode chunk each, until some request
    is done; or, with `mix_sets` (LoRA), one stream whose rows each apply their own set's adapter to the
    base. A request drawn with `seed` gives the same output whatever else is in flight (up to float
    rounding between the two modes: merged weights vs the adapter applied per row)."""

    def __init__(self, sampler: PolicySampler, temperature: float):
        self.sampler, self.params = sampler, sampler.settings.params(temperature)
        self.streams: dict[str, Stream] = {}
        self.tickets: dict[tuple[str, int], int] = {}
        self.calls = 0  # decode rounds (one engine step of one set)
        self.submitted = 0

    def submit(self, set_name: str, prompt: list[int], seed: int) -> int:
        """Queue one request of set `set_name` drawn from key(seed); returns its ticket."""
        sampler = self.sampler
        mixed = sampler.settings.mix_sets and sampler.lora_scale is not None
        name, group = ("", sorted(sampler.params_by_set).index(set_name)) if mixed else (set_name, 0)
        if name not in self.streams:
            with sharding.use_mesh(sampler.mesh, sampler.rules):
                if mixed:
                    self.streams[name] = sampler.engine(set_name).stream(
                        self.params, adapters=[sampler.params_by_set[s] for s in sorted(sampler.params_by_set)],
                        lora_scale=sampler.lora_scale)
                else:
                    self.streams[name] = sampler.engine(set_name).stream(self.params,
                                                                         layers=sampler.weights(set_name))
        ticket = self.submitted
        self.submitted += 1
        self.tickets[(name, self.streams[name].submit(prompt, jax.random.key(seed), group))] = ticket
        return ticket

    def poll(self) -> list[tuple[int, tuple[list[int], list[float], bool]]]:
        """Step the busy streams until at least one request is done; (ticket, (tokens, logprobs, hit stop))
        of each done one. Empty when nothing is queued."""
        done = []
        with sharding.use_mesh(self.sampler.mesh, self.sampler.rules):
            while not done and any(not s.idle for s in self.streams.values()):
                for set_name, stream in self.streams.items():
                    if stream.idle:
                        continue
                    self.calls += 1
                    done += [(self.tickets.pop((set_name, r)), stream.result(r)) for r in stream.step()]
        return done

    def close(self, *, release: bool = False) -> None:
        """Hand the streams' pools back to their engines, or with `release` free them (and every pool the
        engines keep) before other work needs the memory. Idempotent."""
        for stream in self.streams.values():
            stream.close()
        self.streams = {}
        if release:
            self.sampler.release()
