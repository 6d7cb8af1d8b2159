# The two commands of the README. Both set up .venv first (idempotent, instant when done).
.PHONY: setup train test gpu-check stress

setup:
	@bash scripts/setup.sh

train: setup
	.venv/bin/exgrpo train $(ARGS)

test: setup
	.venv/bin/python -m pytest tests $(PYTEST_ARGS)

# bench/gpu_bench.py (the learner alone), then bf16 + vLLM on GPU + NCCL weight sync, a short run where vLLM and
# Ray install (skipped, said so, exit 0 otherwise; everything skipped without a GPU)
gpu-check:
	bash scripts/gpu_check.sh $(STEPS)

# The end-to-end files N times (default 3), optionally beside LOAD busy processes: pass counts per test
stress: setup
	bash scripts/stress_suite.sh -n $(or $(N),3) -l $(or $(LOAD),0) $(FILES)
