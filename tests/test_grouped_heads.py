"""Grouped value heads (HV value heads for H query/key heads, HV % H == 0, value head i reading
key head i // (HV // H); docs/varlen.md#grouped-value-heads): every implementation of the operator
and of the step equals the same call with q and k repeated across each group (the interpreted
Pallas kernels: the reference's call), forward and gradients (dq, dk summed over the group);
the Pallas forward reads key head h // group in its fused kernels (no repeated q, k in front of
them; through the Triton lowering); the argument checks; the layer's `num_v_heads`."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gdp_jax import gated_delta_product, gated_delta_product_step
from gdp_jax.layers import GatedDeltaProduct
from gdp_jax.ops.gated_delta_product.api import IMPLEMENTATIONS
from gdp_jax.ops.step.api import REGISTRY as STEP_REGISTRY
from tests.cases import (
  GRAD_TOLERANCE,
  assert_close,
  loss_and_grads,
  make_inputs,
  outputs_and_grads,
  tol,
)


def grouped_inputs(seed, B=1, T=20, H=1, HV=2, K=16, V=16, r=2, mask_kind="head"):
  inputs = make_inputs(seed, B=B, T=T, H=HV, K=K, V=V, r=r, mask_kind=mask_kind)
  # distinct key heads: the first H of the HV drawn ones
  inputs["q"], inputs["k"] = inputs["q"][:, :, :H], inputs["k"][:, :, :H]
  return inputs


def repeat_keys(inputs, axis=2):
  group = inputs["v"].shape[axis] // inputs["q"].shape[axis]
  return dict(inputs, **{n: jnp.repeat(inputs[n], group, axis=axis) for n in ("q", "k")})


def first_token(inputs):
  """The step's arguments for token 0 of operator inputs (state = the initial state)."""
  step = {n: inputs[n][:, 0] for n in ("q", "k", "v", "g", "beta")}
  mask = inputs.get("mask")
  step["mask"] = mask[:, 0] if mask is not None and mask.ndim == 5 else mask
  step["state"] = inputs["initial_state"]
  return step


def sum_groups(d, heads, axis=2):
  d = jnp.moveaxis(d, axis, -2)
  d = d.reshape(d.shape[:-2] + (heads, -1, d.shape[-1])).sum(-2)
  return jnp.moveaxis(d, -2, axis)


# (implementation, H, HV, r, mask kind); pallas is interpreted on a CPU: tiny.
CASES = [
  ("reference", 1, 2, 2, "head"),
  ("xla", 2, 4, 2, "token"),
  ("xla", 1, 3, 1, None),
  ("pallas", 1, 2, 2, "head"),
]


@pytest.mark.parametrize("implementation,H,HV,r,mask_kind", CASES)
def test_grouped_equals_repeated_keys(implementation, H, HV, r, mask_kind):
  assert implementation in IMPLEMENTATIONS
  inputs = grouped_inputs(1, H=H, HV=HV, r=r, mask_kind=mask_kind)
  run = functools.partial(
    gated_delta_product, output_final_state=True, chunk_size=16, implementation=implementation
  )
  if implementation == "pallas":  # a custom_vjp: its plain forward is a program of its own
    o, final = jax.jit(lambda kw: run(**kw))(inputs)
    grads = jax.jit(lambda kw: loss_and_grads(run, kw))(inputs)
    # the repeated keys on the reference (the interpreted kernels compile slowly; the reference
    # case above checks that the reference's grouped call equals its repeated one)
    reference = functools.partial(run, implementation="reference")
    (o_rep, final_rep), grads_rep = outputs_and_grads(reference, repeat_keys(inputs))
  else:  # outputs and gradients from one program (tests/cases.py outputs_and_grads)
    (o, final), grads = outputs_and_grads(run, inputs)
    (o_rep, final_rep), grads_rep = outputs_and_grads(run, repeat_keys(inputs))
  assert o.shape == inputs["v"].shape and final.shape == inputs["initial_state"].shape
  assert_close(o, o_rep, tol(jnp.float32), "o")
  assert_close(final, final_rep, tol(jnp.float32), "final state")
  for name, d in grads.items():
    expected = sum_groups(grads_rep[name], H) if name in ("q", "k") else grads_rep[name]
    assert d.shape == inputs[name].shape, name
    assert_close(d, expected, tol(jnp.float32, GRAD_TOLERANCE), f"d{name}")


@pytest.mark.parametrize("backward", ["xla"])
def test_pallas_grouped_other_paths(backward):
  """The Pallas forward with the jnp backward (which gets q and k un-repeated) equals "xla" with
  grouped value heads: the forward and the gradients."""
  from pallas_kernels.common.options import DEFAULT

  inputs = grouped_inputs(7, T=16, H=1, HV=2, r=1, mask_kind="token")
  kw = dict(output_final_state=True, chunk_size=16)
  options = DEFAULT.replace(precision="ieee")
  pallas = functools.partial(
    gated_delta_product, **kw, implementation="pallas", options=options, backward=backward
  )
  xla = functools.partial(gated_delta_product, **kw, implementation="xla")
  # "xla": outputs and gradients from one program (tests/cases.py outputs_and_grads)
  outputs_xla, grads_xla = outputs_and_grads(xla, inputs)
  for got, expected, name in zip(jax.jit(pallas)(**inputs), outputs_xla, ("o", "final")):
    assert_close(got, expected, tol(jnp.float32), name)
  if backward == "xla":
    grads = jax.jit(lambda i: loss_and_grads(pallas, i))(inputs)
    for name, d in grads.items():
      assert d.shape == inputs[name].shape, name
      assert_close(d, grads_xla[name], tol(jnp.float32, GRAD_TOLERANCE), f"d{name}")


@pytest.mark.parametrize("implementation", STEP_REGISTRY.names())
def test_grouped_step_equals_repeated_keys(implementation):
  inputs = grouped_inputs(2, B=2, T=1, H=2, HV=4, r=2, mask_kind="token")
  step = first_token(inputs)
  state = step["state"]
  o, new = gated_delta_product_step(**step, implementation=implementation)
  o_rep, new_rep = gated_delta_product_step(
    **repeat_keys(step, axis=1), implementation=implementation
  )
  assert o.shape == step["v"].shape and new.shape == state.shape
  assert_close(o, o_rep, tol(jnp.float32), "o")
  assert_close(new, new_rep, tol(jnp.float32), "state")


def test_grouped_step_gradients():
  """The step's "xla" implementation is plain jnp: its dq, dk sum over the group."""
  inputs = grouped_inputs(3, B=1, T=1, H=1, HV=2, r=1, mask_kind=None)
  step = first_token(inputs)

  def loss(q, k, kw):
    o, new = gated_delta_product_step(**dict(kw, q=q, k=k), implementation="xla")
    return jnp.sum(o**2) + jnp.sum(jnp.sin(new))

  kw = {n: x for n, x in step.items() if n not in ("q", "k")}
  grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
  dq, dk = grad(step["q"], step["k"], kw)
  rep = repeat_keys(step, axis=1)
  dq_rep, dk_rep = grad(rep["q"], rep["k"], kw)
  assert_close(dq, sum_groups(dq_rep, 1, axis=1), tol(jnp.float32, GRAD_TOLERANCE), "dq")
  assert_close(dk, sum_groups(dk_rep, 1, axis=1), tol(jnp.float32, GRAD_TOLERANCE), "dk")


# ---- the Pallas forward reads the key heads in place ---------------------------------------------


def _pallas_operands(jaxpr):
  """The operand shapes of every pallas_call in a jaxpr, its sub-jaxprs included."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "pallas_call":
      found.append([tuple(x.aval.shape) for x in eqn.invars])
      continue
    for value in eqn.params.values():
      for item in value if isinstance(value, (tuple, list)) else (value,):
        if isinstance(item, jax.extend.core.ClosedJaxpr):
          found += _pallas_operands(item.jaxpr)
        elif isinstance(item, jax.extend.core.Jaxpr):
          found += _pallas_operands(item)
  return found


@pytest.mark.parametrize("packed", [False, True])
def test_pallas_kernels_do_not_repeat_keys(packed):
  """The fused forward's pallas_calls take q and k with their H key heads (K = 32 != V = 16, so
  a [.., HV, 32] operand could only be a repeated q or k), in a call without gradient and in the
  forward of a gradient; so do the backward's kernels, whose one [.., HV, 32] operand is dq's
  part per value head handed from bwd_dqkwg to bwd_wy (a repeated q and k would add one to every
  kernel that reads them)."""
  from pallas_kernels.common.options import DEFAULT

  H, HV, K = 1, 2, 32
  inputs = grouped_inputs(6, T=20, H=H, HV=HV, K=K, V=16, r=1, mask_kind=None)
  extra = dict(cu_seqlens=np.array([0, 7, 20], np.int32)) if packed else {}
  if packed:
    inputs["initial_state"] = jnp.zeros((2, HV, K, 16))

  def shapes(mode):
    run = lambda kw: gated_delta_product(
      **kw, **extra, chunk_size=16, implementation="pallas", options=DEFAULT
    )[0]
    fn = {
      "call": run,
      "vjp": lambda kw: jax.vjp(run, kw)[0],
      "grad": lambda kw: jax.grad(lambda x: run(x).astype(jnp.float32).sum())(kw),
    }[mode]
    return _pallas_operands(jax.make_jaxpr(fn)(inputs).jaxpr)

  for mode in ("call", "vjp"):
    # two kernels per forward; the non-finite guard's lax.cond traces the forward twice (raw
    # and cleaned inputs, gdp_jax/ops/gated_delta_product/triton.py)
    calls = shapes(mode)
    assert len(calls) in (2, 4), calls
    key_operands = [s for c in calls for s in c if len(s) == 4 and s[-1] == K]
    # k in chunk_fwd; q and k in chunk_state_output
    assert len(key_operands) == 3 * len(calls) // 2, calls
    assert all(s[2] == H for s in key_operands), calls
  grad_calls = shapes("grad")
  per_value_head = [s for c in grad_calls for s in c if len(s) == 4 and s[-1] == K and s[2] == HV]
  assert len(per_value_head) == 1, grad_calls
  key_operands = [s for c in grad_calls for s in c if len(s) == 4 and s[-1] == K and s[2] == H]
  # the forward's 3 and the backward's 9: k in recompute_w_u, chunk_state and bwd_wy, q and k in
  # bwd_dv_local, bwd_dhu and bwd_dqkwg
  assert len(key_operands) == 3 + 9, grad_calls


@pytest.mark.parametrize("r,dtype", [(1, jnp.bfloat16), (2, jnp.float32)])
def test_grouped_fused_kernels_lower_to_triton(monkeypatch, r, dtype):
  """chunk_fwd and chunk_state_output (with and without a table) with 2 key heads for 4 value
  heads (group 2) through the Pallas Triton lowering for an H200."""
  from pallas_kernels.triton.forward import chunk_fwd, chunk_state_output
  from tests.triton_lowering import lower_for_h200

  S = jax.ShapeDtypeStruct
  K = V = 128
  chunk, T = 64 // r, 128
  keys, vals = S((1, T, 2, K), dtype), S((1, T, 4, V), dtype)
  per_head, mask = S((1, 4, T), jnp.float32), S((1, 1, 4, r, r), jnp.float32)
  rows_k, rows_v = S((1, 4, T * r, K), dtype), S((1, 4, T * r, V), dtype)
  h0, table = S((1, 4, K, V), jnp.float32), S((2, 1), jnp.int32)  # one sequence

  def fused(q, k, v, g, beta, mask, w, u, h0, table):
    common = dict(key_blocks=r, chunk=chunk)
    return [
      chunk_fwd.chunk_fwd(k, v, g, beta, mask, save_ai=True, **common),
      chunk_state_output.chunk_state_output(q, k, w, u, g, h0, scale=0.1, **common),
      chunk_state_output.chunk_state_output(
        q, k, w, u, g, h0, scale=0.1, save_states=True, table=table, **common
      ),
    ]

  avals = (keys, keys, vals, per_head, per_head, mask, rows_k, rows_v, h0, table)
  modules = lower_for_h200(monkeypatch, fused, *avals)
  assert len(modules) == 3 and all("tt.func" in m for m in modules)


def test_fused_kernels_reject_heads_not_a_multiple():
  from pallas_kernels.triton.forward import chunk_fwd, chunk_state_output

  k, v, s3 = jnp.zeros((1, 16, 2, 16)), jnp.zeros((1, 16, 3, 16)), jnp.zeros((1, 3, 16))
  with pytest.raises(ValueError, match="HV a multiple of H; got k"):
    chunk_fwd.chunk_fwd(k, v, s3, s3, jnp.ones((1, 1, 1, 1, 1)), key_blocks=1, chunk=16)
  w, h0 = jnp.zeros((1, 3, 16, 16)), jnp.zeros((1, 3, 16, 16))
  with pytest.raises(ValueError, match="w has 3 value heads"):
    chunk_state_output.chunk_state_output(k, k, w, w, s3, h0, key_blocks=1, chunk=16, scale=1.0)


# ---- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
  "change,words",
  [
    (dict(v=jnp.zeros((1, 8, 3, 8))), "with HV a positive multiple of H = 2"),
    (dict(g=jnp.zeros((1, 8, 2))), "g has shape (1, 8, 2), expected (1, 8, 4)"),
    (dict(beta=jnp.zeros((1, 8, 2))), "beta has shape (1, 8, 2), expected (1, 8, 4)"),
    (dict(mask=jnp.zeros((2, 2, 2))), "[H, r, r] = [4, 2, 2]"),
    (dict(initial_state=jnp.zeros((1, 2, 16, 8))), "expected (1, 4, 16, 8) ([B, HV, K, V])"),
  ],
)
def test_bad_grouped_inputs_raise(change, words):
  inputs = grouped_inputs(4, T=8, H=2, HV=4, V=8)
  inputs.update(change)
  with pytest.raises(ValueError) as info:
    gated_delta_product(**inputs)
  assert words in str(info.value)


@pytest.mark.parametrize(
  "change,words",
  [
    (dict(v=jnp.zeros((1, 3, 8))), "with HV a positive multiple of H = 2"),
    (dict(g=jnp.zeros((1, 2))), "g has shape (1, 2), expected (1, 4)"),
    (dict(state=jnp.zeros((1, 2, 16, 8))), "expected (1, 4, 16, 8) ([B, HV, K, V])"),
  ],
)
def test_bad_grouped_step_inputs_raise(change, words):
  inputs = grouped_inputs(5, T=1, H=2, HV=4, V=8)
  step = first_token(inputs)
  step.update(change)
  with pytest.raises(ValueError) as info:
    gated_delta_product_step(**step)
  assert words in str(info.value)


# ---- the layer ---------------------------------------------------------------------------------


def test_layer_grouped_sequence_matches_steps():
  D = 16
  layer = GatedDeltaProduct(
    D, 2, 8, num_v_heads=4, num_blocks=2, chunk_size=16, implementation="xla", rngs=nnx.Rngs(0)
  )
  assert layer.v_proj.kernel.shape == (D, 4 * 8) and layer.a_proj.kernel.shape == (D, 4)
  assert layer.o_proj.kernel.shape == (4 * 8, D) and layer.mask_weight.shape == (4, 2, 2)
  x = jax.random.normal(jax.random.key(0), (2, 7, D))
  y, cache = nnx.jit(lambda m, x: m(x, return_cache=True))(layer, x)  # one compile, not per op
  assert cache.state.shape == (2, 4, 8, 8)
  step = jax.jit(lambda x_t, c: layer.step(x_t, c))
  c = layer.init_cache(2)
  ys = []
  for t in range(x.shape[1]):
    y_t, c = step(x[:, t], c)
    ys.append(y_t)
  assert_close(jnp.stack(ys, axis=1), y, 1e-5, "steps")
  assert_close(c.state, cache.state, 1e-5, "state")


@pytest.mark.parametrize(
  "kw,match",
  [
    (dict(num_v_heads=3), "num_v_heads = 3 must be a multiple of num_heads = 2"),
    (dict(num_v_heads=0), "num_v_heads must be a positive integer"),
  ],
)
def test_layer_bad_num_v_heads(kw, match):
  with pytest.raises(ValueError, match=match):
    GatedDeltaProduct(16, 2, 8, rngs=nnx.Rngs(0), **kw)
