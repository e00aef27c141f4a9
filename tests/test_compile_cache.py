"""The CLIs' persistent compilation cache: where it goes, how to turn it off, and that JAX writes to it."""
import os
import subprocess
import sys

PROBE = ("import jax, jax.numpy as jnp; from marljax.core import compile_cache; d = compile_cache.enable(); "
         "jax.jit(lambda x: jnp.sin(x) @ x)(jnp.ones((8, 8))).block_until_ready(); print(d)")


def _run(env_changes: dict) -> str:
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env.update(JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", **env_changes)
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]


def test_cache_dir_from_marljax_variable_is_written(tmp_path):
    cache = tmp_path / "xla"
    assert _run({"MARLJAX_COMPILE_CACHE": str(cache)}) == str(cache)
    assert any(cache.iterdir()), "JAX wrote no compiled program to the cache directory"


def test_empty_variable_turns_the_cache_off_and_jax_setting_wins(tmp_path):
    assert _run({"MARLJAX_COMPILE_CACHE": ""}) == "None"
    own = tmp_path / "own"
    assert _run({"MARLJAX_COMPILE_CACHE": str(tmp_path / "ours"), "JAX_COMPILATION_CACHE_DIR": str(own)}) == str(own)
    assert not (tmp_path / "ours").exists()
