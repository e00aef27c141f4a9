"""Persistent XLA compilation cache for the command-line entry points.

A run compiles the sampler and the train step once per shape (seconds each on a CPU, minutes for a
large model on an accelerator). JAX's on-disk cache lets the next run with the same shapes (a resume,
another seed or policy of the same cell) load them instead. Directory: `$JAX_COMPILATION_CACHE_DIR` if
set, else `$MARLJAX_COMPILE_CACHE`, else `~/.cache/marljax/xla`; `MARLJAX_COMPILE_CACHE=` (empty) turns
it off. JAX caches only programs that took longer than `jax_persistent_cache_min_compile_time_secs`
(1 s by default) to compile.
"""
from __future__ import annotations

import os
import pathlib

import jax


def enable() -> pathlib.Path | None:
    """Point JAX's persistent compilation cache at marljax's directory; returns it (None: off)."""
    if jax.config.jax_compilation_cache_dir:  # the user's own JAX setting wins
        return pathlib.Path(jax.config.jax_compilation_cache_dir)
    path = os.environ.get("MARLJAX_COMPILE_CACHE", str(pathlib.Path.home() / ".cache" / "marljax" / "xla"))
    if not path:
        return None
    jax.config.update("jax_compilation_cache_dir", path)
    return pathlib.Path(path)
