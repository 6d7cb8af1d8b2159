# The two commands of the README. Both set up .venv first (idempotent, instant when done).
.PHONY: setup train test gpu-check gpu-wheels device-carry stress

setup:
	@bash scripts/setup.sh

train: setup
	.venv/bin/exgrpo train $(ARGS)

# two pytest workers, each taking whole files (module- and session-scoped clusters stay with their tests): a run
# waits on Ray, its actors and its subprocesses ~40% of the time, which the other worker fills (TEST_WORKERS=0: one)
TEST_WORKERS ?= 2
test: setup
	.venv/bin/python -m pytest tests $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder) $(PYTEST_ARGS)

# bench/gpu_bench.py (the learner alone), then bf16 + vLLM on GPU + NCCL weight sync, a short run where vLLM and
# Ray install (skipped, said so, exit 0 otherwise; everything skipped without a GPU)
gpu-check:
	bash scripts/gpu_check.sh $(STEPS)

# pydantic's wheels for a bare GPU machine (bench/gpu_bench.py, scripts/device_bench.sh), at this .venv's versions,
# for GPU_PYTHON (default 3.12, the lent GPU machines' python3) on x86-64 Linux, into wheels/ (git-ignored: carry it)
GPU_PYTHON ?= 3.12
gpu-wheels: setup
	.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version $(GPU_PYTHON) \
	    --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d wheels \
	    $$(.venv/bin/python -c "from importlib.metadata import version as v; print(' '.join(f'{p}=={v(p)}' for p in \
	    ('pydantic', 'pydantic-core', 'annotated-types', 'typing-extensions', 'typing-inspection')))")
	@ls wheels

# What the lent GPU machines' image lacks for a run (ray without its Java/dashboard/libraries, pydantic, jsonschema,
# math-verify, the project's wheel), for CPython PY (default 3.12: the device; 3.11: this machine, for the suite's
# check of the carry), into device-carry/ (PY=3.12) or device-carry-pyPY/ (git-ignored; at most 60 MB: carry it with
# scripts/device_e2e.sh). scripts/device_carry.py says what is in it and why.
PY ?= 3.12
device-carry: setup
	.venv/bin/python scripts/device_carry.py --python $(PY)

# The end-to-end files N times (default 3), optionally beside LOAD busy processes: pass counts per test
stress: setup
	bash scripts/stress_suite.sh -n $(or $(N),3) -l $(or $(LOAD),0) $(FILES)
