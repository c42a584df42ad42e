"""Kernels lowered once per distinct call: `jitted_kernels(fn, static_argnums)` is `fn` under
`jax.jit`, so that the calls of one program with equal shapes and settings (a model's layers)
share one trace, one lowering and one XLA compilation of each Pallas kernel
(docs/train_lm.md#compile-time)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax

from pallas_kernels.common import backend


def jitted_kernels(fn: Callable, static_argnums: Sequence[int] = ()) -> Callable:
  """`fn` jitted with `static_argnums` static. jax lowers equal jitted calls inside one program
  once (a private function called at each site) and its transposes likewise, where each call of
  a Pallas kernel would otherwise lower its own copy (a Mosaic GPU kernel each with its own hash,
  so XLA compiled each again). Whether the kernels run interpreted (read while tracing) is a key
  of the cache too, so a trace of one mode is never reused in the other."""

  def kernels(*args, interpret_mode, **kwargs):
    del interpret_mode  # only a key of jax's trace cache
    return fn(*args, **kwargs)

  kernels.__name__ = kernels.__qualname__ = getattr(fn, "__name__", "kernels").lstrip("_")
  jitted = jax.jit(kernels, static_argnums=tuple(static_argnums), static_argnames="interpret_mode")

  def call(*args, **kwargs):
    return jitted(*args, interpret_mode=backend.interpret_mode(), **kwargs)

  call.__doc__ = fn.__doc__
  return call
