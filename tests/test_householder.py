"""The Householder form (DeltaProduct): `householder_delta_product` and its one-token step.

The reference against an independent float64 numpy recurrence (n_h sequential rank-1 updates, one
decay per token); "xla" and "pallas" (the r = 1 operator over T*n_h sub-steps) against the
reference, forward and every gradient; n_h = 1 against `gated_delta_product`; the step against the
whole sequence; packed sequences (`cu_seqlens`: packed equals separate calls, outputs, final states
and every gradient, against the float64 recurrence per sequence, one compilation for new
boundaries, the default implementation, the errors); argument checks; the layer
`HouseholderDeltaProduct` (whole sequence against decode steps) and a hybrid model with a
DeltaProduct layer training a step.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from gdp_jax import gated_delta_product, householder_delta_product, householder_delta_product_step
from gdp_jax.layers import GroupedQueryAttention, HouseholderDeltaProduct
from gdp_jax.models import HybridConfig, HybridLM
from pallas_kernels.common import compat
from tests.cases import GRAD_TOLERANCE, assert_close, loss_and_grads, outputs_and_grads, tol

F32, GRAD_F32 = tol(jnp.float32), GRAD_TOLERANCE[jnp.float32]


def hh_inputs(seed, n_h, B=2, T=7, H=2, K=16, V=8, with_state=True, with_g=True, dtype=jnp.float32):
  """Random inputs in the layer's regime: unit keys, beta in (0, 2) (negative eigenvalues)."""
  rng = np.random.default_rng(seed)
  normal = lambda *s: rng.standard_normal(s).astype(np.float32)
  k = normal(B, T * n_h, H, K)
  k = k / np.linalg.norm(k, axis=-1, keepdims=True)
  q = normal(B, T, H, K)
  q = q / np.linalg.norm(q, axis=-1, keepdims=True)
  cast = lambda x: jnp.asarray(x, dtype)
  return dict(
    q=cast(q),
    k=cast(k),
    v=cast(normal(B, T * n_h, H, V)),
    g=jnp.asarray(-np.abs(normal(B, T, H)) * 0.2 - 0.01) if with_g else None,
    beta=jnp.asarray(2.0 / (1.0 + np.exp(-normal(B, T * n_h, H)))),
    initial_state=jnp.asarray(normal(B, H, K, V) * 0.5) if with_state else None,
  )


@functools.partial(jax.jit, static_argnames=("implementation", "n_h", "chunk_size"))
def run(implementation, n_h, chunk_size=16, **inputs):
  """The operator with its final state, jitted (one compile per case, not one per operation)."""
  return householder_delta_product(
    **inputs,
    num_householder=n_h,
    output_final_state=True,
    implementation=implementation,
    chunk_size=chunk_size,
  )


def np_householder(q, k, v, g, beta, n_h, scale, h0=None):
  """Independent float64 recurrence: per token decay once, then n_h rank-1 delta updates."""
  f64 = lambda x: np.asarray(jnp.asarray(x, jnp.float32), np.float64)
  q, k, v, beta = f64(q), f64(k), f64(v), f64(beta)
  B, T, H, K = q.shape
  S = np.zeros((B, H, K, v.shape[-1])) if h0 is None else f64(h0).copy()
  o = np.zeros((B, T, H, v.shape[-1]))
  for t in range(T):
    if g is not None:
      S = S * np.exp(f64(g)[:, t])[..., None, None]
    for j in range(n_h):
      i = t * n_h + j
      err = v[:, i] - np.einsum("bhk,bhkv->bhv", k[:, i], S)
      S = S + beta[:, i][..., None, None] * k[:, i][..., :, None] * err[..., None, :]
    o[:, t] = scale * np.einsum("bhk,bhkv->bhv", q[:, t], S)
  return o, S


# ---- the reference against numpy --------------------------------------------------------------


@pytest.mark.parametrize(
  "n_h,with_state,with_g", [(1, True, True), (2, False, True), (3, True, False), (4, True, True)]
)
def test_reference_matches_numpy(n_h, with_state, with_g):
  inputs = hh_inputs(n_h, n_h, T=6, with_state=with_state, with_g=with_g)
  o, f = run("reference", n_h, **inputs)
  o_np, f_np = np_householder(
    inputs["q"],
    inputs["k"],
    inputs["v"],
    inputs["g"],
    inputs["beta"],
    n_h,
    16**-0.5,
    inputs["initial_state"],
  )
  assert o.dtype == jnp.float32 and f.dtype == jnp.float32
  assert_close(o, o_np, F32, "o")
  assert_close(f, f_np, F32, "final state")


# ---- the chunked implementations against the reference: forward and every gradient -------------


def check_against_reference(implementation, n_h, inputs, chunk_size=16):
  """Outputs, final state and every gradient against the reference. The reference and "xla" (JAX
  differentiates both) give outputs and gradients from one program; "pallas" (a custom_vjp) runs
  its plain forward as a call of its own."""
  (o_ref, f_ref), g_ref = outputs_and_grads(functools.partial(run, "reference", n_h), inputs)
  fn = functools.partial(run, implementation, n_h, chunk_size)
  if implementation == "pallas":
    o, f = fn(**inputs)
    g_got = loss_and_grads(fn, inputs)
  else:
    (o, f), g_got = outputs_and_grads(fn, inputs)
  assert o.shape == o_ref.shape and o.dtype == inputs["q"].dtype
  assert_close(o, o_ref, F32, f"{implementation} o")
  assert_close(f, f_ref, F32, f"{implementation} final state")
  assert set(g_got) == set(g_ref) == {n for n, x in inputs.items() if x is not None}
  for name in g_ref:
    assert g_got[name].shape == inputs[name].shape, name
    assert_close(g_got[name], g_ref[name], GRAD_F32, f"{implementation} d{name}")


# T * n_h = 14 and 21 sub-steps: never a multiple of the chunk (16); the gate without a state and
# a state without the gate. (n_h = 1, the gated delta rule: test_one_step_is_the_gated_delta_rule
# and test_implementations.py; no code path depends on n_h beyond the sub-step count.)
@pytest.mark.parametrize("n_h,with_state,with_g", [(2, False, True), (3, True, False)])
def test_xla_matches_reference(n_h, with_state, with_g):
  check_against_reference(
    "xla", n_h, hh_inputs(10 + n_h, n_h, T=7, with_state=with_state, with_g=with_g)
  )


# Interpret-mode Pallas is slow: few, tiny cases (T * n_h = 10 and 27 sub-steps).
@pytest.mark.parametrize("n_h,T,with_state", [(2, 5, True), (3, 9, False)])
def test_pallas_matches_reference(n_h, T, with_state):
  check_against_reference("pallas", n_h, hh_inputs(20 + n_h, n_h, T=T, H=1, with_state=with_state))


def _jaxpr_parts(fn, *args):
  """(kernels, others) of fn's jaxpr, traced only (no kernel runs): kernels lists every
  pallas_call as (name, operand avals, kernel jaxpr text, grid mapping text); others the output
  avals of every other equation, nested jaxprs included."""
  kernels, others = [], []

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "pallas_call":
        name = compat.pallas_call_name(eqn)
        operands = tuple(v.aval for v in eqn.invars)
        grid = str(eqn.params["grid_mapping"])
        kernels.append((name, operands, str(eqn.params["jaxpr"]), grid))
        continue
      others.extend(v.aval for v in eqn.outvars)
      for value in eqn.params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
          if isinstance(item, jax.extend.core.ClosedJaxpr):
            walk(item.jaxpr)
          elif isinstance(item, jax.extend.core.Jaxpr):
            walk(item)

  walk(jax.make_jaxpr(fn)(*args).jaxpr)
  return kernels, others


@pytest.mark.parametrize("mode", ["fwd", "fwdbwd"])
def test_pallas_runs_the_operator_kernels_in_bfloat16(mode):
  """The Pallas path is the r = 1 operator's own call at T*n_h sub-steps: the same kernels, the
  same launches and chunk, the same operands (bf16 q, k, v: no float32 copy of an input), and
  around them no float32 array of activation size in the forward (the bench's bf16 beta
  included)."""
  from gdp_jax.ops.householder.api import to_substeps

  n_h = 2
  inputs = hh_inputs(40, n_h, B=1, T=32, H=2, K=16, V=16, with_state=False, dtype=jnp.bfloat16)
  q, k, v, g, beta = (inputs[n] for n in ("q", "k", "v", "g", "beta"))
  beta = beta.astype(jnp.bfloat16)

  def ours(q, k, v, g, beta):
    return householder_delta_product(
      q, k, v, g, beta, num_householder=n_h, implementation="pallas"
    )[0]

  def r1(q, k, v, g, beta):
    return gated_delta_product(q, k, v, g, beta, implementation="pallas")[0]

  if mode == "fwdbwd":
    grad = lambda f: jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32)), argnums=range(5))
    ours, r1 = grad(ours), grad(r1)
  kernels, others = _jaxpr_parts(ours, q, k, v, g, beta)
  q_sub, g_sub = to_substeps(q, g, n_h)
  expected, _ = _jaxpr_parts(r1, q_sub, k, v, g_sub, beta)
  assert [c[0] for c in kernels] == [c[0] for c in expected]
  for (name, operands, body, grid), (_, want, want_body, want_grid) in zip(kernels, expected):
    assert operands == want, f"{name}: operands {operands}, the operator's call has {want}"
    assert body == want_body and grid == want_grid, f"{name}: another kernel or launch"
    for i, aval in enumerate(operands):  # the inputs' layout [B, T*n_h, H, K or V] only in bf16
      if name == "gdp_bwd_wy" and i == len(operands) - 1:
        continue  # bwd_dqkwg's float32 part of dk (a gradient, not a copy of an input)
      assert aval.shape not in (q_sub.shape, v.shape) or aval.dtype == jnp.bfloat16, (name, aval)
  if mode == "fwd":
    big_f32 = [a for a in others if a.dtype == jnp.float32 and a.size >= q.size]
    assert not big_f32, f"float32 activation-sized arrays around the kernels: {big_f32}"


@pytest.mark.parametrize("n_h,native", [(2, True), (4, True), (3, False)])
def test_mosaic_gpu_takes_the_sub_steps_as_rows_of_a_token(n_h, native):
  """implementation="mosaic_gpu": the forward's kernels take each token's n_h sub-steps as the
  rows of its chunk (the r = n_h walk, no sub-step layout); differentiated, the r = 1 operator
  over the sub-steps runs (its backward kernels). n_h = 3 is no divisor of the kernels' 64-row
  chunk: the sub-step path both ways. Traced only (the kernels' values: test_mosaic_gpu.py)."""
  inputs = hh_inputs(95, n_h, B=1, T=40, K=64, V=64, dtype=jnp.bfloat16)
  call = functools.partial(
    householder_delta_product, num_householder=n_h, implementation="mosaic_gpu", chunk_size=64
  )
  forward = str(jax.make_jaxpr(lambda kw: call(**kw)[0])(inputs))
  loss = lambda kw: jnp.sum(call(**kw)[0].astype(jnp.float32))
  backward = str(jax.make_jaxpr(jax.grad(loss))(inputs))
  # the sub-step path's forward without gradient: the r = 1 operator's walk
  walk = f"gdp_state_walk_ws_r{n_h}" if native else "gdp_state_walk_ws_r1"
  assert walk in forward and "gdp_fused_forward" not in forward
  assert "gdp_state_grad_walk_r1" in backward and f"gdp_state_walk_ws_r{n_h}" not in backward


def test_one_step_is_the_gated_delta_rule():
  """n_h = 1 is the r = 1 operator (mask None) itself, for every implementation."""
  inputs = hh_inputs(30, 1, T=9)
  o_ref, f_ref = jax.jit(  # one compile instead of one per operation
    lambda kw: gated_delta_product(**kw, output_final_state=True, implementation="reference")
  )(inputs)
  for implementation in ("reference", "xla"):
    o, f = run(implementation, 1, **inputs)
    assert_close(o, o_ref, F32, f"{implementation} o")
    assert_close(f, f_ref, F32, f"{implementation} final state")


def test_bfloat16_scale_and_jit():
  inputs = hh_inputs(31, 2, T=6, dtype=jnp.bfloat16)
  fn = jax.jit(
    lambda **kw: householder_delta_product(
      **kw, num_householder=2, scale=0.3, output_final_state=True, implementation="xla"
    )
  )
  o, f = fn(**inputs)
  assert o.dtype == jnp.bfloat16 and f.dtype == jnp.float32
  o_ref, f_ref = jax.jit(
    lambda **kw: householder_delta_product(
      **kw, num_householder=2, scale=0.3, output_final_state=True, implementation="reference"
    )
  )(**inputs)
  assert_close(o, o_ref, tol(jnp.bfloat16), "o")
  assert_close(f, f_ref, tol(jnp.bfloat16), "final state")
  o2, none = jax.jit(
    lambda **kw: householder_delta_product(**kw, num_householder=2, implementation="xla")
  )(**inputs)
  assert none is None and o2.shape == o.shape


# ---- the one-token step -------------------------------------------------------------------------


@pytest.mark.parametrize(
  "implementation,n_h,with_g", [("xla", 1, True), ("xla", 3, False), ("pallas", 2, True)]
)
def test_step_matches_sequence(implementation, n_h, with_g):
  inputs = hh_inputs(40 + n_h, n_h, T=4, with_g=with_g)
  o_ref, f_ref = run("reference", n_h, **inputs)
  step = jax.jit(
    functools.partial(
      householder_delta_product_step, num_householder=n_h, implementation=implementation
    )
  )
  q, k, v, g, beta = (inputs[n] for n in ("q", "k", "v", "g", "beta"))
  state, outs = inputs["initial_state"], []
  for t in range(q.shape[1]):
    sub = slice(t * n_h, (t + 1) * n_h)
    o, state = step(
      q[:, t], k[:, sub], v[:, sub], None if g is None else g[:, t], beta[:, sub], state
    )
    outs.append(o)
  assert state.dtype == jnp.float32
  assert_close(jnp.stack(outs, axis=1), o_ref, F32, "o")
  assert_close(state, f_ref, F32, "final state")


def test_step_from_no_state():
  inputs = hh_inputs(45, 2, T=1, with_state=False)
  args = (inputs["q"][:, 0], inputs["k"], inputs["v"], inputs["g"][:, 0], inputs["beta"])
  o, s = jax.jit(  # one compile instead of one per operation
    lambda *a: householder_delta_product_step(*a, None, num_householder=2, implementation="xla")
  )(*args)
  o_ref, s_ref = run("reference", 2, **inputs)
  assert_close(o, o_ref[:, 0], F32, "o")
  assert_close(s, s_ref, F32, "state")


# ---- packed sequences (cu_seqlens) -------------------------------------------------------------

# Token lengths with one of 1 and an empty one; with n_h = 2 or 3 and chunks of 16 sub-steps the
# sequences hold 10/15, 2/3, 0 and 18/27 sub-steps: none a multiple of the chunk, one over two.
PACKED = (5, 1, 0, 9)
HH_ARRAYS = ("q", "k", "v", "g", "beta", "initial_state")


def cu_of(lengths):
  return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def packed_hh_inputs(seed, n_h, lengths=PACKED, with_g=True, with_state=True):
  """Inputs [1, T(*n_h), ...] for the packed sequences, one initial state per sequence."""
  inputs = hh_inputs(seed, n_h, B=1, T=sum(lengths), with_g=with_g, with_state=False)
  if with_state:
    rng = np.random.default_rng(seed + 7)
    inputs["initial_state"] = jnp.asarray(0.5 * rng.standard_normal((len(lengths), 2, 16, 8)))
  return inputs


def run_packed(implementation, n_h, cu, **inputs):
  return householder_delta_product(
    **inputs,
    num_householder=n_h,
    cu_seqlens=cu,
    output_final_state=True,
    implementation=implementation,
    chunk_size=16,
  )


def run_separate(implementation, n_h, cu, **inputs):
  """Each sequence in a call of its own (B = 1) from its own initial state; an empty sequence
  keeps its initial state. Returns (o [1, T, H, V], final [N, H, K, V]) in packed order."""
  q, k, v, g, beta, h0 = (inputs[n] for n in HH_ARRAYS)
  outs, finals = [], []
  for n in range(len(cu) - 1):
    a, e = int(cu[n]), int(cu[n + 1])
    h = None if h0 is None else h0[n : n + 1]
    if a == e:
      finals.append(jnp.zeros(q.shape[2:3] + (q.shape[3], v.shape[3])) if h is None else h[0])
      continue
    sub = lambda x: x[:, a * n_h : e * n_h]
    o, f = run(
      implementation,
      n_h,
      q=q[:, a:e],
      k=sub(k),
      v=sub(v),
      g=None if g is None else g[:, a:e],
      beta=sub(beta),
      initial_state=h,
    )
    outs.append(o)
    finals.append(f[0])
  return jnp.concatenate(outs, axis=1), jnp.stack(finals)


@pytest.mark.parametrize(
  "implementation,n_h,with_g,with_state",
  [
    ("reference", 2, True, True),
    ("reference", 3, True, False),
    # "xla" against the reference's separate calls (the cheapest program to compile)
    ("xla", 3, False, True),
    # the Pallas kernels' packed path over the sub-steps, against the reference's packed path
    # (which the cases above hold to separate calls): one interpreted program instead of four
    ("triton", 2, True, True),
  ],
)
def test_packed_equals_separate(implementation, n_h, with_g, with_state):
  inputs = packed_hh_inputs(60 + n_h, n_h, with_g=with_g, with_state=with_state)
  cu = cu_of(PACKED)
  packed = functools.partial(run_packed, implementation, n_h, cu)
  if implementation == "triton":
    separate = functools.partial(run_packed, "reference", n_h, cu)
  else:
    separate = functools.partial(run_separate, "reference", n_h, cu)
  # outputs and gradients: one program per side (tests/cases.py outputs_and_grads)
  (o, final), grads = outputs_and_grads(packed, inputs, HH_ARRAYS)
  assert o.shape == (1, sum(PACKED), 2, 8) and o.dtype == jnp.float32
  assert final.shape == (len(PACKED), 2, 16, 8) and final.dtype == jnp.float32
  (o_sep, final_sep), grads_sep = outputs_and_grads(separate, inputs, HH_ARRAYS)
  assert_close(o, o_sep, F32, "o")
  assert_close(final, final_sep, F32, "final states")
  h0 = inputs["initial_state"]
  np.testing.assert_array_equal(final[2], 0.0 if h0 is None else h0[2])  # the empty sequence

  assert set(grads) == {n for n in HH_ARRAYS if inputs.get(n) is not None}
  for name, d in grads.items():
    assert d.shape == inputs[name].shape, name
    assert_close(d, grads_sep[name], GRAD_F32, f"{implementation} d{name}")


@pytest.mark.parametrize("n_h", [2, 4])
def test_packed_reference_against_float64_recurrence(n_h):
  """Each sequence against the independent float64 recurrence from its own initial state."""
  inputs = packed_hh_inputs(70 + n_h, n_h)
  cu = cu_of(PACKED)
  o, final = jax.jit(lambda kw: run_packed("reference", n_h, cu, **kw))(inputs)  # one compile
  h0 = inputs["initial_state"]
  for n in range(len(PACKED)):
    a, e = cu[n], cu[n + 1]
    if a == e:
      np.testing.assert_array_equal(final[n], h0[n])
      continue
    sub = lambda name: inputs[name][:, a * n_h : e * n_h]
    o_np, f_np = np_householder(
      inputs["q"][:, a:e],
      sub("k"),
      sub("v"),
      inputs["g"][:, a:e],
      sub("beta"),
      n_h,
      16**-0.5,
      h0[n : n + 1],
    )
    assert_close(o[:, a:e], o_np, F32, f"o of sequence {n}")
    assert_close(final[n], f_np[0], F32, f"final state of sequence {n}")


def test_packed_one_step_is_the_packed_operator():
  """n_h = 1 with cu_seqlens is the operator's packed form (mask None)."""
  inputs = packed_hh_inputs(75, 1)
  cu = cu_of(PACKED)
  for implementation in ("reference", "xla"):
    operator = functools.partial(
      gated_delta_product, cu_seqlens=cu, output_final_state=True, implementation=implementation
    )
    o_ref, f_ref = jax.jit(lambda kw: operator(**kw))(inputs)
    o, f = jax.jit(lambda kw: run_packed(implementation, 1, cu, **kw))(inputs)
    assert_close(o, o_ref, F32, f"{implementation} o")
    assert_close(f, f_ref, F32, f"{implementation} final state")


@pytest.mark.parametrize("implementation", ["reference", "xla"])
def test_packed_one_compilation_for_new_boundaries(implementation):
  traces = []

  @jax.jit
  def packed(cu, inputs):
    traces.append(cu.shape)
    return run_packed(implementation, 2, cu, **inputs)

  inputs = packed_hh_inputs(80, 2)
  # the second set: empty sequences first and last, one of 12 tokens (24 sub-steps)
  for lengths in (PACKED, (0, 12, 3, 0)):
    cu = cu_of(lengths)
    o, final = packed(jnp.asarray(cu), inputs)
    o_sep, final_sep = jax.jit(lambda kw, cu=cu: run_separate("reference", 2, cu, **kw))(inputs)
    assert_close(o, o_sep, F32, f"o for {lengths}")
    assert_close(final, final_sep, F32, f"final for {lengths}")
  assert len(traces) == 1


def test_packed_default_implementation_is_the_operators(monkeypatch):
  """implementation=None with cu_seqlens runs what the operator's packed form picks: "pallas"
  where that is the default."""
  from gdp_jax.ops import registry

  monkeypatch.setattr(registry, "pallas_supported", lambda device=None: True)
  inputs = packed_hh_inputs(85, 2, lengths=(3, 4))
  calls = []
  original = registry.Registry.resolve
  monkeypatch.setattr(
    registry.Registry,
    "resolve",
    lambda self, *a, **kw: calls.append((self.function, impl := original(self, *a, **kw))) or impl,
  )
  call = functools.partial(
    householder_delta_product, num_householder=2, cu_seqlens=cu_of((3, 4)), output_final_state=True
  )
  o, final = jax.eval_shape(lambda kw: call(**kw), inputs)  # resolved while traced
  # the Pallas backend (off a GPU the interpreted Triton one), for the sub-steps' operator too
  assert [(f, impl.name) for f, impl in calls] == [("gated_delta_product", "triton")] * 2
  assert o.shape == (1, 7, 2, 8) and final.shape == (2, 2, 16, 8)


@pytest.mark.parametrize(
  "change,error,words",
  [
    (dict(cu_seqlens=[0, 5, 6, 6, 30]), ValueError, "cu_seqlens must end at T = 15"),
    (dict(cu_seqlens=[1, 5, 6, 6, 15]), ValueError, "cu_seqlens must start at 0"),
    (dict(cu_seqlens=[0, 6, 5, 6, 15]), ValueError, "cu_seqlens must be non-decreasing"),
    (dict(cu_seqlens=np.array([0.0, 5, 6, 6, 15])), TypeError, "integer dtype"),
    (dict(cu_seqlens=np.zeros((2, 2), np.int32)), ValueError, "cu_seqlens must be [N + 1]"),
    (dict(cu_seqlens=np.zeros((1,), np.int32)), ValueError, "cu_seqlens must be [N + 1]"),
    (dict(cu_seqlens="0,15"), TypeError, "cu_seqlens must be an int32 array"),
    (
      dict(initial_state=jnp.zeros((1, 2, 16, 8))),
      ValueError,
      "initial_state has shape (1, 2, 16, 8), expected (4, 2, 16, 8) ([N, H, K, V]",
    ),
    (dict(implementation="cuda"), ValueError, "implementation must be one of"),
  ],
)
def test_packed_bad_inputs_raise(change, error, words):
  kw = dict(packed_hh_inputs(90, 2), num_householder=2, cu_seqlens=cu_of(PACKED))
  kw.update(change)
  with pytest.raises(error) as info:
    householder_delta_product(**kw)
  assert words in str(info.value)


def test_packed_batch_must_be_one():
  inputs = hh_inputs(91, 2, B=2, T=7, with_state=False)
  with pytest.raises(ValueError, match="with cu_seqlens the batch size must be 1"):
    householder_delta_product(**inputs, num_householder=2, cu_seqlens=cu_of((3, 4)))


# ---- bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
  "change,error,words",
  [
    (
      dict(k=jnp.zeros((2, 7, 2, 16))),
      ValueError,
      "k has shape (2, 7, 2, 16), expected (2, 14, 2, 16) ([B, T*n_h, H, K]",
    ),
    (dict(v=jnp.zeros((2, 7, 2, 8))), ValueError, "expected [B, T*n_h, H, V] = [2, 14, 2, V]"),
    (dict(beta=jnp.zeros((2, 7, 2))), ValueError, "beta has shape (2, 7, 2), expected (2, 14, 2)"),
    (dict(beta=None), ValueError, "beta is required"),
    (dict(g=jnp.zeros((2, 14, 2))), ValueError, "g has shape (2, 14, 2), expected (2, 7, 2)"),
    (dict(q=jnp.zeros((2, 7, 16))), ValueError, "q must be [B, T, H, K] (rank 4)"),
    (
      dict(
        q=jnp.zeros((2, 0, 2, 16)),
        k=jnp.zeros((2, 0, 2, 16)),
        v=jnp.zeros((2, 0, 2, 8)),
        beta=jnp.zeros((2, 0, 2)),
        g=jnp.zeros((2, 0, 2)),
      ),
      ValueError,
      "need T >= 1",
    ),
    (
      dict(initial_state=jnp.zeros((2, 2, 16, 4))),
      ValueError,
      "initial_state has shape (2, 2, 16, 4)",
    ),
    (dict(v=jnp.zeros((2, 14, 2, 8), jnp.bfloat16)), TypeError, "share one dtype"),
    (dict(q=jnp.zeros((2, 7, 2, 16), jnp.int32)), TypeError, "q must have a floating dtype"),
    (dict(beta=jnp.zeros((2, 14, 2), jnp.int32)), TypeError, "beta must have a floating dtype"),
    (dict(num_householder=0), ValueError, "num_householder must be >= 1"),
    (dict(num_householder=2.0), TypeError, "num_householder must be an int"),
    (dict(num_householder=True), TypeError, "num_householder must be an int"),
    (dict(implementation="mosaic"), ValueError, "implementation must be one of"),
    (dict(precision="fp8"), ValueError, "precision must be None"),
    (dict(chunk_size=48), ValueError, "chunk_size must be one of"),
  ],
)
def test_bad_inputs_raise(change, error, words):
  kw = dict(hh_inputs(50, 2), num_householder=2, implementation="xla")
  kw.update(change)
  with pytest.raises(error) as info:
    householder_delta_product(**kw)
  assert words in str(info.value)


@pytest.mark.parametrize("precision", [None, "default", "tf32", "highest"])
def test_precision_strings_accepted(precision):
  inputs = hh_inputs(51, 2, T=3)
  # traced and lowered to XLA (where the precision goes); compiling adds nothing to check here
  o, _ = (
    jax.jit(
      lambda kw: householder_delta_product(
        **kw, num_householder=2, precision=precision, implementation="xla"
      )
    )
    .lower(inputs)
    .out_info
  )
  assert o.shape == (2, 3, 2, 8)


@pytest.mark.parametrize(
  "change,error,words",
  [
    (
      dict(k=jnp.zeros((2, 3, 2, 16))),
      ValueError,
      "k has shape (2, 3, 2, 16), expected (2, 2, 2, 16) ([B, n_h, H, K]",
    ),
    (dict(v=jnp.zeros((2, 2, 8))), ValueError, "expected [B, n_h, H, V] = [2, 2, 2, V]"),
    (dict(beta=jnp.zeros((2, 2))), ValueError, "beta has shape (2, 2), expected (2, 2, 2)"),
    (dict(q=jnp.zeros((2, 1, 2, 16))), ValueError, "q must be [B, H, K] (rank 3"),
    (dict(g=jnp.zeros((2, 3))), ValueError, "g has shape (2, 3)"),
    (dict(state=jnp.zeros((2, 2, 16, 3))), ValueError, "state has shape (2, 2, 16, 3)"),
    (dict(num_householder=3), ValueError, "n_h = num_householder = 3"),
    (dict(implementation="reference"), ValueError, "implementation must be one of"),
  ],
)
def test_step_bad_inputs_raise(change, error, words):
  inputs = hh_inputs(52, 2, T=1)
  kw = dict(
    q=inputs["q"][:, 0],
    k=inputs["k"],
    v=inputs["v"],
    g=inputs["g"][:, 0],
    beta=inputs["beta"],
    state=inputs["initial_state"],
    num_householder=2,
  )
  kw.update(change)
  with pytest.raises(error) as info:
    householder_delta_product_step(**kw)
  assert words in str(info.value)


# ---- the layer ----------------------------------------------------------------------------------

D, H, K = 16, 2, 8


def layer_of(**kw):
  args = dict(expand_v=2, chunk_size=16, implementation="xla")
  args.update(kw)
  return HouseholderDeltaProduct(D, H, K, rngs=nnx.Rngs(0), **args)


def run_steps(layer, x, cache):
  step = jax.jit(lambda x_t, c: layer.step(x_t, c))
  ys = []
  for t in range(x.shape[1]):
    y, cache = step(x[:, t], cache)
    ys.append(y)
  return jnp.stack(ys, axis=1), cache


@pytest.mark.parametrize(
  "kw",
  [
    dict(num_householder=2, allow_neg_eigval=True),
    dict(num_householder=3, use_short_conv=False, use_gate=False),
  ],
)
def test_layer_sequence_matches_steps(kw):
  layer = layer_of(**kw)
  x = jax.random.normal(jax.random.key(1), (2, 7, D))
  y, cache = nnx.jit(lambda m, x: m(x, return_cache=True))(layer, x)
  y_steps, cache_steps = run_steps(layer, x, layer.init_cache(2))
  assert y.shape == x.shape and cache.state.shape == (2, H, K, 2 * K)
  assert_close(y_steps, y, 2e-5, "outputs")
  assert_close(cache_steps.state, cache.state, 2e-5, "state")
  if layer.use_short_conv:
    n = layer.num_householder
    assert cache.conv.shape == (2, 3, H * K + n * H * K + n * H * 2 * K)
    np.testing.assert_array_equal(cache_steps.conv, cache.conv)


def test_householder_layer_ragged_prefill_and_gradients():
  """Right-padded prompts: the prefill's cache continued step by step gives the whole-sequence
  outputs; every parameter gets a gradient."""
  layer = layer_of(num_householder=2, allow_neg_eigval=True)
  x = jax.random.normal(jax.random.key(2), (2, 8, D))
  lengths = jnp.array([3, 6], jnp.int32)
  pad = jnp.arange(8)[None, :, None] >= lengths[:, None, None]
  _, cache = nnx.jit(lambda m, x, n: m(x, n, return_cache=True))(
    layer, jnp.where(pad, 50.0, x), lengths
  )
  y_full = nnx.jit(lambda m, x: m(x))(layer, x)
  for b in range(2):
    n = int(lengths[b])
    row = jax.tree.map(lambda a: a[b : b + 1], cache)
    y_rest, _ = run_steps(layer, x[b : b + 1, n:], row)
    assert_close(y_rest, y_full[b : b + 1, n:], 2e-5, f"row {b} after {n} tokens")
  grads = nnx.jit(nnx.grad(lambda m: jnp.sum(jnp.sin(m(x)))))(layer)
  for path, g in jax.tree_util.tree_leaves_with_path(nnx.state(grads, nnx.Param)):
    assert np.all(np.isfinite(g)) and np.any(np.asarray(g) != 0), jax.tree_util.keystr(path)


def test_householder_layer_is_the_operator():
  """The layer's operator call: k, v, beta per step from their own projection slices."""
  layer = layer_of(num_householder=2, use_short_conv=False)
  x = jax.random.normal(jax.random.key(3), (1, 5, D))
  q, k, v = layer._split_qkv(jax.nn.silu(layer._project_in(x)))
  assert q.shape == (1, 5, H, K) and k.shape == (1, 5, 2, H, K) and v.shape == (1, 5, 2, H, 16)
  np.testing.assert_allclose(np.linalg.norm(np.asarray(k), axis=-1), 1.0, atol=1e-5)
  g, beta = layer._gates(x)
  assert g.shape == (1, 5, H) and beta.shape == (1, 5, 2, H)
  assert float(beta.max()) < 1.0  # allow_neg_eigval off


@pytest.mark.parametrize(
  "kw,match",
  [
    (dict(num_householder=0), "num_householder must be a positive"),
    (dict(num_householder=True), "num_householder must be a positive"),
  ],
)
def test_layer_bad_configuration(kw, match):
  with pytest.raises(ValueError, match=match):
    layer_of(**kw)


# ---- the hybrid model ---------------------------------------------------------------------------


def test_hybrid_model_with_a_householder_layer_trains_a_step():
  # the layer over the operator's recurrence ("reference"; "xla"'s gradients: the operator tests
  # above): what is checked is the model's wiring, and its programs compile fastest
  config = HybridConfig(
    vocab_size=11,
    hidden_size=16,
    layer_pattern="HA",  # (a "D" layer's training step: test_models.py)
    num_heads=2,
    head_dim=8,
    num_blocks=2,
    num_householder=2,
    allow_neg_eigval=True,
    attn_num_heads=2,
    attn_num_kv_heads=1,
    mlp_ratio=0,
    chunk_size=16,
    implementation="reference",
  )
  model = HybridLM(config, rngs=nnx.Rngs(0))
  assert [type(b.mixer) for b in model.blocks] == [HouseholderDeltaProduct, GroupedQueryAttention]
  assert model.blocks[0].mixer.num_householder == 2
  tokens = jax.random.randint(jax.random.key(5), (2, 9), 0, 11, jnp.int32)
  graphdef, params = nnx.split(model)
  tx = optax.adam(1e-2)
  opt = tx.init(params)

  def loss_fn(params):
    logits = nnx.merge(graphdef, params)(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

  @jax.jit
  def train_step(params, opt):
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt = tx.update(grads, opt, params)
    return optax.apply_updates(params, updates), opt, loss

  params, opt, loss0 = train_step(params, opt)
  _, _, loss1 = train_step(params, opt)
  assert np.isfinite(float(loss0)) and float(loss1) < float(loss0)
  # Token by token from the empty cache gives the whole-sequence logits.
  model = nnx.merge(graphdef, params)
  full = nnx.jit(lambda m, t: m(t))(model, tokens)
  cache = model.init_cache(2, 16)
  step = nnx.jit(lambda m, t, c: m.step(t, c))
  for t in range(tokens.shape[1]):
    logits, cache = step(model, tokens[:, t], cache)
    assert_close(logits, full[:, t], 2e-5, f"logits at {t}")


def test_hybrid_config_householder_checks():
  with pytest.raises(ValueError, match="'H' \\(DeltaProduct"):
    HybridConfig(vocab_size=5, layer_pattern="DXA")
  with pytest.raises(ValueError, match="num_householder must be a positive integer"):
    HybridConfig(vocab_size=5, layer_pattern="HA", num_householder=0)


def test_hybrid_mask_mode_householder_makes_delta_product_layers():
  """mask_mode="householder" (configurations written before DeltaProduct had its own layer
  class) builds every "D" layer as a HouseholderDeltaProduct, the same as "H"; sharding is
  refused for them."""
  from gdp_jax.sharding import ShardingConfig

  kw = dict(vocab_size=7, hidden_size=16, num_heads=2, head_dim=8, mlp_ratio=0, chunk_size=16)
  old = HybridLM(HybridConfig(layer_pattern="DA", mask_mode="householder", **kw), rngs=nnx.Rngs(0))
  new = HybridLM(HybridConfig(layer_pattern="HA", **kw), rngs=nnx.Rngs(0))
  assert isinstance(old.blocks[0].mixer, HouseholderDeltaProduct)
  tokens = jnp.array([[1, 2, 3, 4, 5]], jnp.int32)
  call = nnx.jit(lambda m, t: m(t))  # one compile per model instead of one per operation
  np.testing.assert_array_equal(np.asarray(call(old, tokens)), np.asarray(call(new, tokens)))
  cfg = ShardingConfig(jax.make_mesh((1,), ("data",)), batch="data")
  with pytest.raises(ValueError, match="sharding is not supported with DeltaProduct layers"):
    HybridLM(HybridConfig(layer_pattern="HA", **kw), rngs=nnx.Rngs(0), sharding=cfg)
