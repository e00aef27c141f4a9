"""The CPU decode-attention kernel (`marljax.sampling.engine.cpu_attention`) against a float64 numpy reference,
its segments against the decoder's masked `segmented_attention`, that loading it leaves the process's
floating point alone, and its build: cache key, no replacing a cached library, errors."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marljax.models.attention import segmented_attention
from marljax.sampling.engine import cpu_attention

REPO = pathlib.Path(__file__).resolve().parents[1]
CI = os.environ.get("CI") == "true"


@pytest.fixture(scope="module")
def kernel():
    """Skips the tests that run the kernel where it cannot be built, saying why; fails them under CI=true
    (.ci/run), which must run them."""
    reason = cpu_attention.unavailable()
    if reason:
        if CI:
            pytest.fail(f"CI must run the CPU decode-attention kernel tests: {reason}")
        pytest.skip(f"the CPU decode-attention kernel cannot be built here: {reason}")


def reference(q_bkgd, k_bkds, v_bksd, length_b):
    """float64: each row's queries over its first length_b[b] columns; (out, log-sum-exp)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q_bkgd, k_bkds, v_bksd))
    B, K, G, D = q.shape
    out, lse = np.zeros((B, K, G, D)), np.full((B, K, G), -np.inf)
    for b in range(B):
        n = int(length_b[b])
        if n == 0:
            continue
        s = np.einsum("kgd,kds->kgs", q[b], k[b, :, :, :n]) / np.sqrt(D)
        m = s.max(-1, keepdims=True)
        e = np.exp(s - m)
        out[b] = np.einsum("kgs,ksd->kgd", e / e.sum(-1, keepdims=True), v[b, :, :n])
        lse[b] = (m + np.log(e.sum(-1, keepdims=True)))[..., 0]
    return out, lse


# (B, K, G, D, S): Qwen3's 4 groups of 128, SmolLM2's 3 of 64, 8 groups, widths that are not whole vectors
# of 16 (S = 37, S < 16) and head sizes with a partial vector block (48) or none at all (20)
SHAPES = [(3, 2, 4, 128, 64), (5, 3, 3, 64, 37), (2, 1, 8, 20, 9), (4, 2, 1, 48, 432), (2, 2, 2, 64, 16)]


@pytest.mark.usefixtures("kernel")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_matches_float64(shape, dtype):
    """Output and log-sum-exp within 2e-6 of float64 on the same (bfloat16-rounded) inputs, for lengths 0
    (output 0), 1, S and in between; columns past a row's length never count (filled with NaN here)."""
    B, K, G, D, S = shape
    rng = np.random.default_rng(S)
    q = rng.normal(size=(B, K, G, D)).astype(np.float32)
    k = jnp.asarray(rng.normal(size=(B, K, D, S)), dtype)
    v = jnp.asarray(rng.normal(size=(B, K, S, D)), dtype)
    length = np.array([0, 1, S, *rng.integers(1, S + 1, size=B)][:B], np.int32)
    cols = np.arange(S)[None, None, :] >= length[:, None, None]
    k = jnp.where(cols[:, :, None, :], jnp.nan, k)  # past the length: NaN, which must not leak
    v = jnp.where(cols[..., None], jnp.nan, v)
    out, lse = jax.jit(cpu_attention.decode_attention)(jnp.asarray(q), k, v, jnp.asarray(length))
    want_out, want_lse = reference(q, np.asarray(k.astype(jnp.float32)), np.asarray(v.astype(jnp.float32)), length)
    np.testing.assert_allclose(np.asarray(out), want_out, atol=2e-6, rtol=2e-6)
    real = length > 0
    np.testing.assert_allclose(np.asarray(lse)[real], want_lse[real], atol=2e-6, rtol=2e-6)
    assert (np.asarray(lse)[~real] == np.finfo(np.float32).min).all()


@pytest.mark.usefixtures("kernel")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_segments_equal_masked_segmented_attention(dtype):
    """Two segments (a cache up to each row's first position, some rows empty, and a buffer up to the step)
    combined by their log-sum-exps equal `segmented_attention` over the same columns as masks: float32
    within 1e-6; bfloat16 within one bfloat16 rounding of the output (that path rounds the probabilities
    to bfloat16 before the value product, the kernel keeps them float32)."""
    B, K, G, D, S1, S2 = 6, 3, 3, 64, 45, 8
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(B, 1, K * G, D)), dtype)
    k1, k2 = (jnp.asarray(rng.normal(size=(B, K, D, s)), dtype) for s in (S1, S2))
    v1, v2 = (jnp.asarray(rng.normal(size=(B, K, s, D)), dtype) for s in (S1, S2))
    n1 = jnp.asarray([0, 5, 45, 17, 0, 30], jnp.int32)
    n2 = jnp.asarray([1, 3, 8, 8, 2, 5], jnp.int32)
    got = jax.jit(cpu_attention.segmented_decode_attention)(q, [(k1, v1, n1), (k2, v2, n2)])
    masks = [(jnp.arange(s)[None] < n[:, None])[:, None] for s, n in ((S1, n1), (S2, n2))]
    want = segmented_attention(q, [(k1, v1, masks[0]), (k2, v2, masks[1])])
    assert got.dtype == want.dtype and got.shape == want.shape
    tol = 1e-6 if dtype == "float32" else 2 ** -7
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=tol, rtol=tol)


@pytest.mark.usefixtures("kernel")
def test_too_many_query_heads_per_kv_head_is_refused():
    q = jnp.zeros((1, 1, 9, 16))
    with pytest.raises(ValueError, match="at most 8 query heads"):
        cpu_attention.decode_attention(q, jnp.zeros((1, 1, 16, 4)), jnp.zeros((1, 1, 4, 16)), jnp.ones(1, jnp.int32))


def test_build_without_a_compiler_names_the_fix(tmp_path):
    with pytest.raises(RuntimeError, match="no-such-compiler.* not found\\): install g\\+\\+"):
        cpu_attention.build(cxx=str(tmp_path / "no-such-compiler"), cache=tmp_path)


@pytest.mark.usefixtures("kernel")
def test_loading_the_kernel_keeps_denormals():
    """Linking with -ffast-math (crtfastmath.o) would turn on flush-to-zero and denormals-are-zero for the
    whole process when the library is loaded. In a fresh interpreter (this one may have loaded it already),
    a float32 denormal times 1 stays itself after the kernel is loaded."""
    code = ("import numpy as np\n"
            "from marljax.sampling.engine import cpu_attention\n"
            "tiny = np.float32(1e-39)\n"
            "assert tiny * np.float32(1) != 0\n"
            "assert cpu_attention.unavailable() is None\n"
            "print(float(tiny * np.float32(1)))\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert run.returncode == 0, run.stderr[-2000:]
    value = float(run.stdout.split()[-1])
    print(f"float32 1e-39 * 1 after loading the kernel: {value!r}")
    assert value != 0


def test_cpu_id_names_the_machine_and_an_aarch64_cpu():
    """The cache key's CPU on aarch64, whose /proc/cpuinfo has no "model name" or "flags": the machine and
    the Features and CPU implementer/architecture/variant/part lines, so two cores differ."""
    def cpuinfo(part, features):
        core = (f"processor\t: {{}}\nBogoMIPS\t: 243.75\nFeatures\t: {features}\nCPU implementer\t: 0x41\n"
                f"CPU architecture: 8\nCPU variant\t: 0x1\nCPU part\t: {part}\nCPU revision\t: 1\n\n")
        return "".join(core.format(i) for i in range(4))
    neoverse_n1 = cpu_attention._cpu_id(cpuinfo("0xd0c", "fp asimd aes crc32 atomics"), machine="aarch64")
    neoverse_v1 = cpu_attention._cpu_id(cpuinfo("0xd40", "fp asimd aes crc32 atomics"), machine="aarch64")
    with_sve = cpu_attention._cpu_id(cpuinfo("0xd0c", "fp asimd aes crc32 atomics sve"), machine="aarch64")
    assert len({neoverse_n1, neoverse_v1, with_sve}) == 3
    assert neoverse_n1.splitlines()[0] == "aarch64" and "CPU part\t: 0xd0c" in neoverse_n1
    assert "processor" not in neoverse_n1 and "BogoMIPS" not in neoverse_n1  # per core or per boot: not the CPU
    x86 = "processor\t: 0\nmodel name\t: Xeon\ncpu MHz\t\t: 2100.0\nflags\t\t: fpu sse avx512f\n"
    assert cpu_attention._cpu_id(x86, machine="x86_64") == "x86_64\nflags\t\t: fpu sse avx512f\nmodel name\t: Xeon"


def fake_compiler(tmp_path, race=False):
    """A "compiler" that writes "ours" to its -o path; with race, a concurrent build's library ("theirs")
    appears in the cache while ours is being linked."""
    script = tmp_path / "fake-cxx"
    script.write_text(f"#!{sys.executable}\n"
                      "import pathlib, sys\n"
                      "if '--version' in sys.argv:\n    print('fake-cxx 1.0')\n    sys.exit()\n"
                      "out = pathlib.Path(sys.argv[sys.argv.index('-o') + 1])\n"
                      f"if {race} and out.suffix == '.so': (out.parent.parent / out.name).write_text('theirs')\n"
                      "out.write_text('ours')\n")
    script.chmod(0o755)
    return str(script)


def test_build_does_not_replace_a_cached_library(tmp_path):
    """A library already in the cache (another process may have it loaded) stays the same file: found
    before compiling, or put there by a concurrent build while this one compiled."""
    cache = tmp_path / "cache"
    lib = cpu_attention.build(cxx=fake_compiler(tmp_path), cache=cache)
    first = lib.stat()
    assert lib.read_text() == "ours" and list(cache.iterdir()) == [lib]
    assert cpu_attention.build(cxx=fake_compiler(tmp_path), cache=cache) == lib
    assert (lib.stat().st_ino, lib.stat().st_mtime_ns) == (first.st_ino, first.st_mtime_ns)

    raced = tmp_path / "raced"
    lib = cpu_attention.build(cxx=fake_compiler(tmp_path, race=True), cache=raced)
    assert lib.read_text() == "theirs" and list(raced.iterdir()) == [lib]


def test_build_compiles_fast_math_but_links_without_it(tmp_path, monkeypatch):
    """-ffast-math on the object's compile line only: on the link line it would add crtfastmath.o."""
    calls, real_run = [], subprocess.run

    def run(args, **kwargs):
        calls.append(args)
        return real_run(args, **kwargs)
    monkeypatch.setattr(cpu_attention.subprocess, "run", run)
    cpu_attention.build(cxx=fake_compiler(tmp_path), cache=tmp_path / "cache")
    version, compile_, link = calls
    assert "-ffast-math" in compile_ and "-c" in compile_
    assert "-ffast-math" not in link and "-shared" in link
