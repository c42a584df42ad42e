# Each target sets up .venv first when needed (scripts/setup_env.sh).
PY := .venv/bin/python

.PHONY: setup demo test gpu-check
setup:
	@./scripts/setup_env.sh

demo: setup
	$(PY) -m gdp_jax demo

test: setup
	$(PY) -m pytest -q -n 2 tests

