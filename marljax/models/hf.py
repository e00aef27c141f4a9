"""HF checkpoints: the tensor-name table, config.json, and the safetensors reader.

HF names and layouts are the common currency of loading: every format is first turned into HF tensor
names in HF layout (`[out, in]` linear weights), as lazily read `Tensor`s; `hf_tensor_to_slot` turns one
such tensor into the value of one of our parameter slots (`slot_to_hf_tensor` the other way), and
`marljax.models.loading` assembles the Decoder.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from marljax.models.decoder import LINEAR_AXES, Decoder, ModelConfig

SUPPORTED_MODEL_TYPES = ("qwen3", "llama")

# Our layer slot -> HF tensor name under `model.layers.{i}.`.
LAYER_HF_NAMES = {
    "attn_norm": "input_layernorm.weight",
    "mlp_norm": "post_attention_layernorm.weight",
    "wq": "self_attn.q_proj.weight",
    "wk": "self_attn.k_proj.weight",
    "wv": "self_attn.v_proj.weight",
    "wo": "self_attn.o_proj.weight",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
    "w_gate": "mlp.gate_proj.weight",
    "w_up": "mlp.up_proj.weight",
    "w_down": "mlp.down_proj.weight",
}
TOP_HF_NAMES = {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight",
                "lm_head": "lm_head.weight"}
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")
_SLOT_OF_LAYER_NAME = {v: k for k, v in LAYER_HF_NAMES.items()}
_SLOT_OF_TOP_NAME = {v: k for k, v in TOP_HF_NAMES.items()}


class CheckpointError(ValueError):
    """A checkpoint that does not fit the decoder: unsupported config, wrong or missing tensors."""


@dataclasses.dataclass(frozen=True)
class Tensor:
    """A tensor of a checkpoint, read on demand: HF shape and a reader giving the HF layout."""

    shape: tuple[int, ...]
    read: Callable[[], np.ndarray]


def few(names: list[str], n: int = 5) -> str:
    """The first `n` names and how many more, for error messages."""
    return ", ".join(names[:n]) + (f", … ({len(names) - n} more)" if len(names) > n else "")


# ---- one HF tensor <-> one slot --------------------------------------------------------------
def hf_shape(config: ModelConfig, slot: str) -> tuple[int, ...]:
    """Shape of slot `slot` (one layer's worth for layer slots) as HF stores it."""
    c = config
    if slot in LINEAR_AXES:
        ins, outs = c.linear_shape(slot)
        return (math.prod(outs), math.prod(ins))
    return {"embed": (c.vocab_size, c.hidden_size), "lm_head": (c.vocab_size, c.hidden_size),
            "final_norm": (c.hidden_size,), "attn_norm": (c.hidden_size,),
            "mlp_norm": (c.hidden_size,), "q_norm": (c.head_dim,), "k_norm": (c.head_dim,)}[slot]


def hf_names(config: ModelConfig) -> dict[str, tuple[str, int | None]]:
    """Every HF tensor name the config needs -> (our slot, layer index or None)."""
    names = {TOP_HF_NAMES["embed"]: ("embed", None), TOP_HF_NAMES["final_norm"]: ("final_norm", None)}
    if not config.tie_embeddings:
        names[TOP_HF_NAMES["lm_head"]] = ("lm_head", None)
    layer_slots = [s for s in LAYER_HF_NAMES if config.qk_norm or s not in ("q_norm", "k_norm")]
    for i in range(config.num_layers):
        for slot in layer_slots:
            names[f"model.layers.{i}.{LAYER_HF_NAMES[slot]}"] = (slot, i)
    return names


def _slot_of(name: str) -> tuple[str, int | None] | None:
    m = _LAYER_RE.fullmatch(name)
    if m:
        slot = _SLOT_OF_LAYER_NAME.get(m.group(2))
        return None if slot is None else (slot, int(m.group(1)))
    slot = _SLOT_OF_TOP_NAME.get(name)
    return None if slot is None else (slot, None)


def hf_tensor_to_slot(config: ModelConfig, name: str, value: np.ndarray
                      ) -> tuple[str, int | None, np.ndarray]:
    """One HF tensor -> (our slot, layer index or None, value in our layout and dtype)."""
    found = _slot_of(name)
    if found is None:
        raise CheckpointError(f"tensor {name!r} has no place in marljax's decoder.")
    slot, layer = found
    check_shape(config, name, slot, tuple(value.shape))
    if slot in LINEAR_AXES:
        ins, outs = config.linear_shape(slot)
        value = value.T.reshape(*ins, *outs)
    elif slot == "lm_head":
        value = value.T
    return slot, layer, np.asarray(value, dtype=config.param_jnp_dtype)


def slot_to_hf_tensor(config: ModelConfig, slot: str, layer: int | None, value: np.ndarray
                      ) -> tuple[str, np.ndarray]:
    """The inverse of `hf_tensor_to_slot`: (HF name, contiguous value in HF layout)."""
    name = TOP_HF_NAMES[slot] if layer is None else f"model.layers.{layer}.{LAYER_HF_NAMES[slot]}"
    if slot in LINEAR_AXES or slot == "lm_head":
        value = value.reshape(hf_shape(config, slot)[::-1]).T
    return name, np.ascontiguousarray(value)


def check_shape(config: ModelConfig, name: str, slot: str, shape: tuple[int, ...]) -> None:
    expected = hf_shape(config, slot)
    if shape != expected:
        c = config
        raise CheckpointError(
            f"tensor {name!r} has shape {shape}, but the config needs {expected} (vocab_size="
            f"{c.vocab_size}, hidden_size={c.hidden_size}, intermediate_size={c.intermediate_size}, "
            f"num_heads={c.num_heads}, num_kv_heads={c.num_kv_heads}, head_dim={c.head_dim}). "
            "The weights and config.json come from different models; use the matching pair.")


# ---- HF checkpoint directories ---------------------------------------------------------------
def _require(cfg: dict, field: str, allowed, default):
    value = cfg.get(field, default)
    if value not in allowed:
        raise CheckpointError(
            f"config.json: {field}={value!r} is not supported by marljax's decoder (supported: "
            f"{', '.join(map(repr, allowed))}).")
    return value


def config_from_hf(cfg: dict, dtype: str = "float32") -> ModelConfig:
    """A transformers config.json dict -> ModelConfig, or CheckpointError naming the field."""
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(
            f"config.json: model_type={model_type!r} is not supported by marljax's decoder "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)}).")
    _require(cfg, "hidden_act", ("silu",), "silu")
    _require(cfg, "attention_bias", (False,), False)
    _require(cfg, "mlp_bias", (False,), False)
    _require(cfg, "use_sliding_window", (False,), False)
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        key = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
        raise CheckpointError(f"config.json: {key}.rope_type={rope_type!r} is not supported by "
                              "marljax's decoder (supported: 'default', i.e. plain RoPE).")
    try:
        heads = int(cfg["num_attention_heads"])
        return ModelConfig(
            vocab_size=int(cfg["vocab_size"]), hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]), num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10_000.0))),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qk_norm=model_type == "qwen3",
            max_position=int(cfg.get("max_position_embeddings", 40_960)), dtype=dtype)
    except KeyError as e:
        raise CheckpointError(f"config.json: required field {e.args[0]!r} is missing.") from None


def config_to_hf(config: ModelConfig) -> dict:
    """ModelConfig -> a config.json dict that transformers loads."""
    qwen = config.qk_norm
    cfg = {
        "architectures": ["Qwen3ForCausalLM" if qwen else "LlamaForCausalLM"],
        "model_type": "qwen3" if qwen else "llama",
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim, "hidden_act": "silu", "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta, "rope_scaling": None,
        "max_position_embeddings": config.max_position,
        "tie_word_embeddings": config.tie_embeddings, "attention_bias": False,
        "torch_dtype": str(config.param_jnp_dtype),  # as the tensors are stored
    }
    if not qwen:
        cfg["mlp_bias"] = False
    return cfg


@contextlib.contextmanager
def safetensors_tensors(ckpt_dir: Path) -> Iterator[dict[str, Tensor]]:
    """The tensors of a checkpoint dir's safetensors files (single file or sharded index)."""
    from safetensors import safe_open

    index = ckpt_dir / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        absent = [f for f in files if not (ckpt_dir / f).exists()]
        if absent:
            raise FileNotFoundError(f"{index} lists shard(s) that are not in {ckpt_dir}: "
                                    f"{few(absent)}. Copy the complete checkpoint there.")
    else:
        files = sorted(p.name for p in ckpt_dir.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(
                f"no *.safetensors weights in {ckpt_dir}; a checkpoint dir needs config.json and "
                "model.safetensors (or model-*.safetensors + model.safetensors.index.json).")
    with contextlib.ExitStack() as stack:
        tensors = {}
        for f in files:
            handle = stack.enter_context(safe_open(ckpt_dir / f, framework="np"))
            for key in handle.keys():
                shape = tuple(handle.get_slice(key).get_shape())
                tensors[key] = Tensor(shape, lambda h=handle, k=key: h.get_tensor(k))
        yield tensors


def hf_ignorable(config: ModelConfig) -> Callable[[str], bool]:
    # A tied checkpoint may still store lm_head.weight (transformers ignores it); old ones store
    # the RoPE frequencies.
    return lambda name: ((config.tie_embeddings and name == TOP_HF_NAMES["lm_head"])
                         or name.endswith("rotary_emb.inv_freq"))


def read_hf_config(ckpt_dir: str | os.PathLike, dtype: str = "float32") -> ModelConfig:
    """The ModelConfig of a transformers checkpoint dir (its config.json)."""
    cfg_path = Path(ckpt_dir) / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{cfg_path} not found; a checkpoint dir needs config.json and "
                                "*.safetensors as written by transformers' save_pretrained.")
    return config_from_hf(json.loads(cfg_path.read_text()), dtype)


def hf_tensors_of(model: Decoder) -> Iterator[tuple[str, np.ndarray]]:
    """Every parameter of `model` as (HF name, value in HF layout), one layer slot at a time."""
    config = model.config
    yield slot_to_hf_tensor(config, "embed", None, np.asarray(model.embed.get_value()))
    layers = {k: np.asarray(v.get_value()) for k, v in model.layers.items()}
    for i in range(config.num_layers):
        for slot, value in layers.items():
            yield slot_to_hf_tensor(config, slot, i, value[i])
    yield slot_to_hf_tensor(config, "final_norm", None, np.asarray(model.final_norm.get_value()))
    if not config.tie_embeddings:
        yield slot_to_hf_tensor(config, "lm_head", None, np.asarray(model.lm_head.get_value()))
