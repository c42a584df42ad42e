"""The persistent compilation cache (gdp_jax/compilation_cache.py, docs/train_lm.md#compile-time):
its folder, off, and a second process that finds every program of the first in it."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import jax

from gdp_jax import compilation_cache

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_the_folder(monkeypatch, tmp_path):
  monkeypatch.delenv(compilation_cache.ENV, raising=False)
  monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
  assert compilation_cache.default_dir() == str(tmp_path / "gdp_jax" / "jax")
  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/elsewhere")
  assert compilation_cache.default_dir() == "/elsewhere"
  monkeypatch.setenv(compilation_cache.ENV, "Off")
  assert compilation_cache.default_dir() is None
  before = jax.config.jax_enable_compilation_cache
  try:
    assert compilation_cache.enable() is None and not jax.config.jax_enable_compilation_cache
  finally:
    jax.config.update("jax_enable_compilation_cache", before)


PROGRAM = """
import json, sys
import jax, jax.numpy as jnp
from gdp_jax import compilation_cache
events = []
jax.monitoring.register_event_listener(lambda name, **_: events.append(name))
compilation_cache.enable(sys.argv[1])
jax.jit(lambda x: jnp.sin(x) @ x.T)(jnp.ones((4, 4))).block_until_ready()
print(json.dumps([e.rsplit("/", 1)[-1] for e in events if "compilation_cache/cache_" in e]))
"""


def test_a_second_run_compiles_nothing(tmp_path):
  env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")

  def run():
    out = subprocess.run(
      [sys.executable, "-c", PROGRAM, str(tmp_path / "cache")],
      env=env,
      capture_output=True,
      text=True,
      check=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])

  first, second = run(), run()
  assert first and set(first) == {"cache_misses"}, first
  assert second == ["cache_hits"] * len(first), second
