"""Checkpoints ↔ `Decoder`: `load_model` (a preset name, a HF safetensors dir or a GGUF file) and `save_hf`.

Each format's module (`hf`, `gguf`) gives a ModelConfig and its tensors under HF names, read lazily;
where a source's files are is `sources`. `_assemble` checks every name and shape before reading any,
turns each tensor into the value of its parameter slot (`hf.hf_tensor_to_slot`), and `_place` puts the
assembled parameter on its device (or its mesh sharding), one parameter at a time.
"""
from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from marljax.models.decoder import Decoder, ModelConfig
from marljax.models.gguf import read_gguf
from marljax.models.hf import (CheckpointError, Tensor, check_shape, config_to_hf, few, hf_ignorable, hf_names,
                               hf_tensor_to_slot, hf_tensors_of, read_hf_config, safetensors_tensors)
from marljax.models.precision import check_dtype
from marljax.models.presets import HUB_IDS, PRESETS, RANDOM_PRESETS
from marljax.models.sources import resolve_source


def _place(value: np.ndarray, sharding=None):
    """One assembled parameter -> device array; with `sharding`, a global array of which each
    process copies only its own devices' slices."""
    if sharding is None:
        return jnp.asarray(value)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def _assemble(config: ModelConfig, tensors: dict[str, Tensor], where: str,
              ignorable: Callable[[str], bool] = lambda name: False, shardings=None) -> Decoder:
    """Build a Decoder from `tensors` (HF names), checking names and shapes before reading any."""
    needed = hf_names(config)
    missing = [n for n in needed if n not in tensors]
    unexpected = [n for n in tensors if n not in needed and not ignorable(n)]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing tensor(s): {few(missing)}")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected tensor(s): {few(unexpected)}")
        raise CheckpointError(f"{where}: {'; '.join(parts)}. The checkpoint does not match its "
                              "config (or is not a Qwen3/Llama causal LM); re-export it with "
                              "transformers' save_pretrained.")
    for name, (slot, _) in needed.items():
        check_shape(config, name, slot, tensors[name].shape)

    model = nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0)))
    by_slot: dict[str, list[tuple[int | None, str]]] = {}
    for name, (slot, layer) in needed.items():
        by_slot.setdefault(slot, []).append((layer, name))
    for slot, entries in by_slot.items():
        variable = model.layers[slot] if entries[0][0] is not None else getattr(model, slot)
        buf = np.empty(variable.get_value().shape, config.param_jnp_dtype)
        for layer, name in entries:
            _, _, value = hf_tensor_to_slot(config, name, tensors[name].read())
            if layer is None:
                buf[...] = value
            else:
                buf[layer] = value
        variable.set_value(_place(buf, None if shardings is None else shardings(variable)))
    return model


def load_hf(ckpt_dir: str | os.PathLike, dtype: str = "float32", preset: str | None = None,
            shardings=None, param_dtype: str | None = None) -> Decoder:
    """A transformers checkpoint dir (config.json + safetensors) -> Decoder; with `preset`, first
    check that the dir holds that preset's architecture."""
    ckpt_dir = Path(ckpt_dir)
    config = dataclasses.replace(read_hf_config(ckpt_dir, dtype), param_dtype=param_dtype)
    if preset is not None:
        _check_matches_preset(preset, config, ckpt_dir)
    with safetensors_tensors(ckpt_dir) as tensors:
        return _assemble(config, tensors, str(ckpt_dir), hf_ignorable(config), shardings)


def load_gguf(path: str | os.PathLike, dtype: str = "float32", preset: str | None = None,
              shardings=None, param_dtype: str | None = None) -> Decoder:
    """A llama.cpp GGUF file (Llama architecture, any quantization `gguf` dequantizes) -> Decoder;
    with `preset`, first check that the file holds that preset's architecture."""
    config, tensors = read_gguf(path, dtype)
    config = dataclasses.replace(config, param_dtype=param_dtype)
    if preset is not None:
        _check_matches_preset(preset, config, Path(path))
    return _assemble(config, tensors, str(path), shardings=shardings)


def save_hf(model: Decoder, out_dir: str | os.PathLike, *, tokenizer=None,
            max_shard_bytes: int = 4 << 30) -> Path:
    """Write `model` as a transformers checkpoint (config.json + safetensors, sharded with an index
    when larger than `max_shard_bytes`), plus the tokenizer files when `tokenizer` is given."""
    from safetensors.numpy import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = model.config
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, value in hf_tensors_of(model):
        if shards[-1] and size + value.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = value
        size += value.nbytes
    if len(shards) == 1:
        save_file(shards[0], out / "model.safetensors", metadata={"format": "pt"})
    else:
        weight_map, total = {}, 0
        for i, shard in enumerate(shards, 1):
            fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, out / fname, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, fname))
            total += sum(v.nbytes for v in shard.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (out / "config.json").write_text(json.dumps(config_to_hf(config), indent=2))
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out


def _check_matches_preset(name: str, config: ModelConfig, where: Path) -> None:
    preset = dataclasses.replace(PRESETS[name], dtype=config.dtype, param_dtype=config.param_dtype)
    for f in dataclasses.fields(ModelConfig):
        if f.name != "max_position" and getattr(config, f.name) != getattr(preset, f.name):
            raise CheckpointError(
                f"{where} does not hold preset {name!r}: {f.name} is {getattr(config, f.name)!r} "
                f"there but {getattr(preset, f.name)!r} in the preset. Load it by path "
                f"(load_model({str(where)!r})) or put the {HUB_IDS.get(name, name)} checkpoint there.")


def random_model(config: ModelConfig, seed: int = 0) -> Decoder:
    """A Decoder with seeded random weights."""
    return Decoder(config, rngs=nnx.Rngs(seed))


def load_model(source: str | os.PathLike, dtype: str = "float32", seed: int = 0, *,
               shardings=None, param_dtype: str | None = None) -> Decoder:
    """A preset name, a HF checkpoint dir or a .gguf file -> Decoder (`seed`: random presets), computing
    in `dtype` with its parameters stored in `param_dtype` (None: `dtype`; see models/precision.py).
    `shardings`: Variable -> Sharding (`marljax.core.sharding.variable_sharding`) placing each parameter
    on a device mesh as it is read."""
    check_dtype("dtype", dtype)
    if param_dtype is not None:
        check_dtype("param_dtype", param_dtype)
    name = str(source)
    if name in RANDOM_PRESETS:
        model = random_model(dataclasses.replace(PRESETS[name], dtype=dtype, param_dtype=param_dtype), seed)
        if shardings is not None:
            for _, v in nnx.iter_graph(model):
                if isinstance(v, nnx.Param):
                    v.set_value(_place(np.asarray(v.get_value()), shardings(v)))
        return model
    path = resolve_source(source)
    preset = name if name in PRESETS else None
    return (load_gguf if path.suffix == ".gguf" else load_hf)(path, dtype, preset, shardings, param_dtype)
