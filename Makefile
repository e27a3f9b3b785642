# Two entry points for a fresh machine; each installs what it needs into .venv.
.PHONY: demo test lint typecheck docs bench bench-quick bench-vllm bench-serving stress setup
# The API reference and docs/ pages, nitpicky: a broken reference or link fails the build
# (-E: every page read anew, so a reference broken by a change elsewhere is seen too).
SPHINX = .venv/bin/python -m sphinx -E -W --keep-going -n -q -b html docs build/docs/html
# Lint and format (ruff) over the tree and types (mypy) over shmkv/, as configured in
# pyproject.toml; `make test` runs them before the suite, so that they fail fast.
LINT = .venv/bin/ruff check --quiet
FORMAT = .venv/bin/ruff format --check --quiet
TYPECHECK = .venv/bin/python -m mypy

demo:
	./scripts/setup.sh
	.venv/bin/shmkv demo

test:
	./scripts/setup.sh test
	$(LINT)
	$(FORMAT)
	$(TYPECHECK)
	.venv/bin/python -m pytest -q
	$(SPHINX)

lint:
	./scripts/setup.sh test
	$(LINT)
	$(FORMAT)

typecheck:
	./scripts/setup.sh test
	$(TYPECHECK)

docs:
	./scripts/setup.sh test
	$(SPHINX)
	@echo "docs: build/docs/html/index.html"

bench-quick:
	./scripts/setup.sh plot
	.venv/bin/shmkv bench --quick

bench:
	./scripts/setup.sh plot
	.venv/bin/shmkv bench

# vLLM engines with and without shmkv as their KV connector (about 4 minutes here)
bench-vllm:
	./scripts/setup.sh test
	./scripts/setup.sh plot
	.venv/bin/shmkv bench --only vllm

# vllm serve replicas behind vllm-router, with and without shmkv (about 11 minutes here)
bench-serving:
	./scripts/setup.sh test
	./scripts/setup.sh serving
	.venv/bin/shmkv bench --only serving

stress:
	./scripts/setup.sh
	.venv/bin/shmkv stress
