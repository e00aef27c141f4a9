"""The experiment matrix: 42 cells with the paper's hyperparameters, loadable configs, and a memory
formula that matches the live device memory of a tiny-scale Qwen3-0.6B-shaped run."""
import dataclasses
import gc
import json
import math
import pathlib
import re

import jax
import pytest
from flax import nnx

from marljax import matrix
from marljax.config import load_config
from marljax.models.decoder import Decoder
from marljax.models.lora import LoRAConfig, init_lora, stack_adapters
from marljax.models.presets import PRESETS
from marljax.rl.step import make_optimizer
from marljax.sampling.engine.kv_pages import init_pages


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
    cache = init_pages(cfg, rows * length // 16, 16)  # the engine's pages for rows × length tokens
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
        half = matrix.estimate(cell, acc, lengths=matrix.length_fraction(0.5)).sample_at_s
        assert 0.3 * est.sample_s < half < 0.55 * est.sample_s, (name, est.sample_s, half)
    single = next(c for c in matrix.cells() if c.name == "single-math-qwen3-4b")
    est = matrix.estimate(single, acc)
    args = (single, PRESETS[single.model], acc, est.mesh, est.engine, 512)
    assert matrix._sampling_seconds(*args, 1, matrix.CAPS) > matrix._sampling_seconds(*args, 8, matrix.CAPS)


def _columns(out: str) -> dict[str, list[str]]:
    """The dry-run table's rows by cell name, split into columns."""
    names = {c.name for c in matrix.cells()}
    return {line.split()[0]: line.split() for line in out.splitlines() if line.split(" ", 1)[0] in names}


def test_lengths_at_fraction_one_are_the_caps(capsys):
    """`--length-fraction 1` prices every rollout exactly as the caps do, and a stated distribution never
    changes the caps' columns (the upper bound): the table's columns up to run_h and its slice are the bare
    `--dry-run`'s, byte for byte."""
    acc = matrix.ACCELERATORS["v5e-8"]
    for cell in matrix.cells():
        caps, one = matrix.estimate(cell, acc), matrix.estimate(cell, acc, lengths=matrix.length_fraction(1.0))
        assert (one.sample_at_s, one.eval_at_s, one.run_hours_at) == (caps.sample_s, caps.eval_s, caps.run_hours)
        assert (one.sample_s, one.eval_s) == (caps.sample_s, caps.eval_s)
    matrix.main(["--dry-run", "--accelerator", "v5e-8"])
    bare = capsys.readouterr().out
    matrix.main(["--dry-run", "--accelerator", "v5e-8", "--length-fraction", "0.5"])
    half = capsys.readouterr().out
    assert "L = at the caps" in bare and "L = at 0.5 of the caps" in half
    rows, half_rows = _columns(bare), _columns(half)
    assert len(rows) == 42
    for name, row in rows.items():
        assert row[-3] == row[-6] and row[-2] == row[-4]  # at L = the caps
        assert half_rows[name][:-3] + half_rows[name][-1:] == row[:-3] + row[-1:]
    total = lambda out: [float(x) for x in re.findall(r"wall-clock ≈ (\d+) h at the caps, (\d+) h at L", out)[0]]  # noqa: E731
    assert total(bare)[0] == total(bare)[1] == total(half)[0] > total(half)[1]


def test_half_lengths_price_every_cell_below_its_caps():
    acc = matrix.ACCELERATORS["v5e-8"]
    for cell in matrix.cells():
        e = matrix.estimate(cell, acc, lengths=matrix.length_fraction(0.5))
        assert e.sample_at_s < e.sample_s < math.inf and e.eval_at_s < e.eval_s, cell.name
        assert e.run_hours_at < e.run_hours, cell.name


def _run_dir(path: pathlib.Path, cap: str = "100", task: str = "arith") -> pathlib.Path:
    """A Voting run's directory as `python -m marljax.train` writes it, cut to what `--lengths` reads: its
    config and metrics with an eval record (whose lengths must not count) and two training steps with the
    generator at 40 and 60 tokens (0.5 of a 100-token cap) and the aggregator at 20 and 30 (0.25)."""
    path.mkdir()
    (path / "config.yaml").write_text(f"task:\n  name: {task}\nworkflow:\n  name: voting\n"
                                      f"sampling:\n  max_new_tokens: {cap}\n")
    records = [{"step": 0, "eval/role/generator/length_mean": 99.0, "eval/pass@1": 0.1},
               {"step": 1, "role/generator/length_mean": 40.0, "role/aggregator/length_mean": 20.0, "loss": 0.1},
               {"step": 2, "role/generator/length_mean": 60.0, "role/aggregator/length_mean": 30.0, "loss": 0.1}]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_lengths_of_a_run_are_per_role_fractions_of_its_cap(tmp_path, capsys):
    """`--lengths RUN_DIR`: each role's mean training length over the run's cap (eval records left out);
    a cell's role the run lacks takes the mean of the run's roles, and the header says so."""
    lengths = matrix.run_lengths(_run_dir(tmp_path / "run"))
    assert (lengths.fill("generator"), lengths.fill("aggregator")) == (0.5, 0.25)
    assert lengths.fill("worker") == lengths.fill("evaluator") == 0.375
    null_cap = matrix.run_lengths(_run_dir(tmp_path / "math", cap="null", task="dapo_math"))  # resolved: 5120
    assert null_cap.fill("generator") == pytest.approx(50 / 5120)
    acc = matrix.ACCELERATORS["v5e-8"]
    at = lambda cell, ls: matrix.estimate(cell, acc, lengths=ls).sample_at_s  # noqa: E731
    voting = matrix.Cell("voting", "math", "qwen3-0.6b", "shared")
    assert at(voting, matrix.length_fraction(0.25)) < at(voting, lengths) < at(voting, matrix.length_fraction(0.5))
    assert at(voting, lengths) != at(voting, matrix.length_fraction(0.375))  # per role, not their mean
    short_aggregator = matrix.Lengths((("aggregator", 0.25),), 1.0)  # each stage takes its own role's fraction
    assert at(voting, lengths) < at(voting, short_aggregator) < at(voting, matrix.CAPS)
    orch = matrix.Cell("orch_workers", "math", "qwen3-0.6b", "shared")  # no role of its in the run
    assert at(orch, lengths) == at(orch, matrix.length_fraction(0.375))
    matrix.main(["--dry-run", "--lengths", str(tmp_path / "run")])
    header = capsys.readouterr().out.splitlines()[1]
    assert f"at the lengths of {tmp_path / 'run'} (steps 1–2" in header and "cap, 100 tokens" in header
    assert "generator 0.50 of its cap" in header and "aggregator 0.25 of its cap" in header
    assert "not in the run, so at the mean of its roles (0.38): evaluator, orchestrator, synthesizer, worker" in header


@pytest.mark.parametrize("damage", ["no dir", "no metrics", "no lengths", "bad json", "bad config"])
def test_lengths_of_a_bad_run_dir_is_a_one_line_error(tmp_path, capsys, damage):
    run = tmp_path / "missing" if damage == "no dir" else _run_dir(tmp_path / "run")
    if damage == "no metrics":
        (run / "metrics.jsonl").unlink()
    elif damage == "no lengths":
        (run / "metrics.jsonl").write_text(json.dumps({"step": 0, "eval/role/generator/length_mean": 9.0}) + "\n")
    elif damage == "bad json":
        (run / "metrics.jsonl").write_text('{"step": 1, "role/generator/length_mean": 4')
    elif damage == "bad config":
        (run / "config.yaml").write_text("sampling:\n  max_new_tokenz: 3\n")
    with pytest.raises(SystemExit) as exit_:
        matrix.main(["--dry-run", "--lengths", str(run)])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and "Traceback" not in "\n".join(err)
    assert err[-1].startswith("python -m marljax.matrix: error: --lengths: ") and str(run) in err[-1]
    assert "--length-fraction" in err[-1] if damage == "no lengths" else "python -m marljax.train" in err[-1]


def test_a_compiled_decode_step_replaces_the_models():
    """`decode_step_s` (a compiled engine's step, `aot.CompiledEngine.step_s`) takes the roofline model's
    place: the rollout time is then prefill + that step × the decode steps (linear in it), the decode steps
    still following the lengths; the header names the source."""
    acc = matrix.ACCELERATORS["v5e-8"]
    cell = matrix.Cell("voting", "math", "qwen3-0.6b", "shared")  # fsdp 1: no all-gather to add
    est = matrix.estimate(cell, acc)
    args = (cell, PRESETS[cell.model], acc, est.mesh, est.engine, 512, 8)
    s = lambda d, ls=matrix.CAPS: matrix._sampling_seconds(*args, ls, d)  # noqa: E731
    assert s(None) == est.sample_s and s(0.0) < s(None)  # the model's steps take time; prefill alone is less
    assert s(0.02) - s(0.01) == pytest.approx(s(0.01) - s(0.0)) and s(0.02) > s(0.01)
    half = matrix.length_fraction(0.5)
    assert s(0.01, half) - s(0.0, half) < 0.55 * (s(0.01) - s(0.0))  # half the tokens: about half the steps
    compiled = matrix.estimate(cell, acc, lengths=half, decode_step_s=0.01)
    assert (compiled.sample_s, compiled.sample_at_s) == (s(0.01), s(0.01, half))
    assert (compiled.decode_step, est.decode_step) == (matrix.DECODE_AOT, matrix.DECODE_MODEL)
    head = lambda ests: matrix.table(ests, acc, 1).splitlines()[1]  # noqa: E731
    assert head([est]).startswith("# decode step: roofline model;")
    assert head([compiled]).startswith("# decode step: compiled engine's cost analysis (--aot);")
    assert "compiled engine's cost analysis (--aot) for 1 of 2 cells, roofline model for 1 of 2 cells" in head([compiled, est])


def test_repeated_cell_flags_each_count(capsys):
    """`--cell A --cell B C` takes all three (argparse's last-flag-wins dropped A), in the order given."""
    names = ["voting-math-qwen3-0.6b-shared", "single-code-qwen3-4b", "eval_opt-math-qwen3-1.7b-isolated"]
    matrix.main(["--dry-run", "--cell", names[0], "--cell", *names[1:]])
    rows = [line.split()[0] for line in capsys.readouterr().out.splitlines() if not line.startswith(("#", "cell"))]
    assert rows == names


def test_recorded_fits_plan_the_cells_configs(tmp_path, monkeypatch):
    """What an AOT refit records (`record_fit`: pages per rank, the update's token budget) is what the cell's
    engine plan and config then take on that accelerator, and only there."""
    monkeypatch.setattr(matrix, "FITS_FILE", tmp_path / "aot_fits.yaml")
    cell = next(c for c in matrix.cells() if c.name == "eval_opt-math-qwen3-4b-isolated")
    acc, h100 = matrix.ACCELERATORS["v5e-8"], matrix.ACCELERATORS["h100"]
    planned = matrix.estimate(cell, acc)
    assert matrix.cell_config(planned, acc).rl.micro_batch_tokens == matrix.longest_row(cell)
    matrix.record_fit("v5e-8", cell.name, "pages", planned.engine.pages - 100)
    matrix.record_fit("v5e-8", cell.name, "micro_batch_tokens", matrix.longest_row(cell) // 2)
    refit = matrix.estimate(cell, acc)
    cfg = matrix.cell_config(refit, acc)
    assert refit.engine.pages == planned.engine.pages - 100
    assert cfg.rl.micro_batch_tokens == matrix.longest_row(cell) // 2
    assert cfg.sampling.max_cache_tokens == (planned.engine.pages - 101) * planned.engine.page_size
    assert matrix.cell_config(matrix.estimate(cell, h100), h100).rl.micro_batch_tokens == matrix.longest_row(cell)


def test_a_cell_fits_only_as_planned_and_the_table_names_its_refits():
    """`CellIteration.fits` needs every program to fit, the engine with its planned pool and the short
    micro-batch at the planned budget; a refit that fits is named on its program's line, not counted as
    fitting."""
    from types import SimpleNamespace as NS
    gib = 2 ** 30
    plan = NS(ranks=8, slots=10, pages=3000, context=31020)

    def program(name, gb, rows=8):
        return NS(name=name, role="generator", rows=rows, length=768, response=256, total_bytes=gb * gib,
                  hbm_bytes=16 * gib, fits=gb <= 15.75, compile_s=1.0)

    def engine(gb, pages=3000):
        return NS(plan=NS(**{**vars(plan), "pages": pages}), total_bytes=gb * gib, hbm_bytes=16 * gib,
                  fits=gb <= 15.75, compile_s=1.0)

    fine = matrix.CellIteration("a", [program("update/long", 15.6), program("update/short", 11.4)], [engine(15.5)])
    short = matrix.CellIteration("b", [program("update/long", 15.6), program("update/short", 16.2)], [engine(15.5)],
                                 [(16384, program("update/short", 11.4, rows=160))])
    pool = matrix.CellIteration("c", [program("update/long", 9.0), program("update/short", 9.0)],
                                [engine(16.3), engine(15.6, pages=2800)])
    assert fine.fits and not short.fits and not pool.fits
    assert short.budget_refit[0] == 16384 and pool.refit.plan.pages == 2800 and pool.engine is pool.refit
    text = matrix.iteration_table([fine, short, pool], "v5e-8", recorded=True)
    verdicts = [line.split()[-1] for line in text.splitlines() if "= cell" in line]
    assert verdicts == ["yes", "NO", "NO"]
    assert "refit: fits at micro_batch_tokens=16384 (160×768, 11.40 GiB), recorded in aot_fits.yaml" in text
    assert "refit: fits at 2800 pages × 8 ranks, 10 slots (15.60 GiB), recorded in aot_fits.yaml" in text
