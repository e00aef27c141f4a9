"""The experiment matrix: 42 cells with the paper's hyperparameters, loadable configs, and a memory
formula that matches the live device memory of a tiny-scale Qwen3-0.6B-shaped run."""
import dataclasses
import gc
import pathlib

import jax
import pytest
from flax import nnx

from marljax import matrix
from marljax.config import load_config
from marljax.models.decoder import Decoder, init_cache
from marljax.models.lora import LoRAConfig, init_lora, stack_adapters
from marljax.models.presets import PRESETS
from marljax.rl.step import make_optimizer


def test_dry_run_prints_one_row_per_cell(capsys):
    matrix.main(["--dry-run", "--accelerator", "h100", "--slices", "3"])
    out = capsys.readouterr().out.splitlines()
    names = [c.name for c in matrix.cells()]
    assert len(names) == len(set(names)) == 42
    rows = [line for line in out if line.split(" ", 1)[0] in names]
    assert len(rows) == 42
    assert sum(n.startswith("single-") for n in names) == 6
    assert sum(n.endswith("-isolated") for n in names) == 18
    assert "plan: 42 cells on 3 slice(s)" in out[-1]


def test_cell_configs_carry_the_paper_setup(tmp_path):
    matrix.main(["--accelerator", "v5e-8", "--out", str(tmp_path)])
    files = sorted(tmp_path.glob("*.yaml"))
    assert len(files) == 42 and (tmp_path / "plan.md").exists()
    cfg = load_config(str(tmp_path / "voting-math-qwen3-1.7b-isolated.yaml"))
    assert (cfg.model, cfg.policy, cfg.workflow.name, cfg.task.name) == ("qwen3-1.7b", "isolated", "voting",
                                                                          "dapo_math")
    assert (cfg.rl.problems_per_step, cfg.rl.rollouts, cfg.rl.minibatch, cfg.rl.minibatch_size) == (64, 8, "paper", 512)
    assert (cfg.rl.clip_low, cfg.rl.clip_high, cfg.rl.dual_clip) == (0.2, 0.28, 3.0)
    assert (cfg.optim.lr, cfg.optim.warmup_steps, cfg.optim.schedule) == (2e-5, 15, "cosine")
    assert (cfg.lora.rank, cfg.lora.alpha, cfg.lora.targets) == (64, 32.0, ["all-linear"])
    assert (cfg.sampling.temperature, cfg.sampling.max_new_tokens, cfg.eval.every, cfg.steps) == (0.7, 5120, 10, 300)
    assert cfg.mesh.data * cfg.mesh.fsdp * cfg.mesh.tensor == 8 and cfg.sampling.max_cache_tokens > 0
    assert (cfg.sampling.max_prompt_tokens, cfg.task.eval_n) == (20480, None)  # None: every held-out problem
    assert cfg.sampling.mix_sets  # isolated LoRA sets decode in one batch (one pool, one copy of the base)
    code = load_config(str(tmp_path / "eval_opt-code-qwen3-4b-shared.yaml"))
    assert code.task.name == "deepcoder" and code.workflow.max_iterations == 2 and not code.sampling.mix_sets
    assert (code.sampling.max_new_tokens, code.sampling.max_prompt_tokens) == (2048, 10240)
    single = load_config(str(tmp_path / "single-code-qwen3-0.6b.yaml"))
    assert (single.sampling.max_new_tokens, single.sampling.max_prompt_tokens) == (2048, 4096)


def test_code_cells_are_sized_for_2048_token_responses():
    """A code cell's stages, memory and time use the paper's 2048-token code responses (math 5120), and
    no stage's prompt is over the paper's cap."""
    code, math_ = matrix.Cell("voting", "code", "qwen3-0.6b", "shared"), matrix.Cell("voting", "math", "qwen3-0.6b",
                                                                                    "shared")
    assert (code.max_response, math_.max_response) == (2048, 5120)
    assert [s.prompt for s in code.stages()] == [matrix.PROMPT_TOKENS["code"], matrix.PROMPT_TOKENS["code"] + 3 * 2048]
    for cell in matrix.cells():
        assert max(s.prompt for s in cell.stages()) <= cell.limits.prompt
    acc = matrix.ACCELERATORS["h100"]
    assert matrix.estimate(code, acc).sample_s < 0.5 * matrix.estimate(math_, acc).sample_s


def test_committed_paper_cells_are_the_generators_output(tmp_path):
    """configs/paper/ is `python -m marljax.matrix --accelerator h100 --out configs/paper`, byte for byte:
    after changing the config or the matrix, regenerate it with that command."""
    committed = pathlib.Path(__file__).resolve().parent.parent / "configs" / "paper"
    matrix.main(["--accelerator", "h100", "--out", str(tmp_path)])
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted(p.name for p in committed.iterdir())
    for name in names:
        assert (tmp_path / name).read_text() == (committed / name).read_text(), f"configs/paper/{name} is stale"


def test_cell_option_prints_the_config_path(tmp_path, capsys):
    matrix.main(["--cell", "single-code-qwen3-0.6b", "--out", str(tmp_path)])
    assert capsys.readouterr().out.strip() == str(tmp_path / "single-code-qwen3-0.6b.yaml")
    with pytest.raises(SystemExit):
        matrix.main(["--cell", "no-such-cell", "--out", str(tmp_path)])


def _live_bytes() -> int:
    gc.collect()  # arrays an earlier test left in reference cycles must not be freed mid-measurement
    return sum(x.nbytes for x in jax.live_arrays())


def test_memory_formula_matches_a_tiny_qwen3_run():
    """Qwen3-0.6B widths and vocabulary with 2 layers, bfloat16 base, two rank-64 LoRA sets with Adam,
    a 4 × 512 KV cache and the sampler's per-layer weights with both sets stacked for per-row adapters
    (`sampling.mix_sets`, as the matrix's isolated cells run): the live device bytes match the
    formula term by term to 1e-5 relative (measured: every term byte-exact but the optimizer state, which
    the formula leaves 64 bytes short — Adam's step counters and injected hyperparameters)."""
    cfg = dataclasses.replace(PRESETS["qwen3-0.6b"], num_layers=2, dtype="bfloat16")
    lora, sets, rows, length = LoRAConfig(rank=matrix.LORA_RANK, alpha=matrix.LORA_ALPHA), 2, 4, 512
    est = matrix.memory(cfg, dtype="bfloat16", n_sets=sets, n_roles=2, rank=lora.rank, mesh=(1, 1, 1),
                        cache_rows=rows, cache_len=length, train_rows=0, train_len=0, response_len=0)
    measured = {}
    start = _live_bytes()
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    measured["base"] = _live_bytes() - start
    adapters = [init_lora(cfg, lora, jax.random.key(i)) for i in range(sets)]
    measured["lora"] = _live_bytes() - start - measured["base"]
    opt = make_optimizer()
    states = [opt.init(a) for a in adapters]
    measured["optimizer"] = _live_bytes() - start - measured["base"] - measured["lora"]
    cache = init_cache(cfg, rows, length)
    measured["kv_cache"] = _live_bytes() - start - sum(measured.values())
    layers, stacked = model.layer_list(), stack_adapters(adapters)  # a mix_sets stream's (one rank)
    measured["rollout_weights"] = _live_bytes() - start - sum(measured.values())
    for term, value in measured.items():
        assert getattr(est, term) == pytest.approx(value, rel=1e-5), term
    total = est.base + est.lora + est.optimizer + est.kv_cache + est.rollout_weights
    assert total == pytest.approx(sum(measured.values()), rel=1e-5)
    del model, adapters, states, cache, layers, stacked


def test_mesh_choice_replicates_small_bases_and_shards_large_ones():
    assert matrix.choose_mesh(PRESETS["qwen3-0.6b"], matrix.ACCELERATORS["v5e-8"]) == (8, 1, 1)
    assert matrix.choose_mesh(PRESETS["qwen3-4b"], matrix.ACCELERATORS["v5e-8"]) == (2, 4, 1)
    assert matrix.choose_mesh(PRESETS["qwen3-4b"], matrix.ACCELERATORS["h200"]) == (8, 1, 1)


def test_cpu_accelerator_is_the_measured_roof():
    """The `cpu` row's rates are what `bench/roofline.py` measured and published (docs/benchmarks.md,
    "CPU roof"), not a hand-set constant: re-measuring means updating both."""
    import pathlib
    import re
    doc = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md").read_text()
    section = doc[doc.index("\n## CPU roof\n"):]
    gflops, gbs = (float(x) for x in re.findall(r"median \*\*([\d.]+)\*\*", section)[:2])
    memory = float(re.search(r"memory size: ([\d.]+) GB", section).group(1))
    cpu = matrix.ACCELERATORS["cpu"]
    assert (cpu.tflops * 1e3, cpu.hbm_gbs, cpu.hbm_gb) == pytest.approx((gflops, gbs, memory))


def test_engine_plan_and_rollout_time_follow_the_real_tokens():
    """The engine's pool is the memory model's KV budget split over the batch ranks and holds one sequence
    of the longest stage; slots are capped by the samples in flight; the rollout time follows the real
    tokens (half-length responses: about half the time, less since their steps read shorter contexts)
    and a GRPO group's shared prompt is prefilled once (fewer rollouts per prompt: more prefill)."""
    acc = matrix.ACCELERATORS["v5e-8"]
    for name in ("eval_opt-math-qwen3-4b-isolated", "single-code-qwen3-0.6b", "voting-math-qwen3-1.7b-shared"):
        cell = next(c for c in matrix.cells() if c.name == name)
        est = matrix.estimate(cell, acc)
        plan, cfg = est.engine, PRESETS[cell.model]
        per_chip = (plan.pages - 1) * plan.page_size * matrix.kv_bytes_per_token(cfg, acc.dtype)
        assert per_chip <= est.max_cache_tokens / plan.ranks * matrix.kv_bytes_per_token(cfg, acc.dtype)
        assert (plan.pages - 1) * plan.page_size >= plan.context and plan.ranks == est.mesh[0] * est.mesh[1]
        assert 1 <= plan.slots <= -(-plan.in_flight // plan.ranks)
        half = matrix.estimate(cell, acc, response_fill=0.5)
        assert 0.3 * est.sample_s < half.sample_s < 0.55 * est.sample_s, (name, est.sample_s, half.sample_s)
    single = next(c for c in matrix.cells() if c.name == "single-math-qwen3-4b")
    est = matrix.estimate(single, acc)
    args = (single, PRESETS[single.model], acc, est.mesh, est.engine, 512)
    assert matrix._sampling_seconds(*args, 1, 1.0) > matrix._sampling_seconds(*args, 8, 1.0)
