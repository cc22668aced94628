# The README's two commands: `make train` and `make test`. Both set up .venv on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.shardlight-installed

.PHONY: setup lock train test lint bench clean docs

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# The other packages at the versions the suite last passed with (.ci/constraints.txt, `make lock` writes it):
# a new release that breaks something (transformers 5.25 did, on 3 December 2026) breaks no set-up and no CI
# run until the lock is moved on purpose. pyproject.toml keeps the ranges a wheel's users get. To try the
# newest within them: `make setup CONSTRAINTS= VENV=.venv-new`, then `make test` and `make lock` with that VENV.
CONSTRAINTS ?= .ci/constraints.txt

# torch first, from its own spec: a plain `torch` requirement would pull a multi-GB CUDA build.
$(STAMP): $(BIN)/python pyproject.toml $(CONSTRAINTS)
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet $(if $(CONSTRAINTS),--constraint $(CONSTRAINTS)) -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

# Every installed package but torch (TORCH_SPEC's) and shardlight itself, pinned.
lock: setup
	$(BIN)/python -m pip freeze --exclude-editable | grep -v -i -e '^torch==' -e '^shardlight' | sort -f > .ci/constraints.txt

train: setup
	WANDB_SILENT=true $(BIN)/shardlight train $(RECIPE) $(ARGS)

# The 25 slowest tests end every run (CI's too), so a landing that makes the suite slower shows where.
PYTEST_ARGS ?= --durations=25
test: lint
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

# Habits checked on every test run: ruff, and the import contracts in pyproject.toml. The contracts are
# checked on the installed layout, callbacks/, launch/ and recipes/ inside shardlight/ (pyproject's
# package-dir mapping), which is what this copy lays out.
LINT_SITE := build/lint-site
lint: setup
	$(BIN)/ruff check .
	rm -rf $(LINT_SITE) && mkdir -p $(LINT_SITE)
	cp -r framework $(LINT_SITE)/shardlight && cp -r callbacks launch recipes $(LINT_SITE)/shardlight/
	PYTHONPATH=$(LINT_SITE) $(BIN)/lint-imports

# Every benchmark appends its JSON line to $(BENCH_RESULTS) (benchmarks/_harness.py); the table of them ends
# the run. BENCH="strategy_overhead analyze_vs_hta" runs those. Files starting with _ are the harness and
# the benchmarks' helpers, not benchmarks.
BENCH_RESULTS := build/bench/results.jsonl
BENCH ?= $(basename $(notdir $(wildcard benchmarks/[a-z]*.py)))
bench: setup
	@mkdir -p $(dir $(BENCH_RESULTS)) && rm -f $(BENCH_RESULTS)
	@for b in $(BENCH); do echo "# benchmarks/$$b.py" >&2; \
		SHARDLIGHT_BENCH_RESULTS=$(abspath $(BENCH_RESULTS)) $(BIN)/python benchmarks/$$b.py || exit 1; done
	@$(BIN)/python benchmarks/_harness.py table $(BENCH_RESULTS)
	@echo; echo "# GPU readings: benchmarks/gpu/*.jsonl, from benchmarks/gpu_check.sh on a lent H200 (one run each, no interval; docs/benchmarks.md)"
	@cat benchmarks/gpu/*.jsonl > $(dir $(BENCH_RESULTS))gpu.jsonl && $(BIN)/python benchmarks/_harness.py table $(dir $(BENCH_RESULTS))gpu.jsonl

clean:
	rm -rf $(VENV) runs .pytest_cache build

# Regenerate docs/recipes.md's recipe reference table from the schema.
docs: setup
	$(BIN)/python -m shardlight.recipe.docs --update docs/recipes.md
