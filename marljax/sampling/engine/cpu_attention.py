"""Decode attention on a CPU that streams each row's real keys once: the `cpu_kernel` path of the
rollout engine's decode chunk (`marljax.sampling.engine.paged_attention`).

XLA CPU runs decode attention's per-(row, KV head) products, [G, Dh] @ [Dh, S] with G of 2 to 4 query
heads, at a fraction of the memory bandwidth (docs/benchmarks.md, "CPU decode attention kernel"), and a
mask makes every row pay for the padded width. `cpu_attention.cc` is one XLA FFI handler that reads
each row's first `length` columns once (float32 or bfloat16 keys and values, float32 sums and softmax),
split over XLA's intra-op threads. It is compiled on first use with the host's C++ compiler for the
host's CPU (`-march=native`) into `$MARLJAX_KERNEL_CACHE` (default `~/.cache/marljax/kernels`), keyed by
the source, the flags, the compiler, jaxlib and the CPU, and registered with `jax.ffi`. Without a
compiler (`$CXX`, else g++) the engine keeps XLA's chunk path and says why (`unavailable()`).
Loading it changes nothing outside it: fast-math is a compile flag only (no process-wide flush-to-zero),
and a library already in the cache is never replaced (another process may have it loaded).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile
import warnings
from importlib import metadata

import jax
import jax.numpy as jnp
import numpy as np

SOURCE = pathlib.Path(__file__).with_name("cpu_attention.cc")
TARGET = "marljax_cpu_decode_attention"
# -ffast-math: vectorised exp and reordered sums (the kernel keeps no infinities or NaNs of its own); on x86,
# 512-bit vectors where the CPU has them (1.2-1.3x on AVX-512 in a scratch timing of the 30-layer loop).
# Compiling only: linking with it adds crtfastmath.o (GCC before 13, some clangs), whose constructor turns on
# flush-to-zero and denormals-are-zero for the whole process when the library is loaded. A separate link
# step keeps it out with any compiler (GCC 13's -mno-daz-ftz would too).
COMPILE = ("-O3", "-march=native", "-ffast-math", "-std=c++17", "-fPIC", "-w",
           *(("-mprefer-vector-width=512",) if platform.machine().lower() in ("x86_64", "amd64") else ()))
LINK = ("-shared", "-fPIC")
MAX_GROUP = 8  # query heads per KV head the kernel is built for
# /proc/cpuinfo lines that name the CPU and its instruction set (what -march=native compiles for): x86's
# "model name" and "flags"; aarch64's "Features" and "CPU implementer/architecture/variant/part"
CPU_LINES = ("model name", "flags", "Features", "CPU implementer", "CPU architecture", "CPU variant", "CPU part")


def _cpu_id(cpuinfo: str | None = None, machine: str | None = None) -> str:
    """The CPU for the cache key: the machine (uname -m) and the CPU_LINES of `cpuinfo` (default
    /proc/cpuinfo), else `platform.processor()`."""
    machine = machine or platform.machine()
    if cpuinfo is None:
        try:
            cpuinfo = pathlib.Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    lines = sorted({line.strip() for line in cpuinfo.splitlines() if line.startswith(CPU_LINES)})
    return "\n".join([machine, *(lines or [platform.processor()])])


def _run(cxx: str, args: list[str], step: str) -> None:
    run = subprocess.run([cxx, *args], capture_output=True, text=True)
    if run.returncode:
        raise RuntimeError(f"{step} {SOURCE.name} with {cxx} failed (the engine uses XLA's chunk path "
                           f"meanwhile):\n{run.stderr[-2000:]}")


def build(cxx: str | None = None, cache: pathlib.Path | None = None) -> pathlib.Path:
    """The kernel's shared library, compiled unless cached; RuntimeError naming the fix if it cannot be."""
    wanted = cxx or os.environ.get("CXX", "g++")
    cxx = shutil.which(wanted)
    if cxx is None:
        raise RuntimeError(f"no C++ compiler ({wanted!r} not found): install g++ (apt-get install g++) or set "
                           "CXX; the engine uses XLA's chunk path meanwhile.")
    cache = cache or pathlib.Path(os.environ.get("MARLJAX_KERNEL_CACHE",
                                                 pathlib.Path.home() / ".cache" / "marljax" / "kernels"))
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), *COMPILE, "link:", *LINK, version,
                                     metadata.version("jaxlib"), _cpu_id()]).encode()).hexdigest()[:16]
    lib = cache / f"cpu_attention-{key}.so"
    if lib.exists():
        return lib
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:  # built aside, then linked in under its final name
        obj, out = pathlib.Path(tmp) / "cpu_attention.o", pathlib.Path(tmp) / lib.name
        _run(cxx, [*COMPILE, f"-I{jax.ffi.include_dir()}", "-c", str(SOURCE), "-o", str(obj)], "compiling")
        _run(cxx, [*LINK, str(obj), "-o", str(out)], "linking")
        try:  # a hard link, unlike a rename, never replaces a library that a concurrent build put there
            os.link(out, lib)  # and a process may have loaded
        except FileExistsError:
            pass  # that build's library is this one
        except OSError as e:
            raise RuntimeError(f"cannot put the built kernel into {cache} ({e}): set MARLJAX_KERNEL_CACHE to a "
                               "directory on a filesystem with hard links.") from e
    return lib


@functools.cache
def unavailable() -> str | None:
    """Why the kernel cannot run in this process (None: built and registered). Tried once."""
    try:
        lib = ctypes.cdll.LoadLibrary(str(build()))
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.MarljaxCpuDecodeAttention), platform="cpu")
    except (RuntimeError, OSError) as e:
        warnings.warn(f"marljax's CPU decode-attention kernel is unavailable: {e}", RuntimeWarning, stacklevel=2)
        return str(e)
    return None


def decode_attention(q_bkgd, k_bkds, v_bksd, length_b):
    """Each row's queries [B, K, G, Dh] over its first length_b[b] keys [B, K, Dh, S] and values
    [B, K, S, Dh]: the attention output [B, K, G, Dh] and the scores' log-sum-exp [B, K, G] (float32;
    float32's lowest for an empty row, whose output is 0)."""
    reason = unavailable()
    if reason:
        raise RuntimeError(f"the cpu_kernel attention path cannot run: {reason}")
    B, K, G, D = q_bkgd.shape
    if G > MAX_GROUP:
        raise ValueError(f"cpu_kernel attention takes at most {MAX_GROUP} query heads per KV head, got {G}; "
                         "use the chunk path.")
    call = jax.ffi.ffi_call(TARGET, (jax.ShapeDtypeStruct((B, K, G, D), jnp.float32),
                                     jax.ShapeDtypeStruct((B, K, G), jnp.float32)))
    return call(q_bkgd.astype(jnp.float32), k_bkds, v_bksd.astype(k_bkds.dtype), length_b.astype(jnp.int32),
                scale=np.float32(D ** -0.5))


def segmented_decode_attention(q_bthd, segments):
    """One query per row (T = 1) over key/value segments [(k [B, K, Dh, S], v [B, K, S, Dh], length_b)],
    each row attending its first length_b[b] columns of every segment, as one softmax: the kernel per
    segment, combined by their log-sum-exps. [B, 1, H, Dh] in the values' dtype, like
    `marljax.models.attention.segmented_attention` over the same columns as masks."""
    B, T, H, D = q_bthd.shape
    if T != 1:
        raise ValueError(f"cpu_kernel attention decodes one query per row, got {T}.")
    K = segments[0][0].shape[1]
    q = q_bthd.reshape(B, K, H // K, D)
    outs, lses = zip(*[decode_attention(q, k, v, n) for k, v, n in segments])
    lse = jnp.stack(lses)
    w = jnp.exp(lse - lse.max(axis=0))  # [segments, B, K, G]
    out = sum(w_i[..., None] * o for w_i, o in zip(w, outs)) / w.sum(axis=0)[..., None]
    return out.astype(segments[0][1].dtype).reshape(B, T, H, D)
