"""docs/*.md I/O shared by the benchmark scripts: the machine line and section replacement, and the tiny
model of their `--smoke` runs (tests/test_bench_smoke.py). Import it before jax: it keeps freed host memory
for the script, as the CLIs do (marljax/core/host_memory.py)."""
import dataclasses
import os
import pathlib
import platform

from marljax.core import host_memory

host_memory.skip_absent_tpu()  # libtpu without a TPU: keep jax from probing for one (marljax/core/host_memory.py)
host_memory.retain()  # before jax: keeps freed host memory (marljax/core/host_memory.py)

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
SMOKE_SHAPES = dict(num_layers=1, hidden_size=64, intermediate_size=128, num_heads=2, num_kv_heads=1,
                    head_dim=32)  # a `--smoke` run's model: the same family and vocabulary, seconds to compile


def smoke_config(config):
    """`config` (a `ModelConfig`) shrunk to `SMOKE_SHAPES`: what a script's `--smoke` run builds instead."""
    return dataclasses.replace(config, **SMOKE_SHAPES)


def bench_model(name: str, smoke: bool, dtype: str = "float32"):
    """`load_model(name, dtype=dtype)`, or with `smoke` random weights of `smoke_config`'s shapes (none read)."""
    from flax import nnx

    from marljax.models import load_model
    from marljax.models.decoder import Decoder
    from marljax.models.presets import PRESETS
    if not smoke:
        return load_model(name, dtype=dtype)
    return Decoder(dataclasses.replace(smoke_config(PRESETS[name]), dtype=dtype), rngs=nnx.Rngs(0))

def machine(malloc: bool = True) -> str:
    """CPU, cores, kernel, Python and (with `malloc`) what marljax did to this process's malloc."""
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    line = f"{cpu}, {os.cpu_count()} cores, Linux {platform.release()}, Python {platform.python_version()}"
    return line + (f", host malloc {host_memory.state}" if malloc else "")


def publish(section: str, write: bool) -> None:
    """Print a section (its first line is the `## ` title) and, with `write`, put it into docs/benchmarks.md."""
    print(section)
    if write:
        write_section(section.split("\n", 1)[0], section)


def write_section(title: str, text: str, path: pathlib.Path = DOC, heading: str = "# Benchmarks") -> None:
    """Replace (or append) the section headed `title` of `path` (docs/benchmarks.md), leaving the others alone."""
    doc = path.read_text() if path.exists() else heading + "\n"
    start = doc.find(f"\n{title}\n")
    if start < 0:
        doc = doc.rstrip("\n") + "\n\n" + text
    else:
        end = doc.find("\n## ", start + 1)
        doc = doc[:start + 1] + text + (doc[end:] if end >= 0 else "")
    path.parent.mkdir(exist_ok=True)
    path.write_text(doc)
