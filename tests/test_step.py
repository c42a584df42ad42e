"""`gated_delta_product_step`: token by token it must reproduce `gated_delta_product` on the
whole sequence (final state included), for every mask shape, r in {1, 2}, both implementations;
plus dtypes, defaults, in-place updates inside a jitted loop, and argument checks."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdp_jax import gated_delta_product, gated_delta_product_step
from pallas_kernels.triton.inference import recurrent_step as step_kernel
from tests.cases import assert_close, make_inputs, np_gated_delta_rule, tol
from tests.triton_lowering import lower_for_h200

IMPLS = ["xla", "pallas"]


def step_mask(mask, t):
  """The step's mask for token t of a sequence-level mask ([r, r], [H, r, r], [B, T, H, r, r])."""
  if mask is None or mask.ndim in (2, 3):
    return mask
  return mask[:, t]  # [B, H, r, r]


def run_steps(inputs, implementation, **kw):
  q, k, v, g, beta, mask = (inputs[n] for n in ("q", "k", "v", "g", "beta", "mask"))
  state = inputs["initial_state"]
  step = jax.jit(
    functools.partial(gated_delta_product_step, implementation=implementation, **kw)
  )  # one compilation
  outs = []
  for t in range(q.shape[1]):
    o, state = step(
      q[:, t],
      k[:, t],
      v[:, t],
      None if g is None else g[:, t],
      beta[:, t],
      step_mask(mask, t),
      state,
    )
    outs.append(o)
  return jnp.stack(outs, axis=1), state


@pytest.mark.parametrize("implementation", IMPLS)
@pytest.mark.parametrize(
  "mask_kind,r",
  [(None, 1), ("shared", 1), ("shared", 2), ("head", 1), ("head", 2), ("token", 1), ("token", 2)],
)
def test_steps_match_operator(mask_kind, r, implementation):
  inputs = make_inputs(20 + r, B=2, T=5, H=2, K=16, V=24, r=r, mask_kind=mask_kind)
  o_ref, f_ref = gated_delta_product(**inputs, output_final_state=True, implementation="reference")
  o, f = run_steps(inputs, implementation)
  assert o.dtype == jnp.float32 and f.dtype == jnp.float32
  assert_close(o, o_ref, tol(jnp.float32), "o")
  assert_close(f, f_ref, tol(jnp.float32), "final state")


@pytest.mark.parametrize("implementation", IMPLS)
def test_padded_key_and_value_dims(implementation):
  """K and V not powers of two (the kernel pads and masks), r = 3 key blocks of 8."""
  inputs = make_inputs(30, B=2, T=3, H=2, K=24, V=40, r=3, mask_kind="head")
  o_ref, f_ref = gated_delta_product(**inputs, output_final_state=True, implementation="reference")
  o, f = run_steps(inputs, implementation)
  assert_close(o, o_ref, tol(jnp.float32), "o")
  assert_close(f, f_ref, tol(jnp.float32), "final state")


@pytest.mark.parametrize("implementation", IMPLS)
def test_all_ones_mask_is_gated_delta_rule(implementation):
  """Independent float64 check: with M = ones the step is the gated delta rule."""
  inputs = make_inputs(31, B=2, T=4, H=2, K=16, V=16, r=1, mask_kind=None)
  inputs["mask"] = jnp.ones((2, 2))
  o, f = run_steps(inputs, implementation)
  o_np, f_np = np_gated_delta_rule(
    inputs["q"],
    inputs["k"],
    inputs["v"],
    inputs["g"],
    inputs["beta"],
    16**-0.5,
    inputs["initial_state"],
  )
  assert_close(o, o_np, tol(jnp.float32), "o")
  assert_close(f, f_np, tol(jnp.float32), "final")


@pytest.mark.parametrize("implementation", IMPLS)
def test_defaults_no_decay_no_state(implementation):
  inputs = make_inputs(32, B=2, T=1, H=2, K=16, V=16, r=1, mask_kind=None, with_state=False)
  args = [inputs[n][:, 0] for n in ("q", "k", "v")]
  beta = inputs["beta"][:, 0]
  o1, s1 = gated_delta_product_step(*args, None, beta, None, None, implementation=implementation)
  zeros_g = jnp.zeros_like(beta)
  o2, s2 = gated_delta_product_step(
    *args, zeros_g, beta, jnp.ones((1, 1)), jnp.zeros((2, 2, 16, 16)), implementation=implementation
  )
  np.testing.assert_allclose(np.asarray(o1), np.asarray(o2), rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(np.asarray(s1), np.asarray(s2), rtol=1e-6, atol=1e-7)
  # From a zero state: S = beta k v^T, o = scale (q.k) beta v.
  q, k, v = (np.asarray(a, np.float64) for a in args)
  b = np.asarray(beta, np.float64)
  s_np = b[..., None, None] * k[..., :, None] * v[..., None, :]
  o_np = 16**-0.5 * np.einsum("bhk,bhkv->bhv", q, s_np)
  assert_close(s1, s_np, tol(jnp.float32), "state")
  assert_close(o1, o_np, tol(jnp.float32), "o")


@pytest.mark.parametrize("implementation", IMPLS)
def test_bfloat16_inputs_and_scale(implementation):
  inputs = make_inputs(33, B=2, T=1, H=2, K=16, V=16, r=2, mask_kind="head", dtype=jnp.bfloat16)
  args = [inputs[n][:, 0] for n in ("q", "k", "v", "g", "beta")]
  o, s = gated_delta_product_step(
    *args, inputs["mask"], inputs["initial_state"], scale=0.5, implementation=implementation
  )
  assert o.dtype == jnp.bfloat16 and s.dtype == jnp.float32
  o_ref, s_ref = gated_delta_product_step(
    *[a.astype(jnp.float32) for a in args],
    inputs["mask"],
    inputs["initial_state"],
    scale=0.5,
    implementation="xla",
  )
  assert_close(o, o_ref, tol(jnp.bfloat16), "o")
  assert_close(s, s_ref, tol(jnp.float32), "state")
  traced = jax.jit(
    lambda sc: gated_delta_product_step(
      *args, inputs["mask"], inputs["initial_state"], scale=sc, implementation=implementation
    )
  )
  o2, s2 = traced(jnp.float32(0.5))
  assert o2.dtype == jnp.bfloat16
  assert_close(o2, o_ref, tol(jnp.bfloat16), "o, traced scale")
  assert_close(s2, s_ref, tol(jnp.float32), "state, traced scale")


@pytest.mark.parametrize("in_place", [True, False])
def test_pallas_in_a_jitted_scan(in_place):
  """The decode-loop use: the state carried through lax.scan (aliased in place)."""
  inputs = make_inputs(34, B=2, T=6, H=2, K=16, V=16, r=2, mask_kind="shared")
  o_ref, f_ref = gated_delta_product(**inputs, output_final_state=True, implementation="reference")

  @jax.jit
  def decode(q, k, v, g, beta, mask, state):
    def body(state, xs):
      o, state = gated_delta_product_step(
        *xs, mask, state, implementation="pallas", in_place=in_place
      )
      return state, o

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta))
    final, o = jax.lax.scan(body, state, xs)
    return jnp.moveaxis(o, 0, 1), final

  o, f = decode(*(inputs[n] for n in ("q", "k", "v", "g", "beta", "mask", "initial_state")))
  assert_close(o, o_ref, tol(jnp.float32), "o")
  assert_close(f, f_ref, tol(jnp.float32), "final state")


def test_kernel_block_v():
  inputs = make_inputs(35, B=1, T=1, H=2, K=32, V=64, r=2, mask_kind="head")
  args = [inputs[n][:, 0] for n in ("q", "k", "v", "g", "beta")]
  mask = inputs["mask"][None]
  ref = gated_delta_product_step(
    *args, inputs["mask"], inputs["initial_state"], implementation="xla"
  )
  for block_v in (16, 32, 64):
    o, s = step_kernel.recurrent_step(
      *args, mask, inputs["initial_state"], scale=32**-0.5, block_v=block_v
    )
    assert_close(o, ref[0], tol(jnp.float32), f"o block_v={block_v}")
    assert_close(s, ref[1], tol(jnp.float32), f"state block_v={block_v}")


@pytest.mark.parametrize(
  "B,H,K,V,r,mask_shape,dtype,in_place",
  [
    (64, 16, 128, 128, 1, (1, 1, 1, 1), jnp.bfloat16, True),  # the benchmark shape
    (64, 16, 128, 128, 2, (1, 16, 2, 2), jnp.float32, True),
    (4, 4, 128, 64, 4, (4, 4, 4, 4), jnp.bfloat16, False),
    (2, 2, 24, 40, 3, (1, 2, 3, 3), jnp.float32, True),  # K and V padded and masked
  ],
)
def test_kernel_lowers_to_triton(monkeypatch, B, H, K, V, r, mask_shape, dtype, in_place):
  spec = jax.ShapeDtypeStruct
  modules = lower_for_h200(
    monkeypatch,
    lambda *a: step_kernel.recurrent_step(*a, scale=0.1, in_place=in_place),
    spec((B, H, K), dtype),
    spec((B, H, K), dtype),
    spec((B, H, V), dtype),
    spec((B, H), jnp.float32),
    spec((B, H), jnp.float32),
    spec(mask_shape, jnp.float32),
    spec((B, H, K, V), jnp.float32),
    clear=(step_kernel.recurrent_step,),
  )
  assert "tt.reduce" in modules[0] and "tt.dot" not in modules[0]
  assert "scf.for" not in modules[0]  # one tile per program: no loop


# ---- bad input ---------------------------------------------------------------------------------


def _good():
  inputs = make_inputs(36, B=2, T=1, H=3, K=16, V=8, r=2, mask_kind="head")
  out = {n: inputs[n][:, 0] for n in ("q", "k", "v", "g", "beta")}
  out["mask"] = inputs["mask"]
  out["state"] = inputs["initial_state"]
  return out


@pytest.mark.parametrize(
  "change,error,words",
  [
    (dict(q=jnp.zeros((2, 3, 1, 16))), ValueError, "q must be [B, H, K] (rank 3"),
    (dict(k=jnp.zeros((2, 3, 8))), ValueError, "k has shape (2, 3, 8)"),
    (dict(v=jnp.zeros((2, 4, 8))), ValueError, "v has shape (2, 4, 8), expected [B, H, V]"),
    (dict(g=jnp.zeros((2, 4))), ValueError, "g has shape (2, 4)"),
    (dict(beta=jnp.zeros((2,))), ValueError, "beta has shape (2,)"),
    (dict(beta=None), ValueError, "beta is required"),
    (dict(mask=jnp.zeros((2, 3))), ValueError, "square"),
    (dict(mask=jnp.zeros((4, 2, 2))), ValueError, "[H, r, r] = [3, 2, 2]"),
    (dict(mask=jnp.zeros((3, 3, 2, 2))), ValueError, "[B, H, r, r] = [2, 3, r, r]"),
    (dict(mask=jnp.zeros((2, 1, 3, 2, 2))), ValueError, "expected [r, r], [H, r, r]"),
    (dict(mask=jnp.zeros((3, 3))), ValueError, "divisible by the number of key blocks r = 3"),
    (dict(state=jnp.zeros((2, 3, 16, 4))), ValueError, "state has shape (2, 3, 16, 4)"),
    (dict(q=jnp.zeros((2, 3, 16), jnp.int32)), TypeError, "q must have a floating dtype"),
    (dict(beta=jnp.zeros((2, 3), jnp.int32)), TypeError, "beta must have a floating dtype"),
    (dict(v=jnp.zeros((2, 3, 8), jnp.bfloat16)), TypeError, "share one dtype"),
    (
      dict(state=jnp.zeros((2, 3, 16, 8), jnp.int32)),
      TypeError,
      "state must have a floating dtype",
    ),
    (dict(scale="0.5"), TypeError, "scale must be a number or a scalar float array, got '0.5'"),
    (dict(scale=jnp.ones(2)), ValueError, "scale must be a scalar"),
    (dict(in_place="no"), TypeError, "in_place must be True or False, got 'no'"),
  ],
)
def test_bad_inputs_raise(change, error, words):
  inputs = _good()
  inputs.update(change)
  with pytest.raises(error) as info:
    gated_delta_product_step(**inputs)
  assert words in str(info.value)


def test_bad_implementation():
  with pytest.raises(ValueError, match="implementation must be one of"):
    gated_delta_product_step(**_good(), implementation="reference")


@pytest.mark.parametrize("implementation", IMPLS)
def test_optional_arguments_have_defaults(implementation):
  """g, mask and state may be left out (None: no decay, r = 1, a zero state), as documented; the
  order is the operator's: q, k, v, g, beta, mask, state."""
  inputs = make_inputs(35, B=2, T=1, H=2, K=16, V=8, r=1, mask_kind=None, with_state=False)
  q, k, v = (inputs[n][:, 0] for n in ("q", "k", "v"))
  beta = inputs["beta"][:, 0]
  o1, s1 = gated_delta_product_step(q, k, v, beta=beta, implementation=implementation)
  o2, s2 = gated_delta_product_step(q, k, v, None, beta, None, None, implementation=implementation)
  np.testing.assert_array_equal(np.asarray(o1), np.asarray(o2))
  np.testing.assert_array_equal(np.asarray(s1), np.asarray(s2))
  with pytest.raises(ValueError, match="beta is required"):
    gated_delta_product_step(q, k, v, implementation=implementation)


# ---- large shapes, compiled, on a GPU only ---------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("r,mask_kind", [(1, None), (2, "head"), (4, "token")])
def test_large_on_gpu(r, mask_kind):
  inputs = make_inputs(37, B=4, T=3, H=4, K=128, V=128, r=r, mask_kind=mask_kind)
  o_ref, f_ref = gated_delta_product(**inputs, output_final_state=True, implementation="reference")
  o, f = run_steps(inputs, "pallas")
  assert_close(o, o_ref, tol(jnp.float32), "o")
  assert_close(f, f_ref, tol(jnp.float32), "final state")
