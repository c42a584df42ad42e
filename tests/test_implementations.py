"""The test base every chunked implementation of `gated_delta_product` runs (the "xla" jnp form
and the "triton" kernels, interpreted on CPU): the forward and the gradient of every input against
the recurrent reference, half precision, state threading and JAX transformations.

One test class per implementation of the operator's registry (its api.py) on a shared
base (`ChunkedImplementationTests`); a new implementation gets its class here (a test checks).
Stage-by-stage tests of the kernels live in test_pallas_forward.py and test_pallas_backward.py;
the independent float64 checks and the argument checks in test_operator.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

from gdp_jax import gated_delta_product
from tests.cases import (
  GRAD_TOLERANCE,
  assert_close,
  general_backends,
  grads_program,
  loss_and_grads,
  make_inputs,
  present_arrays,
  tol,
)
from tests.one_program import case_id, one_program

CHUNKED = [n for n in general_backends("gated_delta_product") if n != "reference"]

# (r, mask kind, T, chunk): every mask shape, T on and off the chunk grid, each chunk size.
FORWARD_CASES = [
  (1, None, 45, 64),
  (2, "shared", 37, 16),
  (2, "head", 64, 32),
  (4, "token", 50, 16),
  (4, "head", 9, 64),
]
# (r, mask kind, T, with an initial state)
# Gradients run at chunk 16: T from 2 to 3 chunks, off the grid (kept short for CI): r = 1 without
# a mask, a shared mask without a state, a per-head mask at r = 4. The per-token mask's float32
# gradients: test_transformations_compose (both implementations, r = 2, with a state) and
# test_fused_forward.py::test_operator_forward_and_gradients (pallas); the per-head mask at r = 2:
# test_gradients_half_precision; stage by stage: test_xla_backward.py, test_pallas_backward.py.
GRADIENT_CASES = [
  (1, None, 21, True),
  (2, "shared", 33, False),
  (4, "head", 24, True),
]


@functools.partial(jax.jit, static_argnames=("implementation", "chunk_size"))
def run(implementation, chunk_size=64, **inputs):
  """The operator with its final state, jitted: one compile per case instead of one per op."""
  return gated_delta_product(
    **inputs, output_final_state=True, chunk_size=chunk_size, implementation=implementation
  )


@pytest.fixture(scope="module")
def reference():
  """The reference's results, computed once per case for every implementation class:
  `reference(key, compute)` returns compute()'s value, computing it on the key's first use."""
  found = {}

  def get(key, compute):
    if key not in found:
      found[key] = compute()
    return found[key]

  return get


def forward_inputs(r, mask_kind, T):
  return make_inputs(3, B=2, T=T, H=2, K=32, V=16, r=r, mask_kind=mask_kind)


def half_inputs(dtype):
  return make_inputs(4, B=1, T=40, H=2, K=32, V=32, r=2, mask_kind="head", dtype=dtype)


def gradient_inputs(r, mask_kind, T, with_state):
  return make_inputs(11, B=2, T=T, H=2, K=32, V=16, r=r, mask_kind=mask_kind, with_state=with_state)


def half_gradient_inputs(dtype):
  return make_inputs(12, B=1, T=40, H=2, K=32, V=32, r=2, mask_kind="head", dtype=dtype)


def forward_program(implementation, chunk, inputs):
  """(fn, args) of tests/one_program.py: the operator with its final state on `inputs`."""
  names, _ = present_arrays(inputs)
  fn = lambda *a: run(implementation, chunk, **dict(inputs, **dict(zip(names, a))))
  return fn, [inputs[n] for n in names]


def check_two_halves_thread_the_state(implementation):
  # Two halves of 20 tokens (the cut inside a chunk): one compile serves both.
  inputs = make_inputs(8, T=40, r=2, mask_kind="token")
  o_full, f_full = run(implementation, chunk_size=16, **inputs)
  cut = 20
  timed = ("q", "k", "v", "g", "beta", "mask")
  first = {n: (x[:, :cut] if n in timed else x) for n, x in inputs.items()}
  second = {n: (x[:, cut:] if n in timed else x) for n, x in inputs.items()}
  o1, f1 = run(implementation, chunk_size=16, **first)
  second["initial_state"] = f1
  o2, f2 = run(implementation, chunk_size=16, **second)
  assert_close(jnp.concatenate([o1, o2], axis=1), o_full, tol(jnp.float32), "o")
  assert_close(f2, f_full, tol(jnp.float32), "final")


class ChunkedImplementationTests:
  """The tests every chunked implementation passes; a subclass per implementation sets
  `implementation` (tokamax's test-base pattern)."""

  implementation: str

  # Each parametrized test's cases of a class are computed by one jitted program
  # (tests/one_program.py): one compile instead of one per case.
  @pytest.fixture(scope="class")
  @classmethod
  def forwards(cls, request):
    return one_program(
      request,
      "test_forward_matches_reference",
      lambda r, mask_kind, T, chunk: forward_program(
        cls.implementation, chunk, forward_inputs(r, mask_kind, T)
      ),
    )

  @pytest.fixture(scope="class")
  @classmethod
  def half_forwards(cls, request):
    return one_program(
      request,
      "test_forward_half_precision",
      lambda dtype: forward_program(cls.implementation, 32, half_inputs(dtype)),
    )

  @pytest.fixture(scope="class")
  @classmethod
  def gradients(cls, request):
    run_16 = functools.partial(run, cls.implementation, 16)
    return one_program(
      request,
      "test_gradients_match_reference",
      lambda r, mask_kind, T, with_state: grads_program(
        run_16, gradient_inputs(r, mask_kind, T, with_state)
      ),
    )

  @pytest.fixture(scope="class")
  @classmethod
  def half_gradients(cls, request):
    run_16 = functools.partial(run, cls.implementation, 16)
    return one_program(
      request,
      "test_gradients_half_precision",
      lambda dtype: grads_program(run_16, half_gradient_inputs(dtype)),
    )

  def test_two_halves_thread_the_state(self):
    check_two_halves_thread_the_state(self.implementation)

  @pytest.mark.parametrize("r,mask_kind,T,chunk", FORWARD_CASES)
  def test_forward_matches_reference(self, reference, forwards, request, r, mask_kind, T, chunk):
    inputs = forward_inputs(r, mask_kind, T)
    o_ref, f_ref = reference(("forward", r, mask_kind, T), lambda: run("reference", **inputs))
    o, f = forwards[case_id(request)]
    assert o.dtype == jnp.float32 and f.dtype == jnp.float32
    assert o.shape == o_ref.shape and f.shape == f_ref.shape
    assert_close(o, o_ref, tol(jnp.float32), "o")
    assert_close(f, f_ref, tol(jnp.float32), "final state")

  @pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
  def test_forward_half_precision(self, reference, half_forwards, request, dtype):
    inputs = half_inputs(dtype)
    o_ref, f_ref = reference(("half", dtype), lambda: run("reference", **inputs))
    o, f = half_forwards[case_id(request)]
    assert o.dtype == dtype and f.dtype == jnp.float32
    assert_close(o, o_ref, tol(dtype), "o")
    assert_close(f, f_ref, tol(dtype), "final state")
    # and against the float32 computation on the same (rounded) inputs
    o32, _ = reference(
      ("half in float32", dtype),
      lambda: run(
        "reference",
        **{n: (x.astype(jnp.float32) if x is not None else None) for n, x in inputs.items()},
      ),
    )
    assert_close(o, o32, tol(dtype), "o vs float32")

  @pytest.mark.parametrize("r,mask_kind,T,with_state", GRADIENT_CASES)
  def test_gradients_match_reference(
    self, reference, gradients, request, r, mask_kind, T, with_state
  ):
    inputs = gradient_inputs(r, mask_kind, T, with_state)
    g_ref = reference(
      ("gradients", r, mask_kind, T, with_state),
      lambda: loss_and_grads(functools.partial(run, "reference"), inputs),
    )
    g_got = gradients[case_id(request)]
    assert set(g_got) == set(g_ref)
    for name in g_ref:
      assert g_got[name].shape == inputs[name].shape, name
      assert g_got[name].dtype == inputs[name].dtype, name
      assert_close(g_got[name], g_ref[name], GRAD_TOLERANCE[jnp.float32], f"d{name}")

  @pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
  def test_gradients_half_precision(self, reference, half_gradients, request, dtype):
    inputs = half_gradient_inputs(dtype)
    g_ref = reference(
      ("half gradients", dtype), lambda: loss_and_grads(functools.partial(run, "reference"), inputs)
    )
    g_got = half_gradients[case_id(request)]
    for name in g_ref:
      assert g_got[name].dtype == inputs[name].dtype, name
      assert_close(g_got[name], g_ref[name], GRAD_TOLERANCE[dtype], f"d{name}")

  def test_transformations_compose(self, reference):
    """value_and_grad under jit and checkpoint, and vmap over an extra leading axis."""
    implementation = self.implementation
    inputs = make_inputs(13, B=1, T=24, H=2, K=32, V=16, r=2, mask_kind="token")
    names = ("q", "k", "v", "g", "beta", "mask", "initial_state")
    args = [inputs[n] for n in names]

    def loss(impl, *a):
      o, f = gated_delta_product(
        *a[:6], initial_state=a[6], output_final_state=True, chunk_size=16, implementation=impl
      )
      return jnp.sum(o * o) + jnp.sum(jnp.sin(f))

    argnums = tuple(range(1, 8))
    ref_val, ref_grads = reference(
      "transformations",
      lambda: jax.jit(jax.value_and_grad(loss, argnums=argnums), static_argnums=0)(
        "reference", *args
      ),
    )
    val, grads = jax.jit(
      jax.value_and_grad(jax.checkpoint(loss, static_argnums=0), argnums=argnums), static_argnums=0
    )(implementation, *args)
    assert_close(val, ref_val, tol(jnp.float32), "loss")
    for gr, ref, name in zip(grads, ref_grads, names):
      assert_close(gr, ref, GRAD_TOLERANCE[jnp.float32], f"d{name}")
    stacked = [jnp.stack([a, 0.5 * a]) for a in args]
    vgrad = jax.vmap(jax.grad(functools.partial(loss, implementation), argnums=(0, 2)))
    vgrads = jax.jit(vgrad)(*stacked)
    assert_close(vgrads[0][0], ref_grads[0], GRAD_TOLERANCE[jnp.float32], "vmap dq")
    assert_close(vgrads[1][0], ref_grads[2], GRAD_TOLERANCE[jnp.float32], "vmap dv")


class TestXla(ChunkedImplementationTests):
  implementation = "xla"

  # The jnp form's gradients in half precision: bfloat16 only (float16 takes the same jnp path
  # with another dtype; its forward runs in float16 in test_forward_half_precision).
  @pytest.mark.parametrize("dtype", [jnp.bfloat16])
  def test_gradients_half_precision(self, reference, half_gradients, request, dtype):
    super().test_gradients_half_precision(reference, half_gradients, request, dtype)


class TestTriton(ChunkedImplementationTests):
  implementation = "triton"


def test_reference_threads_the_state():
  check_two_halves_thread_the_state("reference")


def test_every_chunked_implementation_has_a_test_class():
  # a new implementation in the registry needs its class here
  classes = {c.implementation for c in ChunkedImplementationTests.__subclasses__()}
  assert classes == set(CHUNKED), (classes, CHUNKED)
