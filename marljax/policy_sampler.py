"""Sampling from a policy's parameter sets (what the entry points wrap into a workflow's `sample_fn`).

`PolicySampler` holds the frozen base, the per-set weights ({set: LoRA adapter}, or {set: whole model
state} under full fine-tuning), the mesh and the sampling settings. For each call it folds the set's
adapter into one per-layer copy of the weights (`sampling.layer_weights`), which serves every chunk of
the call: decoding then costs the base's matmuls only, and the sampler's jit does not recompile per set.
Prompts are cut into sampler calls of at most `max_cache_tokens` batch × KV length.
"""
from __future__ import annotations

import dataclasses
import numpy as np
from flax import nnx

from marljax import sharding
from marljax.models.decoder import Decoder
from marljax.sampling import SampleOutput, SamplingParams, generate, layer_weights
from marljax.shapes import bucket


@dataclasses.dataclass(frozen=True)
class SamplerSettings:
    """Sampling settings every call shares (the temperature is per call)."""

    max_new_tokens: int
    top_p: float
    top_k: int
    stop_token_ids: tuple[int, ...]
    max_cache_tokens: int  # batch × KV length per sampler call; 0: one call for all prompts


class PolicySampler:
    """Samples continuations from the parameter set a role is routed to.

    `params_by_set`: {set: LoRA adapter} when `lora_scale` is a float, {set: the model's `nnx.Param`
    state} under full fine-tuning (`lora_scale` None). `mesh`, `rules`: where the weights live (see
    `marljax.sharding`)."""

    def __init__(self, model: Decoder, params_by_set: dict, lora_scale: float | None, mesh, rules,
                 settings: SamplerSettings):
        self.model = model
        self.params_by_set = params_by_set
        self.lora_scale = lora_scale
        self.mesh, self.rules = mesh, rules
        self.settings = settings

    def sample(self, set_name: str, prompts: list[list[int]], seed: int, temperature: float) -> SampleOutput:
        """One sample per prompt from set `set_name`'s weights at `temperature` (chunk k > 0 of the call
        draws from a seed derived from (seed, k))."""
        st = self.settings
        model, layers = self.weights(set_name)
        out = SampleOutput([], [], [])
        for k, chunk in enumerate(self.chunks(prompts)):
            chunk_seed = seed if k == 0 else int(np.random.SeedSequence([seed, k]).generate_state(1)[0])
            sp = SamplingParams(max_new_tokens=st.max_new_tokens, temperature=temperature, top_p=st.top_p,
                                top_k=st.top_k, stop_token_ids=st.stop_token_ids, seed=chunk_seed)
            with sharding.use_mesh(self.mesh, self.rules):
                part = generate(model, chunk, sp, layers=layers)
            out.tokens += part.tokens
            out.logprobs += part.logprobs
            out.finished += part.finished
        return out

    def weights(self, set_name: str) -> tuple[Decoder, list[dict]]:
        """(the model to sample, its per-layer weights with the set's LoRA folded in)."""
        with sharding.use_mesh(self.mesh, self.rules):
            if self.lora_scale is not None:
                return self.model, layer_weights(self.model, self.params_by_set[set_name], self.lora_scale)
            model = nnx.merge(nnx.graphdef(self.model), self.params_by_set[set_name])
            return model, layer_weights(model)

    def chunks(self, prompts: list[list[int]]) -> list[list[list[int]]]:
        """Prompts cut into sampler calls of at most `max_cache_tokens` batch × KV length (a power-of-two
        number of rows, a fixed point of the sampler's `bucket_rows`); one call when it is 0."""
        cap = self.settings.max_cache_tokens
        if cap <= 0 or not prompts:
            return [prompts]
        length = bucket(max(len(p) for p in prompts), 16) + self.settings.max_new_tokens
        rows = max(1, cap // length)
        rows = 1 << (rows.bit_length() - 1)
        return [prompts[i: i + rows] for i in range(0, len(prompts), rows)]
