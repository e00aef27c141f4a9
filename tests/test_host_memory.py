"""The CLIs keep freed host memory (glibc), so XLA CPU's per-call temp buffer is not faulted in again on
every call; importing marljax changes nothing (marljax/core/host_memory.py)."""
import glob
import os
import platform
import subprocess
import sys

import pytest

from marljax.core import host_memory

# A jitted program whose temp buffer holds a 64 MB intermediate ([4096, 4096] float32); prints the state
# and the median minor page faults of 7 calls after 3 warm-up calls, each call after a 0.3 s pause. (XLA
# frees a call's temp buffer in the background after its outputs are ready; a call made before that
# allocates a second buffer, and the kept heap grows by one. A train loop's rollouts give that pause.)
_PROBE = """
import resource, statistics, time
from marljax.core import host_memory
host_memory.retain()
import jax, jax.numpy as jnp
f = jax.jit(lambda x: ((x @ x.T) @ x).sum() + (jnp.exp(x @ x.T) @ x).sum())
x = jnp.ones((4096, 256), jnp.float32) / 4096
faults = []
for i in range(10):
    time.sleep(0.3)
    r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    f(x).block_until_ready()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0)
print(host_memory.state, int(statistics.median(faults[3:])))
"""


def _probe(malloc: str) -> tuple[str, int]:
    env = {**os.environ, "MARLJAX_HOST_MALLOC": malloc}
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, check=True)
    state, faults = out.stdout.strip().rsplit(" ", 1)
    return state, int(faults)


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                    reason="host memory retention is glibc-only (mallopt); this platform leaves malloc alone")
def test_temp_buffer_is_not_faulted_in_again_on_every_call():
    state, faults = _probe("retain")
    off_state, off_faults = _probe("system")
    print(f'median minor faults of a call: {faults} retained, {off_faults} without')
    assert state == "retained" and off_state.startswith("off")
    # Without retention each call maps the 64 MB temp buffer afresh: 16k faults of 4 KiB pages.
    if off_faults < 10_000:
        pytest.skip(f"glibc's default malloc took only {off_faults} faults for a fresh 64 MB buffer (huge pages, "
                    "THP=always?): nothing for retention to save on this kernel")
    # Kept memory: the median call faults in nothing (observed 0 in every run); 1/20 leaves room for the odd
    # page of small allocations while failing if the buffer is mapped afresh.
    assert faults < off_faults / 20, (faults, off_faults)


def test_retention_is_skipped_with_a_reason_when_jax_came_first():
    out = subprocess.run([sys.executable, "-c", "import jax; from marljax.core import host_memory; print(host_memory.retain())"],
                         env={**os.environ, "MARLJAX_HOST_MALLOC": "retain"}, capture_output=True, text=True,
                         check=True)
    assert "jax was imported first" in out.stdout


# mallopt's settings cannot be read back; what they do can: the process's malloc arenas (malloc_info's <heap>
# entries) after 8 threads each allocated: one when retained (M_ARENA_MAX=1), about one per thread otherwise.
_ARENAS = """
import ctypes, os, sys, threading
{setup}
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
def work():
    libc.free(libc.malloc(1000))
threads = [threading.Thread(target=work) for _ in range(8)]
[t.start() for t in threads]
[t.join() for t in threads]
libc.open_memstream.restype = ctypes.c_void_p
buf, size = ctypes.c_char_p(), ctypes.c_size_t()
f = libc.open_memstream(ctypes.byref(buf), ctypes.byref(size))
libc.malloc_info(0, ctypes.c_void_p(f))
libc.fclose(ctypes.c_void_p(f))
print(buf.value.decode().count("<heap nr="), host_memory.state)
"""


def _arenas(setup: str, *args: str) -> tuple[int, str]:
    out = subprocess.run([sys.executable, "-c", _ARENAS.format(setup=setup), *args], capture_output=True, text=True,
                         env={**os.environ, "MARLJAX_HOST_MALLOC": "auto", "JAX_PLATFORMS": "cpu"}, check=True)
    arenas, state = out.stdout.strip().split(" ", 1)
    return int(arenas), state


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                    reason="host memory retention is glibc-only (mallopt); this platform leaves malloc alone")
def test_importing_marljax_changes_no_malloc_setting_and_the_cli_path_does():
    imported, state = _arenas("import marljax, marljax.train, marljax.evaluate, marljax.generate\n"
                              "from marljax.core import host_memory")
    assert state == "not run" and imported > 1, (imported, state)
    retained, state = _arenas("from marljax.core import host_memory\nhost_memory.opt_in('probe')")
    assert state == "retained" and retained == 1, (retained, state)


def test_the_cli_opts_in_and_says_so():
    out = subprocess.run([sys.executable, "-m", "marljax.train", "--print-config", "model=tiny-qwen3"],
                         env={**os.environ, "MARLJAX_HOST_MALLOC": "system"}, capture_output=True, text=True, check=True)
    assert out.stderr.splitlines()[0] == ("marljax.train: host malloc off (MARLJAX_HOST_MALLOC=system); "
                                          "see marljax/core/host_memory.py")


def _state(tmp_path, plugin="jax_cuda12_plugin", **env) -> subprocess.CompletedProcess:
    """marljax's host-memory state in a fresh process with a fake `plugin` package on its path; `env` values
    override the environment, None unsets."""
    (tmp_path / plugin).mkdir(exist_ok=True)
    (tmp_path / plugin / "__init__.py").write_text("")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}", **env}
    return subprocess.run([sys.executable, "-c", "from marljax.core import host_memory; print(host_memory.retain())"],
                          env={k: v for k, v in env.items() if v is not None}, capture_output=True, text=True)


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                    reason="host memory retention is glibc-only (mallopt); this platform leaves malloc alone")
def test_auto_leaves_malloc_alone_where_an_accelerator_plugin_is_installed(tmp_path):
    assert "accelerator plugin jax_cuda12_plugin" in _state(tmp_path, MARLJAX_HOST_MALLOC="auto",
                                                            JAX_PLATFORMS=None).stdout
    assert _state(tmp_path, MARLJAX_HOST_MALLOC="auto", JAX_PLATFORMS="cpu").stdout.strip() == "retained"
    assert _state(tmp_path, MARLJAX_HOST_MALLOC="retain", JAX_PLATFORMS=None).stdout.strip() == "retained"
    bad = _state(tmp_path, MARLJAX_HOST_MALLOC="keep")
    assert bad.returncode != 0 and "MARLJAX_HOST_MALLOC='keep'; choose from auto, retain, system" in bad.stderr


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                    reason="host memory retention is glibc-only (mallopt); this platform leaves malloc alone")
@pytest.mark.skipif(bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*")), reason="a TPU host")
def test_libtpu_without_a_tpu_keeps_host_memory(tmp_path):
    """libtpu installed on a CPU machine (to compile for TPU topologies, marljax/aot.py) is no accelerator."""
    state = _state(tmp_path, plugin="libtpu", MARLJAX_HOST_MALLOC="auto", JAX_PLATFORMS=None).stdout.strip()
    assert state == "retained"


def test_clis_keep_jax_off_an_absent_tpu(monkeypatch):
    """libtpu installed (a test dependency) on a host without a TPU: the CLIs' opt-in sets JAX_PLATFORMS
    so jax does not probe for a TPU (which prints errors at startup); a user's JAX_PLATFORMS wins."""
    import importlib.util

    if importlib.util.find_spec("libtpu") is None:
        pytest.skip("libtpu is not installed (requirements-test.txt pins it): nothing to keep jax off")
    if host_memory._tpu_device():
        pytest.skip("this host has a TPU: jax should use it")
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    assert host_memory.skip_absent_tpu() in ("cpu", "cuda,cpu") and os.environ["JAX_PLATFORMS"] in ("cpu", "cuda,cpu")
    monkeypatch.setenv("JAX_PLATFORMS", "tpu")
    assert host_memory.skip_absent_tpu() is None and os.environ["JAX_PLATFORMS"] == "tpu"
