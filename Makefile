# The two commands of the README. Both set up .venv first (idempotent, instant when done).
.PHONY: setup train test

setup:
	@bash scripts/setup.sh

train: setup
	.venv/bin/exgrpo train $(ARGS)

test: setup
	.venv/bin/python -m pytest tests $(PYTEST_ARGS)
