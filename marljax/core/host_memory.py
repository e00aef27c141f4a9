"""Keep freed host memory for reuse, so XLA CPU's per-step temp buffer is not faulted in afresh each step.

XLA CPU allocates each execution's temp buffer (2.75 GB for a SmolLM2-135M LoRA step on 8 × 256 tokens
with remat `dots`) on the thread that runs it. glibc serves a request that large from a fresh `mmap` (a
thread's own arena cannot hold it, whatever `M_MMAP_MAX` says) and unmaps it on free, so every step faults
the buffer in again: 705k minor faults and seconds of kernel time per step. One arena, no `mmap` and no
trimming make the heap keep it: no faults. The price: the process keeps its peak heap, and since XLA frees
a temp buffer in the background, back-to-back calls can leave several copies in it (fewer when rollouts
separate the steps; `bench/peak_rss.py` measures a command's peak). Measurements: docs/benchmarks.md.

`retain()` must run before jax is imported (jaxlib's threads pick their arena at their first `malloc`).
Importing marljax changes nothing; each entry point opts in. A CLI module run as `python -m marljax.X`
calls `opt_in` at its top, under `if __name__ == "__main__":` and before its own imports (the package's
`__init__`, which runpy runs first, imports no jax), so importing the module as a library stays free of
side effects; the opt-in prints one line on stderr saying what it did. The bench scripts call `retain()`
through bench/benchdoc.py, the test session in tests/conftest.py. `MARLJAX_HOST_MALLOC`: `auto` (default) keeps memory unless a TPU or GPU
plugin for jax is installed (and `JAX_PLATFORMS` is not `cpu`; libtpu only counts on a host with a TPU
device, since CPU machines install it too, to compile for TPU topologies: marljax/aot.py), where temp
buffers live on the device and one arena for a large host's many threads would only add contention; `retain` always keeps it; `system`
leaves malloc alone (use it where resident memory matters more than step time). Non-glibc: nothing done.
"""
from __future__ import annotations

import ctypes
import glob
import importlib.util
import os
import platform
import sys

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8
MODES = ("auto", "retain", "system")
# Modules whose presence means jax will run on a TPU or GPU (jax_plugins: the PJRT plugin namespace).
_ACCELERATOR_PLUGINS = ("libtpu", "jax_plugins", "jax_cuda12_plugin", "jax_cuda13_plugin")

# What retain() did: "retained", or why it did nothing.
state = "not run"


def _accelerator_plugin() -> str | None:
    """The installed accelerator plugin jax would pick, or None (none, or JAX_PLATFORMS asks for cpu)."""
    if os.environ.get("JAX_PLATFORMS", "").split(",")[0].strip() == "cpu":
        return None
    return next((m for m in _ACCELERATOR_PLUGINS if importlib.util.find_spec(m) is not None
                 and (m != "libtpu" or _tpu_device())), None)


def _tpu_device() -> bool:
    """A TPU chip on this host: TPU VMs expose them as /dev/accel* (v4, v5e) or /dev/vfio/<n> (v5p, v6e)."""
    return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


def retain() -> str:
    """One malloc arena, no mmap, never trim (glibc only, per MARLJAX_HOST_MALLOC); returns and records
    what was done."""
    global state
    mode = os.environ.get("MARLJAX_HOST_MALLOC", "auto")
    if mode not in MODES:
        raise ValueError(f"MARLJAX_HOST_MALLOC={mode!r}; choose from {', '.join(MODES)} (marljax/core/host_memory.py)")
    if mode == "system":
        state = "off (MARLJAX_HOST_MALLOC=system)"
    elif mode == "auto" and (plugin := _accelerator_plugin()):
        state = f"off (accelerator plugin {plugin} installed; MARLJAX_HOST_MALLOC=retain keeps host memory anyway)"
    elif platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        state = f"off (not glibc: {platform.system()} {platform.libc_ver()[0] or 'unknown libc'})"
    elif "jax" in sys.modules or "jaxlib" in sys.modules:
        state = "off (jax was imported first; call host_memory.retain() before importing jax to keep host memory)"
    else:
        libc = ctypes.CDLL("libc.so.6")
        # mallopt's -1 trim threshold disables trimming (mallopt(3)); each call returns 1 on success.
        ok = (libc.mallopt(_M_ARENA_MAX, 1), libc.mallopt(_M_MMAP_MAX, 0), libc.mallopt(_M_TRIM_THRESHOLD, -1))
        state = "retained" if all(ok) else f"off (mallopt refused: {ok})"
    return state


def skip_absent_tpu() -> str | None:
    """Keep jax off the TPU backend on a host without a TPU: CPU machines install libtpu too (to compile
    for TPU topologies), and there jax's TPU probe fails loudly at startup (accelerator type, worker
    hostnames). Sets JAX_PLATFORMS (to cpu, or cuda,cpu with a CUDA plugin) unless it is set already or
    libtpu is absent or a TPU is present; returns what it set."""
    if "JAX_PLATFORMS" in os.environ or importlib.util.find_spec("libtpu") is None or _tpu_device():
        return None
    cuda = any(importlib.util.find_spec(m) is not None for m in ("jax_cuda12_plugin", "jax_cuda13_plugin"))
    os.environ["JAX_PLATFORMS"] = "cuda,cpu" if cuda else "cpu"
    return os.environ["JAX_PLATFORMS"]


def opt_in(program: str) -> str:
    """A CLI's opt-in, run before it imports jax: `skip_absent_tpu()` and `retain()`, then one line on
    stderr saying what it did."""
    mode = f"MARLJAX_HOST_MALLOC={os.environ.get('MARLJAX_HOST_MALLOC', 'auto')}"
    platforms = skip_absent_tpu()
    done = retain()
    print(f"{program}: host malloc {done}{'' if mode in done else f' ({mode})'}; see marljax/core/host_memory.py"
          + (f"; JAX_PLATFORMS={platforms} (libtpu installed, no TPU on this host)" if platforms else ""),
          file=sys.stderr)
    return done
