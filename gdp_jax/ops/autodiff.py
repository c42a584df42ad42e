"""Clear errors for derivatives an implementation does not have (its kernels' custom_vjp gives
reverse mode only; the inference kernels none) (docs/operator.md)."""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.interpreters import ad


def raise_if_differentiated(fn: Callable, message: str) -> Callable:
  """fn unchanged when evaluated; differentiating it (any mode) raises
  NotImplementedError(message), a clear error instead of one deep inside the Pallas lowering."""
  fn = jax.custom_jvp(fn)

  def jvp(primals, tangents):
    raise NotImplementedError(message)

  fn.defjvp(jvp)
  return fn


def in_forward_mode(values) -> bool:
  """Whether `values` (a pytree) are being differentiated in forward mode (jax.jvp, jax.jacfwd).
  Reverse mode (jax.grad, jax.vjp) linearizes instead: False."""
  return any(isinstance(x, ad.JVPTracer) for x in jax.tree.leaves(values))


def raise_if_forward_mode(values, message: str) -> None:
  """NotImplementedError(message) in forward mode (`in_forward_mode`): a custom_vjp under
  jax.jit would otherwise fail only when the program is lowered, with JAX's own TypeError."""
  if in_forward_mode(values):
    raise NotImplementedError(message)


def no_gradients_message(function: str) -> str:
  """The error of differentiating an inference kernel."""
  return (
    f"{function} with implementation='pallas' has no derivatives (an inference kernel); "
    f"use implementation='xla' to differentiate it (JAX differentiates its jnp code)"
  )
