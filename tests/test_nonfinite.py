"""Non-finite values (docs/precision.md#non-finite-inputs): a reset g = -inf gives the
reference's result in every implementation, forward and gradients, and a nan or inf at token t
leaves everything before t unchanged (outputs, and the gradients of a loss on them).

The Pallas kernels are not causal yet: their tests are strict xfails (they must fail today and
pass once the kernels mask with selects; KERNEL_FIX says where).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdp_jax import dispatch, gated_delta_product
from tests.cases import GRAD_TOLERANCE, assert_close, loss_and_grads, make_inputs, tol

IMPLS = dispatch.implementations("gated_delta_product")
KERNEL_FIX = (
  "the Pallas kernels do not clean their loads nor mark their outputs yet: inside a "
  "chunk, products of zero entries with a later token's nan (0 * nan = nan) reach "
  "the earlier tokens, forward and backward (docs/precision.md#non-finite-inputs)"
)
T, CHUNK, BAD_T = 40, 16, 28  # token 28: second chunk, lower half of its chunk matrix
# Exact up to float32 rounding: the bad and the clean runs share every value before BAD_T.
SAME = 1e-6


def run(implementation, **inputs):
  return gated_delta_product(
    **inputs, output_final_state=True, chunk_size=CHUNK, implementation=implementation
  )


# ---- g = -inf: a reset ---------------------------------------------------------------------------


def reset_inputs():
  inputs = make_inputs(40, B=2, T=T, H=2, K=32, V=16, r=2, mask_kind="head")
  g = np.array(inputs["g"])
  g[0, 0, 0] = -np.inf  # the first token
  g[0, 20, 1] = -np.inf  # inside a chunk
  g[1, 31, 0] = -np.inf  # a chunk's last token
  g[1, 34, 1] = g[1, 38, 1] = -np.inf  # two in one chunk
  g[0, 10, 1] = -1e4  # finite, exp(g) = 0 in float32: also a reset
  inputs["g"] = jnp.asarray(g)
  return inputs


@pytest.mark.parametrize("implementation", [n for n in IMPLS if n != "reference"])
def test_reset_matches_reference(implementation):
  inputs = reset_inputs()
  o_ref, f_ref = run("reference", **inputs)
  o, f = run(implementation, **inputs)
  assert_close(o, o_ref, tol(jnp.float32), "o")
  assert_close(f, f_ref, tol(jnp.float32), "final")
  g_ref = loss_and_grads(functools.partial(run, "reference"), inputs)
  got = loss_and_grads(functools.partial(run, implementation), inputs)
  for name in g_ref:
    assert_close(got[name], g_ref[name], GRAD_TOLERANCE[jnp.float32], f"d{name}")
  assert np.all(np.asarray(got["g"])[np.isinf(np.asarray(inputs["g"]))] == 0), "dg at a reset"


@pytest.mark.parametrize("implementation", IMPLS)
def test_reset_is_a_fresh_start(implementation):
  """Independent of the reference: after g_t = -inf the outputs are those of a run that starts
  at t from a zero state."""
  if implementation == "pallas":
    pytest.skip("covered by test_reset_matches_reference (interpreted kernels are slow)")
  inputs = make_inputs(41, B=1, T=T, H=2, K=32, V=16, r=2, mask_kind="token")
  cut = 21
  inputs["g"] = inputs["g"].at[:, cut].set(-jnp.inf)
  o, f = run(implementation, **inputs)
  timed = ("q", "k", "v", "g", "beta", "mask")
  tail = {n: (x[:, cut:] if n in timed else x) for n, x in inputs.items()}
  tail["initial_state"] = None
  o_tail, f_tail = run(implementation, **tail)
  assert_close(o[:, cut:], o_tail, tol(jnp.float32), "o after the reset")
  assert_close(f, f_tail, tol(jnp.float32), "final")


# ---- nan and inf stay causal ---------------------------------------------------------------------

# (input, value): one bad entry at (batch 0, token BAD_T, head 1)
BAD = [
  ("k", np.nan),
  ("v", np.inf),
  ("q", np.nan),
  ("g", np.nan),
  ("g", np.inf),
  ("beta", np.nan),
  ("mask", np.nan),
]
PALLAS_BAD = [("k", np.nan), ("v", np.inf)]  # the interpreted kernels are slow: two cases


def spoil(inputs, name, value):
  x = np.array(inputs[name])
  index = (0, BAD_T, 1) + (0,) * (x.ndim - 3)
  x[index] = value
  return {**inputs, name: jnp.asarray(x)}


def _cases():
  out = []
  for impl in IMPLS:
    for name, value in PALLAS_BAD if impl == "pallas" else BAD:
      marks = [pytest.mark.xfail(strict=True, reason=KERNEL_FIX)] if impl == "pallas" else []
      out.append(pytest.param(impl, name, value, marks=marks, id=f"{impl}-{name}-{value}"))
  return out


def clean_inputs():
  return make_inputs(42, B=2, T=T, H=2, K=32, V=16, r=2, mask_kind="token")


@pytest.mark.parametrize("implementation,name,value", _cases())
def test_nonfinite_forward_is_causal(implementation, name, value):
  inputs = clean_inputs()
  o_clean, f_clean = run(implementation, **inputs)
  o, f = run(implementation, **spoil(inputs, name, value))
  assert_close(o[:, :BAD_T], o_clean[:, :BAD_T], SAME, "o before the bad token")
  # Other batch rows and heads never see it.
  assert_close(o[1], o_clean[1], SAME, "o of batch row 1")
  assert_close(o[:, :, 0], o_clean[:, :, 0], SAME, "o of head 0")
  assert_close(f[1], f_clean[1], SAME, "final state of batch row 1")
  assert not np.all(np.isfinite(np.asarray(o[0, BAD_T, 1]))), "the bad token's output"


@pytest.mark.parametrize("implementation,name,value", _cases())
def test_nonfinite_gradient_is_causal(implementation, name, value):
  """The gradient of a loss on the outputs before the bad token equals the clean one."""
  inputs = clean_inputs()
  do = jax.random.normal(jax.random.key(0), inputs["v"].shape).at[:, BAD_T:].set(0.0)

  def grads(inp):
    names = ("q", "k", "v", "g", "beta", "mask", "initial_state")

    def loss(*arrays):
      o, _ = gated_delta_product(
        *arrays[:6], initial_state=arrays[6], chunk_size=CHUNK, implementation=implementation
      )
      return jnp.sum(o[:, :BAD_T] * do[:, :BAD_T])

    return dict(zip(names, jax.grad(loss, argnums=tuple(range(7)))(*[inp[n] for n in names])))

  clean = grads(inputs)
  got = grads(spoil(inputs, name, value))
  for n in clean:
    assert_close(got[n], clean[n], SAME, f"d{n}")
