"""Dataset loaders: every fixture format loads, splits are deterministic, bad input gives clear errors."""
import json
import logging
import math
import pathlib

import grain
import numpy as np
import pytest

from marljax.tasks.data import DataError, load_task, split_indices
from marljax.tasks.problem import Problem

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
GSM8K = pathlib.Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"


def fixture(name: str) -> str:
    return str(FIXTURES / name)


# --- formats ----------------------------------------------------------------------------------------

def test_gsm8k_jsonl():
    problems = load_task("gsm8k", path=fixture("gsm8k.jsonl"), split="all")
    assert [p.answer for p in problems] == ["12", "2,125", "4.5"]
    assert problems[0].kind == "math" and problems[0].question.startswith("Tom has 3 boxes")
    assert problems[1].reward(r"\boxed{2125}") == 1.0 and problems[2].reward(r"\boxed{9/2}") == 1.0


def test_gsm8k_directory_uses_its_own_split_files():
    if not GSM8K.exists():
        pytest.skip(f"GSM8K not found at {GSM8K}; put train.jsonl and test.jsonl there to run this test")
    train, test = (load_task("gsm8k", path=str(GSM8K), split=s) for s in ("train", "test"))
    assert (len(train), len(test)) == (7473, 1319)
    assert test[0].answer == "18" and test[0].id == "gsm8k/test/0"
    assert not {p.id for p in train} & {p.id for p in test}


def test_dapo_math_processed_jsonl_strips_the_answer_format_instructions():
    problems = load_task("dapo_math", path=fixture("dapo_math_processed.jsonl"), split="all")
    assert len(problems) == 20
    p = problems[3]
    assert p.question == r"Find the value of $3 + \frac{1}{2}$ times $2$." and p.answer == "7"
    assert p.id == "dapo_math/dapo-0003" and p.meta["source"] == "math_dapo"


def test_dapo_math_raw_parquet(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet", reason="pyarrow is needed to write the parquet fixture")
    import pyarrow as pa
    rows = [json.loads(line) for line in open(fixture("dapo_math_processed.jsonl"))]
    raw = [{"data_source": r["data_source"], "prompt": r["source_prompt"], "ability": r["ability"],
            "reward_model": r["reward_model"], "extra_info": r["extra_info"]} for r in rows]  # the raw release
    pq.write_table(pa.Table.from_pylist(raw), tmp_path / "dapo-math-17k.parquet")
    from_parquet = load_task("dapo_math", path=str(tmp_path / "dapo-math-17k.parquet"), split="all")
    from_jsonl = load_task("dapo_math", path=fixture("dapo_math_processed.jsonl"), split="all")
    assert from_parquet == from_jsonl


def test_competition_math_answer_from_solution_or_field():
    problems = load_task("math", path=fixture("math.jsonl"), split="all")
    assert [p.answer for p in problems] == [r"\frac{3}{4}", "2", "[0,1)"]
    assert problems[0].meta == {"level": "Level 1", "type": "Prealgebra"}
    assert problems[2].id == "math/test/algebra/1.json"
    assert problems[0].reward(r"\boxed{0.75}") == 1.0


def test_mbpp_original_and_sanitized():
    original = load_task("mbpp", path=fixture("mbpp.jsonl"), split="all")
    assert [p.id for p in original] == ["mbpp/1", "mbpp/2"]
    assert "assert min_of_two(1, 2) == 1" in original[0].question and len(original[0].tests) == 3
    assert original[1].tests[0] == {"assert": "assert gcd2(12, 18) == 6", "setup": "import math"}
    assert original[1].reward("```python\ndef gcd2(a, b):\n    return math.gcd(a, b)\n```") == 1.0
    sanitized = load_task("mbpp", path=fixture("mbpp_sanitized.json"), split="all")
    assert sanitized[0].question.startswith("Write a python function to reverse a string.")
    assert sanitized[0].reward("```python\ndef rev(s):\n    return s[::-1]\n```") == 1.0
    assert sanitized[0].reward("```python\ndef rev(s):\n    return s\n```") == 0.0


DEEPCODER_SOLUTIONS = {  # one right and one wrong program per fixture row
    0: ("a, b = map(int, input().split())\nprint(a + b)", "print(5)"),
    1: ("def add_one(x):\n    return x + 1", "def add_one(x):\n    return x"),
    2: ("class Solution:\n    def pairSums(self, nums: List[int]) -> List[int]:\n"
        "        return [a + b for a, b in zip(nums, nums[1:])]",
        "class Solution:\n    def pairSums(self, nums: List[int]) -> List[int]:\n        return nums"),
    3: ("n = int(input())\nfor _ in range(n):\n    input()\nprint(n)", "print(2)"),
}


def test_deepcoder_all_test_styles_grade_through_the_sandbox():
    problems = load_task("deepcoder", path=fixture("deepcoder.jsonl"), split="all")
    assert [len(p.tests) for p in problems] == [2, 2, 2, 2]
    assert problems[0].tests[0] == {"input": "2 3\n", "output": "5\n"}
    assert "```python\nclass Solution:\n    def pairSums(self, nums: List[int]) -> List[int]:\n```" \
        in problems[2].question
    for i, (right, wrong) in DEEPCODER_SOLUTIONS.items():
        assert problems[i].reward(f"```python\n{right}\n```") == 1.0, i
        assert problems[i].reward(f"```python\n{wrong}\n```") == 0.0, i


def test_deepcoder_questions_carry_the_livecodebench_format_instructions():
    """As the paper's prompts: stdin-to-stdout problems say so; call-tested problems (starter code or a
    named function) say to keep the given signature; both ask for one ```python block."""
    problems = load_task("deepcoder", path=fixture("deepcoder.jsonl"), split="all")
    for i in (0, 3):
        assert "read the input from standard input and write the answer to standard output" in problems[i].question
        assert "signature" not in problems[i].question
    for i in (1, 2):
        assert "implement the function with the given signature" in problems[i].question
        assert "standard input" not in problems[i].question
    assert all(p.question.count("```python") == 1 for p in problems)


def _deepcoder_rows(path, n, empty=()):
    """n stdin DeepCoder rows (row i prints i); the rows in `empty` have no tests."""
    with open(path, "w") as f:
        for i in range(n):
            tests = [] if i in empty else [{"type": "stdin_stdout", "input": "", "output": f"{i}\n"}]
            f.write(json.dumps({"problem": f"Print {i}.", "tests": json.dumps(tests), "id": f"r{i}"}) + "\n")


def test_deepcoder_split_is_the_papers(tmp_path):
    """Rows without tests are dropped first; then a seed-42 shuffle holds out the first 1000 rows (the
    paper's `dataset.shuffle(seed=42).select(range(1000))`), the rest train."""
    path, empty = tmp_path / "deepcoder.jsonl", {3, 500, 1100}
    _deepcoder_rows(path, 1200, empty)
    kept = [f"deepcoder/r{i}" for i in range(1200) if i not in empty]
    test = load_task("deepcoder", path=str(path), split="test")
    train = load_task("deepcoder", path=str(path), split="train")
    order = np.random.default_rng(42).permutation(len(kept))
    assert [p.id for p in test] == [kept[i] for i in order[:1000]]
    assert [p.id for p in train] == [kept[i] for i in order[1000:]]
    assert len(load_task("deepcoder", path=str(path), split="test", holdout=0.1)) == math.ceil(0.1 * len(kept))
    shards = tmp_path / "shards"  # a directory of shards (no train/test files) is the same source
    shards.mkdir()
    lines = path.read_text().splitlines(keepends=True)
    (shards / "train-00000-of-00002.jsonl").write_text("".join(lines[:700]))
    (shards / "train-00001-of-00002.jsonl").write_text("".join(lines[700:]))
    assert load_task("deepcoder", path=str(shards), split="test") == test


def test_deepcoder_runtime_results_filter_tests_as_the_paper(tmp_path):
    """With runtime results, a row keeps only its tests whose status is "passed"; a row left with none is
    dropped; a row without an entry keeps all its tests."""
    path = tmp_path / "deepcoder.jsonl"
    rows = [[{"type": "stdin_stdout", "input": "", "output": f"{i}{j}\n"} for j in range(3)] for i in range(3)]
    path.write_text("".join(json.dumps({"problem": f"p{i}", "tests": json.dumps(t), "id": f"r{i}"}) + "\n"
                            for i, t in enumerate(rows)))
    results = tmp_path / "runtime_results.json"
    results.write_text(json.dumps({"0": {"0": {"status": "passed"}, "1": {"status": "failed"},
                                         "2": {"status": "passed"}},
                                   "1": {"0": {"status": "timeout"}}}))
    problems = load_task("deepcoder", path=str(path), split="all", runtime_results=str(results))
    assert [p.id for p in problems] == ["deepcoder/r0", "deepcoder/r2"]
    assert [t["output"] for t in problems[0].tests] == ["00\n", "02\n"] and len(problems[1].tests) == 3
    with pytest.raises(ValueError, match=r"takes no options \['runtime_result'\] \(it takes \['runtime_results'\]\)"):
        load_task("deepcoder", path=str(path), split="all", runtime_result=str(results))


def test_livecodebench_release_format():
    [p] = load_task("deepcoder", path=fixture("livecodebench.jsonl"), split="all")
    assert p.id == "deepcoder/abc000_a" and len(p.tests) == 2  # public + private
    assert p.reward("```python\nprint(2 * int(input()))\n```") == 1.0


def test_humaneval_from_the_package():
    problems = load_task("humaneval", split="all")
    assert len(problems) == 164 and problems[0].id == "HumanEval/0"
    assert problems[0].tests[0]["setup"] == problems[0].meta["prompt"]
    assert "check(has_close_elements)" in problems[0].tests[0]["assert"]


def test_arith_through_the_registry():
    problems = load_task("arith", split="test", seed=3, limit=5, operands=4, digits=1, operations="+-*")
    assert len(problems) == 5 and all(p.kind == "math" for p in problems)
    assert problems == load_task("arith", split="test", seed=3, limit=5, operands=4, digits=1, operations="+-*")
    with pytest.raises(ValueError, match="takes no path"):
        load_task("arith", path="x")


def test_parity_through_the_registry():
    """The smoke-test task: deterministic problems, reward 1 iff the answer has an even number of characters."""
    problems = load_task("parity", split="test", seed=3, limit=5)
    assert len(problems) == 5 and all(p.kind == "math" for p in problems)
    assert problems == load_task("parity", split="test", seed=3, limit=5)
    assert [p.question for p in problems] != [p.question for p in load_task("parity", split="train", seed=3, limit=5)]
    assert [problems[0].reward(t) for t in ("", "a", "ab", "\\boxed{12}", "\\boxed{1}")] == [1.0, 0.0, 1.0, 1.0, 0.0]
    with pytest.raises(ValueError, match="takes no path and no options"):
        load_task("parity", digits=2)


def test_grain_dataset():
    ds = grain.MapDataset.source(load_task("gsm8k", path=fixture("gsm8k.jsonl"), split="all"))
    assert len(ds) == 3 and isinstance(ds[0], Problem)
    assert sorted(p.answer for p in ds.shuffle(seed=0)) == sorted(["12", "2,125", "4.5"])


def test_tfds_array_record_source(tmp_path, monkeypatch):
    tfds = pytest.importorskip("tensorflow_datasets", reason="tensorflow-datasets is not installed")
    pytest.importorskip("array_record", reason="array-record is not installed")

    class TinyGsm8k(tfds.core.GeneratorBasedBuilder):
        VERSION = tfds.core.Version("1.0.0")

        def _info(self):
            text = tfds.features.Text()
            return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(
                {"question": text, "answer": text}))

        def _split_generators(self, dl_manager):
            return {"train": self._generate_examples()}

        def _generate_examples(self):
            for i in range(10):
                yield i, {"question": f"What is {i} + 1?", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"}

    TinyGsm8k(data_dir=str(tmp_path), file_format="array_record").download_and_prepare()
    monkeypatch.setenv("TFDS_DATA_DIR", str(tmp_path))
    problems = load_task("gsm8k", path="tfds:tiny_gsm8k:train", split="all")
    assert sorted(int(p.answer) for p in problems) == list(range(1, 11))
    assert len(load_task("gsm8k", path="tfds:tiny_gsm8k", split="test")) == 1


def test_hf_source_without_datasets_says_what_to_do():
    try:
        import datasets  # noqa: F401
        pytest.skip("`datasets` is installed; the error path for its absence is not reachable here")
    except ImportError:
        pass
    with pytest.raises(DataError, match="pip install datasets"):
        load_task("dapo_math", path="hf:open-r1/DAPO-Math-17k-Processed:en")


# --- splits -----------------------------------------------------------------------------------------

def test_split_is_deterministic_disjoint_and_90_10():
    n = 14116  # DAPO-Math-17k-Processed "en": 1412 held out, as in the paper
    train, test = split_indices(n, "train", 42, 0.1), split_indices(n, "test", 42, 0.1)
    assert len(test) == math.ceil(0.1 * n) == 1412 and len(train) == n - 1412
    assert sorted(np.concatenate([train, test]).tolist()) == list(range(n))
    assert (split_indices(n, "test", 42, 0.1) == test).all()
    assert not (split_indices(n, "test", 43, 0.1) == test).all()
    # the rows datasets' train_test_split(test_size=0.1, seed=42) selects
    assert (test == np.random.default_rng(42).permutation(n)[:1412]).all()


def test_file_split_and_limit():
    train = load_task("dapo_math", path=fixture("dapo_math_processed.jsonl"), split="train")
    test = load_task("dapo_math", path=fixture("dapo_math_processed.jsonl"), split="test")
    assert (len(train), len(test)) == (18, 2) and not {p.id for p in train} & {p.id for p in test}
    assert load_task("dapo_math", path=fixture("dapo_math_processed.jsonl"), split="train", limit=5) == train[:5]


# --- errors -----------------------------------------------------------------------------------------

def test_missing_file_says_where_to_put_it(tmp_path):
    with pytest.raises(DataError, match=r"no such file.*task\.path"):
        load_task("gsm8k", path=str(tmp_path / "gsm8k.jsonl"))
    with pytest.raises(DataError, match=r"needs task\.path"):
        load_task("dapo_math")


def test_malformed_row_names_file_line_and_field():
    with pytest.raises(DataError, match=r"gsm8k_malformed\.jsonl line 2: field 'answer' has no final '####"):
        load_task("gsm8k", path=fixture("gsm8k_malformed.jsonl"), split="all")
    with pytest.raises(DataError, match=r"deepcoder_malformed\.jsonl line 2: field 'tests' is not valid JSON"):
        load_task("deepcoder", path=fixture("deepcoder_malformed.jsonl"), split="all")


def test_invalid_json_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "answer": "#### 1"}\n{"question": \n')
    with pytest.raises(DataError, match=r"bad\.jsonl line 2: invalid JSON"):
        load_task("gsm8k", path=str(bad), split="all")


def test_missing_field_is_named(tmp_path):
    bad = tmp_path / "math.jsonl"
    bad.write_text(json.dumps({"question": "no problem field", "answer": "1"}) + "\n")
    with pytest.raises(DataError, match=r"math\.jsonl line 1: field 'problem' is missing"):
        load_task("math", path=str(bad), split="all")


def test_skip_malformed_counts_the_skips(caplog):
    with caplog.at_level(logging.WARNING, logger="marljax.tasks.data"):
        problems = load_task("gsm8k", path=fixture("gsm8k_malformed.jsonl"), split="all", skip_malformed=True)
    assert [p.answer for p in problems] == ["2", "7"]
    assert "skipped 1 malformed rows" in caplog.text and "line 2" in caplog.text


def test_unknown_task_and_split():
    with pytest.raises(ValueError, match="unknown task 'gsm9k'"):
        load_task("gsm9k")
    with pytest.raises(ValueError, match="split='valid'"):
        load_task("arith", split="valid")


def test_problem_kinds_are_one_registry():
    """`Problem.reward` and the workflows' parse check read a kind only through `tasks.kinds`: an unknown
    kind fails in both with the known kinds named, and a kind cannot be registered twice."""
    from marljax.tasks.kinds import KINDS, ProblemKind, register_kind
    from marljax.workflows.base import answer_missing

    assert set(KINDS) == {"math", "code"}
    with pytest.raises(ValueError, match=r"Unknown problem kind 'poem'; expected one of \['code', 'math'\]"):
        Problem(id="p", question="q", kind="poem").reward("x")
    with pytest.raises(ValueError, match="Unknown problem kind 'poem'"):
        answer_missing("x", "poem")
    with pytest.raises(ValueError, match="already registered"):
        register_kind(ProblemKind("math", KINDS["math"].grade, KINDS["math"].answer_missing))
    assert answer_missing("no box", "math") and not answer_missing(r"\boxed{3}", "math")
    assert Problem(id="p", question="1+2", kind="math", answer="3").reward(r"\boxed{3}") == 1.0
