"""Benchmarks of gdp-jax, kept outside the package: the operator bench beside its peers
(`benchmarks/bench.py`, `python -m benchmarks.bench`), sweeps and profiles; `results/` keeps the
H200 runs with their commands. The peers (PyTorch, flash-linear-attention, jax-linear-attention)
are imported here only. They need the `bench` extra: `pip install -e ".[bench]"`."""
