"""jax's persistent compilation cache, turned on by the language-model example and the
benchmarks (docs/train_lm.md#compile-time): a second run of the same command loads its compiled
programs from disk instead of compiling them with XLA.

The folder: `enable(path)`, else $GDP_JAX_COMPILATION_CACHE, else jax's own
$JAX_COMPILATION_CACHE_DIR, else ~/.cache/gdp_jax/jax (under $XDG_CACHE_HOME when set); "off"
turns it off. Tracing and lowering still run on a cache hit (the key is the lowered program).
"""

from __future__ import annotations

import os

ENV = "GDP_JAX_COMPILATION_CACHE"
OFF = ("", "0", "off", "none", "false")


def default_dir() -> str | None:
  """The folder `enable()` uses when given none (None: the cache is off)."""
  for name in (ENV, "JAX_COMPILATION_CACHE_DIR"):
    value = os.environ.get(name)
    if value is not None:
      return None if value.strip().lower() in OFF else value
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "gdp_jax", "jax")


def enable(path: str | None = None) -> str | None:
  """Turn the persistent cache on in `path` (default `default_dir()`; "off": off), every
  program cached whatever its compile time or size. Call it before the first compilation (jax
  reads the setting once). Returns the folder, or None when off."""
  import jax

  if path is None:
    path = default_dir()
  if path is None or path.strip().lower() in OFF:
    disable()
    return None
  path = os.path.abspath(os.path.expanduser(path))
  os.makedirs(path, exist_ok=True)
  jax.config.update("jax_enable_compilation_cache", True)
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  return path


def disable() -> None:
  """The persistent cache off (every program compiled: compile-time measurements)."""
  import jax

  jax.config.update("jax_enable_compilation_cache", False)
