"""`gated_delta_product`: independent float64 numpy checks of the identities (docs/operator.md),
odd lengths and every mask shape, and the argument checks at the boundary. The forward and
gradients of each implementation against the reference: test_implementations.py."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdp_jax import gated_delta_product
from tests.cases import assert_close, make_inputs, np_gated_delta_rule, present_arrays, tol
from tests.one_program import case_id, one_program


@functools.partial(jax.jit, static_argnames=("implementation", "chunk_size"))
def run(implementation, chunk_size=64, **inputs):
  """The operator with its final state, jitted (one compile per case, not one per operation)."""
  return gated_delta_product(
    **inputs, output_final_state=True, chunk_size=chunk_size, implementation=implementation
  )


# ---- independent checks (numpy recurrences written in the tests) ------------------------------


def _ones_mask_inputs(r):
  inputs = make_inputs(4, T=19, r=r, mask_kind=None)
  inputs["k"] = inputs["k"] / np.sqrt(r)  # one unit-norm key (blocks were normalised)
  inputs["mask"] = jnp.ones((r, r)) if r > 1 else None
  return inputs


def _program(implementation, inputs, chunk_size):
  """(fn, args) of tests/one_program.py: the operator with its final state on `inputs`."""
  names, _ = present_arrays(inputs)
  fn = lambda *a: run(implementation, chunk_size, **dict(inputs, **dict(zip(names, a))))
  return fn, [inputs[n] for n in names]


# The cases of a parametrized test below run as one jitted program (tests/one_program.py).
@pytest.fixture(scope="module")
def ones_mask_cases(request):
  return one_program(
    request,
    "test_all_ones_mask_is_gated_delta_rule",
    lambda implementation, r: _program(implementation, _ones_mask_inputs(r), 16),
  )


@pytest.mark.parametrize("implementation", ["reference", "xla"])
@pytest.mark.parametrize("r", [1, 2, 4])
def test_all_ones_mask_is_gated_delta_rule(ones_mask_cases, request, implementation, r):
  inputs = _ones_mask_inputs(r)
  k = inputs["k"]
  o, f = ones_mask_cases[case_id(request)]
  K = k.shape[-1]
  o_np, f_np = np_gated_delta_rule(
    inputs["q"], k, inputs["v"], inputs["g"], inputs["beta"], K**-0.5, inputs["initial_state"]
  )
  assert_close(o, o_np, tol(jnp.float32), "o")
  assert_close(f, f_np, tol(jnp.float32), "final")


@pytest.mark.parametrize("implementation", ["reference", "xla"])
def test_identity_mask_is_independent_block_rules(implementation):
  r = 2
  inputs = make_inputs(5, T=23, K=32, r=r, mask_kind=None)
  inputs["mask"] = jnp.eye(r)
  o, f = run(implementation, chunk_size=16, **inputs)
  K = inputs["k"].shape[-1]
  dk = K // r
  o_sum = 0.0
  finals = []
  for a in range(r):
    sl = slice(a * dk, (a + 1) * dk)
    o_a, f_a = np_gated_delta_rule(
      inputs["q"][..., sl],
      inputs["k"][..., sl],
      inputs["v"],
      inputs["g"],
      inputs["beta"],
      K**-0.5,
      inputs["initial_state"][:, :, sl],
    )
    o_sum = o_sum + o_a
    finals.append(f_a)
  assert_close(o, o_sum, tol(jnp.float32), "o")
  assert_close(f, np.concatenate(finals, axis=2), tol(jnp.float32), "final")


@pytest.mark.parametrize("implementation", ["reference", "xla"])
def test_no_decay_is_delta_rule(implementation):
  inputs = make_inputs(6, T=30, r=1, mask_kind=None)
  zeros = jnp.zeros_like(inputs["g"])
  o_none, f_none = run(implementation, chunk_size=16, **{**inputs, "g": None})
  o_zero, f_zero = run(implementation, chunk_size=16, **{**inputs, "g": zeros})
  K = inputs["k"].shape[-1]
  o_np, f_np = np_gated_delta_rule(
    inputs["q"], inputs["k"], inputs["v"], zeros, inputs["beta"], K**-0.5, inputs["initial_state"]
  )
  for o, f in ((o_none, f_none), (o_zero, f_zero)):
    assert_close(o, o_np, tol(jnp.float32), "o")
    assert_close(f, f_np, tol(jnp.float32), "final")


def test_default_scale_and_explicit_scale():
  inputs = make_inputs(7, T=9, r=1, mask_kind=None)
  o1, _ = run("xla", **inputs)
  scale = 2.0 * inputs["q"].shape[-1] ** -0.5
  o2 = jax.jit(lambda inputs: gated_delta_product(**inputs, scale=scale)[0])(inputs)
  assert_close(o2, 2.0 * o1, tol(jnp.float32), "scale")


# ---- lengths, mask shapes, transformations ----------------------------------------------------


# Each length once (chunk 32: one token, under one chunk, half a chunk, one chunk and a token,
# exactly two chunks, two and a token), each mask shape twice; the mask shape does not change how
# T is padded and cut (the forward of every implementation and mask shape at other lengths:
# test_implementations.py::test_forward_matches_reference).
def _lengths_inputs(T, mask_kind):
  return make_inputs(9, B=1, T=T, H=2, K=16, V=8, r=2, mask_kind=mask_kind)


@pytest.fixture(scope="module")
def lengths_cases(request):
  """Each case's reference and "xla" results, every case in one jitted program
  (tests/one_program.py)."""

  def case(T, mask_kind):
    inputs = _lengths_inputs(T, mask_kind)
    names, _ = present_arrays(inputs)

    def both(*arrays):
      kw = dict(inputs, **dict(zip(names, arrays)))
      return run("reference", **kw), run("xla", chunk_size=32, **kw)

    return both, [inputs[n] for n in names]

  return one_program(request, "test_lengths_and_mask_shapes", case)


@pytest.mark.parametrize(
  "T,mask_kind",
  [(1, "token"), (5, "shared"), (16, "head"), (33, "token"), (64, "shared"), (65, "head")],
)
def test_lengths_and_mask_shapes(lengths_cases, request, T, mask_kind):
  (o_ref, f_ref), (o, f) = lengths_cases[case_id(request)]
  assert o.shape == (1, T, 2, 8)
  assert_close(o, o_ref, tol(jnp.float32), "o")
  assert_close(f, f_ref, tol(jnp.float32), "final")


def test_final_state_only_when_asked():
  inputs = make_inputs(10, T=8, r=1, mask_kind=None)
  # traced only: what comes back is decided while tracing (run eagerly, each operation compiles)
  o, f = jax.eval_shape(lambda: gated_delta_product(**inputs))
  assert f is None and o.shape == inputs["v"].shape


def test_jit_and_vmap():
  inputs = make_inputs(11, T=20, r=2, mask_kind="head")
  f = jax.jit(
    lambda q, k, v, g, beta, mask, h0: gated_delta_product(
      q, k, v, g, beta, mask, initial_state=h0, output_final_state=True, chunk_size=16
    )
  )
  args = [inputs[n] for n in ("q", "k", "v", "g", "beta", "mask", "initial_state")]
  o, fin = f(*args)
  o_ref, f_ref = run("reference", **inputs)
  assert_close(o, o_ref, tol(jnp.float32), "jit o")
  # vmap over an extra leading axis of two copies
  stacked = [jnp.stack([a, a]) for a in args]
  o2, _ = jax.vmap(f)(*stacked)
  assert_close(o2[1], o_ref, tol(jnp.float32), "vmap o")


# ---- bad input ---------------------------------------------------------------------------------


def _good():
  return make_inputs(12, B=2, T=8, H=3, K=16, V=8, r=2, mask_kind="head")


@pytest.mark.parametrize(
  "change,error,words",
  [
    (dict(q=jnp.zeros((2, 8, 3))), ValueError, "q must be [B, T, H, K]"),
    (dict(k=jnp.zeros((2, 8, 3, 8))), ValueError, "k has shape (2, 8, 3, 8)"),
    (dict(v=jnp.zeros((2, 9, 3, 8))), ValueError, "v has shape (2, 9, 3, 8)"),
    (dict(g=jnp.zeros((2, 8, 4))), ValueError, "g has shape (2, 8, 4)"),
    (dict(beta=jnp.zeros((2, 8))), ValueError, "beta has shape (2, 8)"),
    (dict(beta=None), ValueError, "beta is required"),
    (dict(mask=jnp.zeros((2, 3))), ValueError, "square"),
    (dict(mask=jnp.zeros((4, 2, 2))), ValueError, "[H, r, r] = [3, 2, 2]"),
    (dict(mask=jnp.zeros((2, 8, 3, 2))), ValueError, "mask has shape (2, 8, 3, 2)"),
    (dict(mask=jnp.zeros((1, 8, 3, 2, 2))), ValueError, "[B, T, H, r, r]"),
    (dict(mask=jnp.zeros((3, 3))), ValueError, "divisible by the number of key blocks r = 3"),
    (dict(initial_state=jnp.zeros((2, 3, 16, 4))), ValueError, "initial_state has shape"),
    (dict(q=jnp.zeros((2, 8, 3, 16), jnp.int32)), TypeError, "q must have a floating dtype"),
    (dict(beta=jnp.zeros((2, 8, 3), jnp.int32)), TypeError, "beta must have a floating dtype"),
    (dict(mask=jnp.ones((2, 2), jnp.int32)), TypeError, "mask must have a floating dtype"),
    (dict(v=jnp.zeros((2, 8, 3, 8), jnp.bfloat16)), TypeError, "share one dtype"),
    (
      dict(q=jnp.zeros((2, 8, 3, 0)), k=jnp.zeros((2, 8, 3, 0)), mask=None, initial_state=None),
      ValueError,
      "q has K = 0 features (shape (2, 8, 3, 0)); need K >= 1",
    ),
    (dict(chunk_size=64.0), TypeError, "chunk_size must be an int, one of (16, 32, 64), got 64.0"),
    (dict(chunk_size=True), TypeError, "chunk_size must be an int"),
    (dict(scale="0.5"), TypeError, "scale must be a number or a scalar float array, got '0.5'"),
    (
      dict(scale=jnp.ones(3)),
      ValueError,
      "scale must be a scalar (one output scale for every head), got shape (3,)",
    ),
    (dict(scale=[0.5]), TypeError, "scale must be a number or a scalar float array, got list"),
    (
      dict(output_final_state="no"),
      TypeError,
      "output_final_state must be True or False, got 'no' (str)",
    ),
    (dict(output_final_state=1), TypeError, "output_final_state must be True or False"),
    (
      dict(options={"precision": "ieee"}, implementation="xla"),
      TypeError,
      "options must be None or a pallas_kernels.common.options.KernelOptions",
    ),
    (dict(options="fast", implementation="triton"), TypeError, "got 'fast' (str)"),
  ],
)
def test_bad_inputs_raise(change, error, words):
  inputs = _good()
  inputs.update(change)
  with pytest.raises(error) as info:
    gated_delta_product(**inputs)
  assert words in str(info.value)


@pytest.mark.parametrize("implementation", ["reference", "xla", "pallas"])
def test_an_empty_batch_gives_empty_outputs(implementation):
  """B = 0 (as jnp's functions take it): o [0, T, HV, V] and a final state [0, HV, K, V]."""
  z = jnp.zeros
  args = (z((0, 8, 2, 16)), z((0, 8, 2, 16)), z((0, 8, 4, 8)), z((0, 8, 4)), z((0, 8, 4)))
  o, f = jax.eval_shape(
    lambda: gated_delta_product(*args, output_final_state=True, implementation=implementation)
  )
  assert (o.shape, o.dtype, f.shape) == ((0, 8, 4, 8), jnp.float32, (0, 4, 16, 8))


def test_bad_implementation_and_chunk_size():
  inputs = _good()
  with pytest.raises(ValueError, match="implementation must be one of"):
    gated_delta_product(**inputs, implementation="cuda")
  with pytest.raises(ValueError, match="chunk_size must be one of"):
    gated_delta_product(**inputs, chunk_size=48)


@pytest.mark.parametrize("implementation", ["reference", "xla", "pallas"])
def test_traced_scale(implementation):
  """A scale traced under jit (a learned one) works in every implementation, with its
  gradient; pallas runs its kernels with scale 1 and scales o."""
  inputs = make_inputs(13, B=1, T=16, H=2, K=16, V=8, r=2, mask_kind="shared")
  o_ref, _ = run("reference", **inputs)

  def loss(scale):
    o, _ = gated_delta_product(**inputs, scale=scale, implementation=implementation)
    return jnp.sum(o), o

  (_, o), d_scale = jax.jit(jax.value_and_grad(loss, has_aux=True))(jnp.float32(0.5))
  k_dim = inputs["q"].shape[-1]
  assert_close(o, o_ref * (0.5 / k_dim**-0.5), tol(jnp.float32), "o")
  assert_close(d_scale, jnp.sum(o_ref) / k_dim**-0.5, tol(jnp.float32), "d scale")
