# Two entry points for a fresh machine; each installs what it needs into .venv.
.PHONY: demo test bench bench-quick stress setup

demo:
	./scripts/setup.sh
	.venv/bin/shmkv demo

test:
	./scripts/setup.sh test
	.venv/bin/python -m pytest -q

bench-quick:
	./scripts/setup.sh plot
	.venv/bin/shmkv bench --quick

bench:
	./scripts/setup.sh plot
	.venv/bin/shmkv bench

stress:
	./scripts/setup.sh
	.venv/bin/shmkv stress
