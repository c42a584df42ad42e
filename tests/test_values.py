"""The operator's value contract (docs/operator.md#values): g <= 0, beta in [0, 2] and a finite
scale > 0, checked when concrete, and under `jax.jit` inside `gdp_jax.value_checks()` with
checkify."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import gdp_jax
from gdp_jax import gated_delta_product, gated_delta_product_step, householder_delta_product

B, T, H, K = 1, 8, 2, 16


def _inputs():
  q = k = jnp.ones((B, T, H, K)) / 4.0
  v = jnp.ones((B, T, H, K))
  g = jnp.full((B, T, H), -0.1)
  beta = jnp.full((B, T, H), 0.5)
  return q, k, v, g, beta


@pytest.mark.parametrize(
  "name,index,value,match",
  [
    ("g", (0, 3, 1), 1.0, r"g\[0, 3, 1\] = 1 is outside \[-inf, 0\]"),
    ("beta", (0, 5, 0), 2.5, r"beta\[0, 5, 0\] = 2.5 is outside \[0, 2\]"),
    ("beta", (0, 0, 1), -0.5, r"beta\[0, 0, 1\] = -0.5 is outside \[0, 2\]"),
  ],
)
def test_concrete_values_outside_the_contract_are_errors(name, index, value, match):
  q, k, v, g, beta = _inputs()
  args = dict(g=g, beta=beta)
  args[name] = args[name].at[index].set(value)
  with pytest.raises(ValueError, match=match):
    gated_delta_product(q, k, v, args["g"], args["beta"], implementation="xla")
  with pytest.raises(ValueError, match=match.split(r"\[")[0]):
    gated_delta_product_step(
      q[:, 0], k[:, 0], v[:, 0], args["g"][:, index[1]], args["beta"][:, index[1]]
    )


def test_householder_checks_its_gates():
  q, k, v, g, beta = _inputs()
  kk = jnp.repeat(k, 2, axis=1)
  with pytest.raises(ValueError, match=r"g\[0, 2, 0\] = 0.5"):
    householder_delta_product(
      q, kk, jnp.repeat(v, 2, axis=1), g.at[0, 2, 0].set(0.5), jnp.repeat(beta, 2, axis=1),
      num_householder=2,
    )  # fmt: skip


def test_edges_and_non_finite_values_are_accepted():
  q, k, v, g, beta = _inputs()
  g = g.at[0, 1, 0].set(-jnp.inf).at[0, 2, 0].set(0.0).at[0, 4, 1].set(jnp.nan)
  beta = beta.at[0, 1, 0].set(0.0).at[0, 2, 0].set(2.0).at[0, 6, 1].set(jnp.inf)
  o, _ = gated_delta_product(q, k, v, g, beta, implementation="xla")
  assert np.all(np.isfinite(np.asarray(o[0, :4, 0]))), "a reset and the edges are valid values"


@pytest.mark.parametrize("scale", [float("nan"), -1.0, 0.0, float("inf"), np.float32(-0.5)])
def test_scale_must_be_finite_and_positive(scale):
  """A nan scale would make every output nan, a negative one flip their signs: a ValueError in
  every function that takes a scale (traced only: nothing compiles)."""
  q, k, v, g, beta = _inputs()
  match, array = "scale must be finite and > 0", jnp.asarray(scale)  # a concrete array
  with pytest.raises(ValueError, match=match):
    jax.eval_shape(lambda: gated_delta_product(q, k, v, g, beta, scale=scale))
  with pytest.raises(ValueError, match=match):
    jax.eval_shape(lambda: gated_delta_product(q, k, v, g, beta, scale=array))
  with pytest.raises(ValueError, match=match):
    jax.eval_shape(
      lambda: gated_delta_product_step(q[:, 0], k[:, 0], v[:, 0], None, beta[:, 0], scale=scale)
    )
  with pytest.raises(ValueError, match=match):
    jax.eval_shape(
      lambda: householder_delta_product(
        q, k, v, None, beta, num_householder=1, scale=scale, implementation="reference"
      )
    )
  with pytest.raises(ValueError, match=match):
    jax.eval_shape(lambda: gdp_jax.gqa_decode(q[:, 0], k, v, jnp.full((B,), T), scale=scale))


def test_traced_values_checked_only_inside_value_checks():
  q, k, v, g, beta = _inputs()
  bad_g = g.at[0, 3, 1].set(1.0)

  def f(g, scale):
    return gated_delta_product(q, k, v, g, beta, scale=scale, implementation="xla")[0]

  half, negative = jnp.float32(0.5), jnp.float32(-1.0)
  jax.jit(f)(bad_g, negative)  # traced, unchecked by default: documented
  with gdp_jax.value_checks():
    checked = jax.jit(checkify.checkify(f))
    err, _ = checked(g, half)
    err.throw()  # good values: no error
    err, _ = checked(bad_g, half)
    err_scale, _ = checked(g, negative)
  with pytest.raises(Exception, match=r"g holds finite values outside \[-inf, 0\]"):
    err.throw()
  with pytest.raises(Exception, match="scale must be finite and > 0"):
    err_scale.throw()
