"""Every workflow end to end on the real SmolLM2-135M-Instruct: GSM8K, arithmetic and HumanEval problems.

Checks what a scripted policy cannot: real prompts render and decode, transcripts are readable text, and
each episode's reward equals an independent re-grade of its final answer (math-verify for math, the
sandbox for HumanEval). Slow: `make test ARGS="-m slow -k e2e"`.
"""
from __future__ import annotations

import json
import pathlib

import pytest

from marljax.models import ChatCodec, load_model, load_tokenizer
from marljax.sampling import SamplingParams, generate
from marljax.tasks.code import grade_code
from marljax.tasks.data import load_task
from marljax.tasks.math import grade
from marljax.workflows import Completion, get_workflow
from marljax.workflows.evaluation import evaluate_workflow

GSM8K = pathlib.Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"
ROUTE = {r: "base" for r in ("generator", "evaluator", "aggregator", "orchestrator", "worker", "synthesizer")}
ROLES = {"single": {"generator"}, "voting": {"generator", "aggregator"}, "eval_opt": {"generator", "evaluator"},
         "orch_workers": {"orchestrator", "worker", "synthesizer"}}


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    model = load_model("smollm2-135m-instruct")
    codec = ChatCodec(load_tokenizer("smollm2-135m-instruct"))

    def sample_fn(set_name, prompts, seed):
        assert set_name == "base"
        out = generate(model, prompts, SamplingParams(max_new_tokens=48, temperature=0.7, seed=seed,
                                                      stop_token_ids=codec.stop_token_ids))
        return [Completion(t, lp, not f) for t, lp, f in zip(out.tokens, out.logprobs, out.finished)]
    return sample_fn, codec


@pytest.fixture(scope="module")
def problems():
    if not (GSM8K / "test.jsonl").exists():
        pytest.skip(f"GSM8K not found: put test.jsonl under {GSM8K}")
    return (load_task("gsm8k", str(GSM8K), split="test", limit=2)
            + load_task("arith", split="test", limit=2, operands=2, digits=1, operations="+")
            + load_task("humaneval", split="test", limit=2))


@pytest.mark.slow  # ≈ 6.5 min for the four workflows on 2 cores
@pytest.mark.parametrize("name", sorted(ROLES))
def test_workflow_end_to_end_on_smollm2(smollm2, problems, name, tmp_path):
    sample_fn, codec = smollm2
    ev = evaluate_workflow(get_workflow(name), problems, sample_fn, codec, ROUTE, seed=0, progress=False)
    assert [t["problem_id"] for t in ev.transcripts] == [p.id for p in problems]
    kinds = [p.id.split("/")[0].lower() for p in problems]
    assert kinds == ["gsm8k", "gsm8k", "arith", "arith", "humaneval", "humaneval"]
    for p, t in zip(problems, ev.transcripts):
        assert {c["role"] for c in t["calls"]} == ROLES[name]
        for c in t["calls"]:  # readable: real text in, real text out
            assert all(isinstance(m["content"], str) and m["content"] for m in c["messages"])
            assert isinstance(c["response"], str) and "\ufffd" not in c["response"]
        regraded = grade(t["final"], p.answer) if p.kind == "math" else grade_code(t["final"], p.tests)
        assert t["reward"] == regraded, (p.id, t["final"])
    assert ev.metrics["pass@1"] == sum(t["reward"] for t in ev.transcripts) / len(problems)
    (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(t) + "\n" for t in ev.transcripts))
