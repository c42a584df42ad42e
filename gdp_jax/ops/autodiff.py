"""Clear errors for derivatives an implementation does not have (its kernels' custom_vjp gives
reverse mode only; the inference kernels none)."""

from __future__ import annotations

from collections.abc import Callable

import jax


def raise_if_differentiated(fn: Callable, message: str) -> Callable:
  """fn unchanged when evaluated; differentiating it (any mode) raises
  NotImplementedError(message), a clear error instead of one deep inside the Pallas lowering."""
  fn = jax.custom_jvp(fn)

  def jvp(primals, tangents):
    raise NotImplementedError(message)

  fn.defjvp(jvp)
  return fn


def no_gradients_message(function: str) -> str:
  """The error of differentiating an inference kernel."""
  return (
    f"{function} with implementation='pallas' has no derivatives (an inference kernel); "
    f"use implementation='xla' to differentiate it (JAX differentiates its jnp code)"
  )
