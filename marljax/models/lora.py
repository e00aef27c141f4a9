"""LoRA adapters as plain pytrees over the frozen, stacked decoder weights.

An adapter set is `{target: {"a": [L, *in, r], "b": [L, r, *out]}}` for the targeted linear maps of
every layer; the decoder adds `scale · (x A) B` (scale = alpha / rank). One frozen base serves any
number of sets, so Isolated-Policy costs one adapter per role, not one model per role; `stack_adapters`
puts G sets on a leading axis so that one batch's rows each apply their own (`Decoder.hidden`'s
`lora_groups`).

Own implementation rather than qwix: our layers are stacked einsums over a scanned layer axis, which
qwix's module-interception LoRA does not target; the adapter math is a few lines and this keeps the
adapters a plain pytree that the train step differentiates, Orbax saves and the sampler takes as a
jit argument.
"""
from __future__ import annotations

import dataclasses
import pathlib
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from marljax.models.decoder import LINEAR_AXES, Decoder, ModelConfig
from marljax.models.loading import save_hf

ALL_LINEAR = tuple(LINEAR_AXES)


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """rank 64, alpha 32 on all linear layers is the paper's setting."""

    rank: int = 64
    alpha: float = 32.0
    targets: tuple[str, ...] = ALL_LINEAR
    layers: int | None = None  # adapt only the last n layers (None: all); the rest need no backward

    def __post_init__(self):
        unknown = sorted(set(self.targets) - set(ALL_LINEAR))
        if unknown:
            raise ValueError(f"lora.targets has unknown modules {unknown}; choose from {list(ALL_LINEAR)}"
                             " (or 'all-linear').")
        if self.rank < 1:
            raise ValueError(f"lora.rank={self.rank} must be ≥ 1.")
        if self.layers is not None and self.layers < 1:
            raise ValueError(f"lora.layers={self.layers} must be ≥ 1 (or null for all layers).")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def init_lora(config: ModelConfig, lora: LoRAConfig, key: jax.Array, dtype=jnp.float32) -> dict:
    """Fresh adapters: A ~ N(0, 1/fan_in), B = 0, so the adapted model starts equal to the base."""
    n = config.num_layers if lora.layers is None else lora.layers
    if n > config.num_layers:
        raise ValueError(f"lora.layers={n} exceeds the model's {config.num_layers} layers.")
    out = {}
    for i, name in enumerate(lora.targets):
        in_dims, out_dims = config.linear_shape(name)
        fan_in = 1
        for d in in_dims:
            fan_in *= d
        a = jax.random.normal(jax.random.fold_in(key, i), (n, *in_dims, lora.rank), dtype)
        out[name] = {"a": a * fan_in ** -0.5, "b": jnp.zeros((n, lora.rank, *out_dims), dtype)}
    return out


def stack_adapters(adapters: Sequence[dict]) -> dict:
    """G adapter sets of one LoRAConfig stacked on a new leading axis, {target: {"a": [G, n, *in, r],
    "b": [G, n, r, *out]}}: what `Decoder.hidden(lora=…, lora_groups=…)` reads to give each batch row
    its own set's adapter on the shared base."""
    if not adapters:
        raise ValueError("stack_adapters needs at least one adapter set.")
    first = adapters[0]
    for i, adapter in enumerate(adapters[1:], 1):
        if sorted(adapter) != sorted(first):
            raise ValueError(f"stack_adapters: adapter {i} targets {sorted(adapter)}, adapter 0 targets "
                             f"{sorted(first)}; the sets of one batch share one LoRAConfig.")
        for name in first:
            for part in ("a", "b"):
                got, want = jnp.shape(adapter[name][part]), jnp.shape(first[name][part])
                if got != want:
                    raise ValueError(f"stack_adapters: adapter {i}'s {name}.{part} has shape {got}, adapter "
                                     f"0's {want} (rank and adapted layers must match across the sets).")
    return jax.tree.map(lambda *xs: jnp.stack(xs), *adapters)


def lora_delta(adapter: dict, scale: float) -> dict:
    """scale · A B per target, shaped like the adapted layers' weights [n, *in, *out]."""
    deltas = {}
    for name, ab in adapter.items():
        a, b = ab["a"], ab["b"]
        n_in = a.ndim - 2
        ins, outs = "ijk"[:n_in], "xyz"[: b.ndim - 2]
        deltas[name] = scale * jnp.einsum(f"l{ins}r,lr{outs}->l{ins}{outs}", a, b)
    return deltas


def merged_model(model: Decoder, adapter: dict, scale: float) -> Decoder:
    """A copy of `model` with the adapter folded into its weights (for export or fast sampling)."""
    graphdef, state = nnx.split(model)
    merged = nnx.merge(graphdef, jax.tree.map(lambda x: x, state))
    for name, delta in lora_delta(adapter, scale).items():
        w = merged.layers[name]
        split = w.shape[0] - delta.shape[0]  # adapters cover the last layers
        w[...] = w[...].at[split:].set(merged_weight(w[...][split:], delta))
    return merged


def merged_weight(w, delta):
    """W + scale·AB computed in float32, in W's dtype: the one formula every merge uses."""
    return (w.astype(jnp.float32) + delta).astype(w.dtype)


def export_merged(model: Decoder, adapters: dict[str, dict], scale: float, out_dir, tokenizer=None) -> dict:
    """Write each parameter set, merged into the base, as an HF safetensors checkpoint out_dir/<set>."""
    paths = {}
    for set_name, adapter in adapters.items():
        path = pathlib.Path(out_dir) / set_name
        save_hf(merged_model(model, adapter, scale), path, tokenizer=tokenizer)
        paths[set_name] = path
    return paths
