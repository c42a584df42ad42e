# Each target but gpu-check sets up .venv first when needed (scripts/setup_env.sh).
PY := .venv/bin/python
# gpu-check runs on a machine with an NVIDIA GPU, with the Python that has jax with CUDA
# (pip install -e ".[test]" "jax[cuda12]"); SECTIONS picks sections of scripts/gpu_check.sh
# (tests bench stages memory decode, default all) and OUT where results land.
GPU_PY ?= python3
SECTIONS ?= all

.PHONY: setup setup-jax-newest demo lint test test-fast test-jax-newest gpu-check
setup:
	@./scripts/setup_env.sh

# .venv-jax-newest: the newest jax pyproject.toml takes (.venv has the oldest; the range and the
# names that differ: pallas_kernels/common/compat.py).
setup-jax-newest:
	@./scripts/setup_env.sh --jax-newest

# The main job: the S3 word-problem demo (examples/s3_demo; the `examples` extra, which the
# set-up installs with the test extra).
demo: setup
	$(PY) -m examples.s3_demo

# Lint, format check and types (settings in pyproject.toml); `make test` runs them first.
lint: setup
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	.venv/bin/mypy

# Every test (what CI runs). test-fast leaves out the tier marked slow (subprocess and end-to-end
# checks, heavy interpreted Pallas cases; tests/conftest.py lists them). Two workers take units of
# tests (a file, or one subprocess test) longest first (tests/conftest.py, LONGEST_FIRST).
XDIST := -n 2 --dist loadfile --no-loadscope-reorder
test: lint
	$(PY) -m pytest -q $(XDIST) tests

test-fast: setup
	$(PY) -m pytest -q $(XDIST) -m "not slow" tests

# The other end of the jax range (CI runs both): the Mosaic GPU lowering and interpreter tests and
# the range's own checks, on the newest jax.
NEWEST_TESTS := tests/test_mosaic_gpu.py tests/test_mosaic_gpu_impl.py tests/test_device.py
test-jax-newest: setup-jax-newest
	.venv-jax-newest/bin/python -m pytest -q $(XDIST) $(NEWEST_TESTS)

gpu-check:
	PY="$(GPU_PY)" ./scripts/gpu_check.sh $(SECTIONS)
