"""Sampling entry points: `generate` (on the rollout engine) and the per-layer weights it reads.

`generate(model, prompts, SamplingParams(...))` samples a continuation of every prompt with
`marljax.sampling.engine.Engine`: continuous batching over a paged KV cache, identical prompts prefilled once.
Request i draws its tokens from its own stream, fold_in(key(seed), i), so its output depends on its prompt,
the seed and i only (batch-invariant, reproducible); greedy outputs are the argmax of the uncached forward
pass at every step (tests/test_engine.py). Logprobs: `marljax.sampling.engine.draw`.
"""
from __future__ import annotations

import functools
import weakref

import jax
import jax.numpy as jnp
from flax import nnx

from marljax.models.decoder import Decoder
from marljax.models.lora import lora_delta, merged_weight
from marljax.sampling.engine import Engine
from marljax.sampling.engine.draw import SampleOutput, SamplingParams, choose, first_argmax
from marljax.sampling.engine.engine import NUM_SLOTS

__all__ = ["SampleOutput", "SamplingParams", "choose", "first_argmax", "generate", "layer_weights", "model_layers"]


def generate(model: Decoder, prompts: list[list[int]], params: SamplingParams, *, lora=None,
             lora_scale: float = 1.0, layers: list[dict] | None = None, num_slots: int | None = None) -> SampleOutput:
    """Sample a continuation of every prompt (see the module docstring). The decode loop reads per-layer
    weights: `layers` (`layer_weights`, made once by callers that sample repeatedly from the same
    weights), else `lora` folded into the model's (`layer_weights(model, lora, lora_scale)`, per call),
    else the model's own (`model_layers`: made once per model). `num_slots`: sequences decoded at once;
    None: one per prompt, at most `NUM_SLOTS` (more slots than sequences only cost)."""
    if layers is None:
        layers = model_layers(model) if lora is None else layer_weights(model, lora, lora_scale)
    if num_slots is None:
        num_slots = max(1, min(len(prompts), NUM_SLOTS))
    return Engine(model, num_slots=num_slots).generate(prompts, params, layers=layers)


# model -> (weak references to the parameter arrays its layers were made from, the layers)
_MODEL_LAYERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def model_layers(model: Decoder) -> list[dict]:
    """`layer_weights(model)`, made once and reused while the model's parameters are the same arrays (a
    new value of any parameter makes them anew). Held while the model lives: one copy of its layers."""
    arrays = jax.tree.leaves(nnx.state(model))
    refs, layers = _MODEL_LAYERS.get(model, ((), None))
    if len(refs) != len(arrays) or any(r() is not a for r, a in zip(refs, arrays)):
        layers = layer_weights(model)
        _MODEL_LAYERS[model] = (tuple(weakref.ref(a) for a in arrays), layers)
    return layers


def layer_weights(model: Decoder, adapter: dict | None = None, scale: float = 1.0) -> list[dict]:
    """Per-layer weights for `generate(layers=...)`, with a LoRA adapter folded in when given (the
    adapted model's exact weights, as `merged_model`): one jitted copy, so decoding then costs the
    base's matmuls only."""
    graphdef, state = nnx.split(model)
    return _layer_weights(graphdef, state, adapter, jnp.float32(scale))


@functools.partial(jax.jit, static_argnums=0)
def _layer_weights(graphdef, state, adapter, scale):
    layers = nnx.merge(graphdef, state).layer_list()
    for name, delta in ({} if adapter is None else lora_delta(adapter, scale)).items():
        split = len(layers) - delta.shape[0]  # adapters cover the last layers
        for i in range(split, len(layers)):
            layers[i][name] = merged_weight(layers[i][name], delta[i - split])
    return layers
