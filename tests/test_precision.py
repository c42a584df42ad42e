"""The `precision` argument (docs/precision.md): how it resolves, and that it reaches the kernels.

On a CPU the kernels run in the Pallas interpreter, where float32 products are always full
float32: the numerics of TF32 are checked on a GPU (test_pallas_forward.py, marked `gpu`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from gdp_jax import gated_delta_product
from gdp_jax.ops.gated_delta_product import triton as gdp_triton
from pallas_kernels.common import options
from pallas_kernels.common.backend import resolve_precision
from tests.cases import assert_close, make_inputs, tol


@pytest.mark.parametrize(
  "given,expected",
  [
    (None, "tf32"),
    ("default", "tf32"),
    ("high", "tf32"),
    ("highest", "tf32x3"),
    ("float32", "tf32x3"),
    ("tf32", "tf32"),
    ("tf32x3", "tf32x3"),
    ("ieee", "ieee"),
    (jax.lax.Precision.HIGHEST, "tf32x3"),
    (jax.lax.Precision.DEFAULT, "tf32"),
  ],
)
def test_resolution(given, expected):
  assert resolve_precision(given) == expected


def test_none_follows_jax_default_matmul_precision():
  with jax.default_matmul_precision("float32"):
    assert resolve_precision(None) == "tf32x3"
  with jax.default_matmul_precision("tensorfloat32"):
    assert resolve_precision(None) == "tf32"


def test_bad_precision_is_a_clear_error():
  inputs = make_inputs(0, B=1, T=8, H=1, K=16, V=16, r=1, mask_kind=None)
  with pytest.raises(ValueError, match="precision must be None"):
    gated_delta_product(**inputs, precision="fp8")


def test_precision_reaches_the_kernel_options(monkeypatch):
  seen = []
  core = gdp_triton._gdp_core

  def spy(*args):
    seen.append(args[-1].precision)  # (..., options)
    return core(*args)

  monkeypatch.setattr(gdp_triton, "_gdp_core", spy)
  inputs = make_inputs(1, B=1, T=16, H=1, K=16, V=16, r=1, mask_kind=None)
  o_ref, _ = gated_delta_product(**inputs, implementation="reference")
  for given in (None, "highest", "ieee"):
    o, _ = gated_delta_product(**inputs, implementation="pallas", chunk_size=16, precision=given)
    assert_close(o, o_ref, tol(jnp.float32), f"precision {given}")
  explicit = options.DEFAULT.replace(precision="ieee")
  gated_delta_product(**inputs, implementation="pallas", chunk_size=16, options=explicit)
  assert seen == ["tf32", "tf32x3", "ieee", "ieee"]


def test_step_accepts_and_validates_precision():
  from gdp_jax import gated_delta_product_step

  q = k = jnp.ones((1, 1, 16)) * 0.25
  v = jnp.ones((1, 1, 16))
  beta = jnp.full((1, 1), 0.5)
  o, _ = gated_delta_product_step(q, k, v, None, beta, None, None, precision="highest")
  o_default, _ = gated_delta_product_step(q, k, v, None, beta, None, None)
  assert_close(o, o_default, 0.0, "the step ignores precision")
  with pytest.raises(ValueError, match="precision must be None"):
    gated_delta_product_step(q, k, v, None, beta, None, None, precision="fp8")
