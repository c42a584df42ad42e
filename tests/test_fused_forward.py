"""The fused forward kernels (pallas_kernels/triton/forward/chunk_fwd.py, chunk_state_output.py):
each against the jnp stages of gdp_jax/ops/gated_delta_product/xla.py (interpret mode on CPU,
compiled on a GPU), the whole `implementation="pallas"` operator against "reference" (forward and
gradients), and the Triton lowering of both kernels at the benchmark-like shapes.

Interpret-mode compile time grows with the rows per chunk, so the stage cases keep N = chunk * r
<= 128 and tiny B, H, T.
"""

from __future__ import annotations

import functools

import jax
import jax.extend
import jax.numpy as jnp
import pytest

from gdp_jax import gated_delta_product
from gdp_jax.ops.gated_delta_product import triton as gdp_triton
from gdp_jax.ops.gated_delta_product import xla
from gdp_jax.ops.validation import normalize_mask
from pallas_kernels.common import compat
from pallas_kernels.common.options import Launch
from pallas_kernels.triton.forward import chunk_fwd, chunk_state_output
from tests.cases import (
  GRAD_TOLERANCE,
  assert_close,
  grads_program,
  make_inputs,
  outputs_and_grads,
  present_arrays,
  tol,
)

F32 = tol(jnp.float32)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _stages(r, chunk, with_state, q, k, v, g, beta, mask, h0):
  """The jnp stages (float32, HIGHEST) in one jit: one compile instead of many small ops."""
  gamma = xla.chunk_local_cumsum(g, chunk)
  ai = xla.solve_tril(xla.chunk_kkt(k, beta, mask, gamma, chunk), chunk * r)
  w, u = xla.recompute_w_u(k, v, beta, mask, gamma, ai, chunk)
  ref = dict(gamma=gamma, ai=ai, w=w, u=u)
  if with_state:
    h, v_new, final = xla.chunk_state(k, w, u, gamma, h0, chunk, chunk)
    o = xla.chunk_output(q, k, v_new, h, gamma, 0.3, chunk)
    ref.update(h=h, v_new=v_new, final=final, o=o)
  return ref


def padded_stage_inputs(r, chunk, mask_kind, dtype, K, V, nchunks=2, seed=0, with_state=False):
  """Inputs with T = nchunks * chunk, the jnp stages on them (float32; the state and output
  stages too if with_state), and the same inputs padded in K (per key block) and V as
  the triton implementation pads them for the kernels."""
  T = nchunks * chunk
  inp = make_inputs(seed, B=1, T=T, H=2, K=K, V=V, r=r, mask_kind=mask_kind, dtype=dtype)
  q, k, v, h0 = inp["q"], inp["k"], inp["v"], inp["initial_state"]
  mask, _ = normalize_mask(inp["mask"], 1, T, 2, K)
  mask = mask.astype(jnp.float32)
  g, beta = xla.to_head_major(inp["g"]), xla.to_head_major(inp["beta"])
  ref = _stages(r, chunk, with_state, q, k, v, g, beta, mask, h0)
  dkp, vp = gdp_triton.padded_dims(K, V, r)
  pad_k = lambda x: gdp_triton.pad_key_blocks(x, r, dkp)
  pad_v = lambda x: gdp_triton._pad_last(x, vp)
  kern = dict(
    q=pad_k(q),
    k=pad_k(k),
    v=pad_v(v),
    g=g,
    beta=beta,
    mask=mask,
    h0=pad_v(pad_k(h0.swapaxes(-1, -2)).swapaxes(-1, -2)),
    w=pad_k(ref["w"].astype(dtype)),
    u=pad_v(ref["u"].astype(dtype)),
    gamma=ref["gamma"],
  )
  unpad = dict(
    k=lambda x, axis=-1: gdp_triton.unpad_key_blocks(x, r, K // r, axis), v=lambda x: x[..., :V]
  )
  return ref, kern, unpad


# (r, chunk, mask kind, dtype, K, V): every r (1, 2, 4, 8), every chunk (16, 32, 64; up to
# N = chunk * r = 128 rows), every mask shape (none, shared, per head, per token), ragged K / V
# (padded inside), bf16 and float32: each case one kernel compile in the interpreter, so each
# feature once.
FWD_CASES = [
  (1, 64, None, jnp.bfloat16, 24, 20),
  (2, 32, "token", jnp.float32, 40, 24),
  (2, 64, "shared", jnp.float32, 32, 16),
  (4, 16, "head", jnp.bfloat16, 64, 16),
  (8, 16, "token", jnp.float32, 128, 16),
  (4, 32, "head", jnp.bfloat16, 64, 32),  # N = 128: the row-block loop with half inputs
]


@pytest.mark.parametrize("r,chunk,mask_kind,dtype,K,V", FWD_CASES)
def test_chunk_fwd_matches_stages(r, chunk, mask_kind, dtype, K, V):
  ref, kern, unpad = padded_stage_inputs(r, chunk, mask_kind, dtype, K, V)
  gamma, w, u, ai = chunk_fwd.chunk_fwd(
    kern["k"],
    kern["v"],
    kern["g"],
    kern["beta"],
    kern["mask"],
    key_blocks=r,
    chunk=chunk,
    save_ai=True,
  )
  assert w.dtype == dtype and u.dtype == dtype and ai.dtype == dtype
  assert gamma.dtype == jnp.float32
  t = tol(dtype)
  assert_close(gamma, ref["gamma"], F32, "gamma")
  assert_close(unpad["k"](w), ref["w"], t, "w")
  assert_close(unpad["v"](u), ref["u"], t, "u")
  assert_close(ai, ref["ai"], t, "Ai")
  if (r, chunk) == (2, 32):  # without save_ai: the same w, u; Ai is not written
    out = chunk_fwd.chunk_fwd(
      kern["k"], kern["v"], kern["g"], kern["beta"], kern["mask"], key_blocks=r, chunk=chunk
    )
    assert len(out) == 3
    assert_close(out[1], w, 0.0, "w without save_ai")
    # the row-block loop (form "auto" takes it from 128 rows) at N = 64: the same values
    looped = chunk_fwd.chunk_fwd(
      *(kern[n] for n in ("k", "v", "g", "beta", "mask")),
      key_blocks=r,
      chunk=chunk,
      save_ai=True,
      form="loop",
    )
    for name, got, want in zip(("gamma", "w", "u", "Ai"), looped, (gamma, w, u, ai)):
      assert_close(got, want, 1e-5, f"{name} of the loop form")


@pytest.mark.parametrize("inverse", ["substitution", "squaring-x3"])
def test_chunk_fwd_inverses(inverse):
  """The diagonal inverses by forward substitution (what "auto" picks at "ieee") and by repeated
  squaring at TF32 x 3 (at "tf32x3") give the jnp form's w, u, Ai."""
  r, chunk, mask_kind, dtype, K, V = 2, 32, "token", jnp.float32, 32, 16
  ref, kern, unpad = padded_stage_inputs(r, chunk, mask_kind, dtype, K, V, seed=1)
  gamma, w, u, ai = chunk_fwd.chunk_fwd(
    kern["k"],
    kern["v"],
    kern["g"],
    kern["beta"],
    kern["mask"],
    key_blocks=r,
    chunk=chunk,
    save_ai=True,
    inverse=inverse,
  )
  t = tol(dtype)
  assert_close(gamma, ref["gamma"], F32, "gamma")
  assert_close(unpad["k"](w), ref["w"], t, "w")
  assert_close(unpad["v"](u), ref["u"], t, "u")
  assert_close(ai, ref["ai"], t, "Ai")


# (r, chunk, mask kind, dtype, K, V, block_v, save_states)
STATE_CASES = [
  (1, 64, None, jnp.bfloat16, 24, 20, 16, True),
  (2, 32, "token", jnp.float32, 40, 24, 16, True),
  (4, 16, "head", jnp.bfloat16, 64, 32, 16, False),
]
# r = 8 runs through this kernel in tests/test_pallas_forward.py (the operator, interpret mode).


@pytest.mark.parametrize("r,chunk,mask_kind,dtype,K,V,block_v,save_states", STATE_CASES)
def test_chunk_state_output_matches_stages(r, chunk, mask_kind, dtype, K, V, block_v, save_states):
  ref, kern, unpad = padded_stage_inputs(
    r, chunk, mask_kind, dtype, K, V, nchunks=3, with_state=True
  )
  out = chunk_state_output.chunk_state_output(
    kern["q"],
    kern["k"],
    kern["w"],
    kern["u"],
    kern["gamma"],
    kern["h0"],
    key_blocks=r,
    chunk=chunk,
    scale=0.3,
    save_states=save_states,
    launch=Launch(block_v=block_v),
  )
  assert len(out) == (4 if save_states else 2)
  o, final = out[:2]
  assert o.dtype == dtype and final.dtype == jnp.float32
  t = tol(dtype)
  assert_close(unpad["v"](o), ref["o"], t, "o")
  assert_close(unpad["v"](unpad["k"](final, axis=-2)), ref["final"], t, "final state")
  if save_states:
    h, v_new = out[2:]
    assert h.dtype == dtype and v_new.dtype == dtype
    assert_close(unpad["v"](unpad["k"](h, axis=-2)), ref["h"], t, "h")
    assert_close(unpad["v"](v_new), ref["v_new"], t, "v_new")


def run(implementation, backward=None, **inputs):
  return gated_delta_product(
    **inputs,
    output_final_state=True,
    implementation=implementation,
    precision="ieee",
    **({} if backward is None else dict(backward=backward)),
  )


def test_operator_forward_and_gradients():
  """The whole pallas operator against the recurrence, forward and every gradient: ragged T, K
  and V, per-token mask, r = 2; the gradients with the kernels' backward and with the jnp one
  (backward="xla")."""
  inputs = make_inputs(21, B=1, T=21, H=2, K=24, V=20, r=2, mask_kind="token")
  # jitted: one compile instead of one per operation; the reference's outputs and gradients
  # from one program (tests/cases.py outputs_and_grads)
  (o_ref, f_ref), g_ref = outputs_and_grads(functools.partial(run, "reference"), inputs)
  # the pallas forward and both gradients: one program (one compile instead of three)
  grads, args = grads_program(functools.partial(run, "pallas"), inputs)
  grads_jnp_bwd, _ = grads_program(functools.partial(run, "pallas", backward="xla"), inputs)
  (o, f), g_pal, g_jnp_bwd = jax.jit(
    lambda kw, a: (run("pallas", **kw), grads(*a), grads_jnp_bwd(*a))
  )(inputs, args)
  assert_close(o, o_ref, F32, "o")
  assert_close(f, f_ref, F32, "final state")
  assert set(g_pal) == set(g_jnp_bwd) == set(g_ref) == set(inputs)
  for name in g_ref:
    assert g_pal[name].shape == inputs[name].shape, name
    assert_close(g_pal[name], g_ref[name], GRAD_TOLERANCE[jnp.float32], f"d{name}")
    assert_close(g_jnp_bwd[name], g_ref[name], GRAD_TOLERANCE[jnp.float32], f"d{name} (xla bwd)")


def _sub_jaxprs(params):
  for value in params.values():
    for item in value if isinstance(value, (tuple, list)) else (value,):
      if isinstance(item, jax.extend.core.ClosedJaxpr):
        yield item.jaxpr
      elif isinstance(item, jax.extend.core.Jaxpr):
        yield item


def _pallas_outputs(fn, *args):
  """{kernel name: [output avals of each call]} over every pallas_call in fn's jaxpr."""
  found = {}

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "pallas_call":
        name = compat.pallas_call_name(eqn)
        found.setdefault(name, []).append([v.aval for v in eqn.outvars])
      else:
        for sub in _sub_jaxprs(eqn.params):
          walk(sub)

  walk(jax.make_jaxpr(fn)(*args).jaxpr)
  return found


def test_forward_only_writes_no_residuals():
  """Without gradient the fused forward writes gamma, w, u, o and the final state only; with
  jax.vjp it also writes the backward's residual Ai (never h or v_new). Each kernel appears
  once: the non-finite guard is selects around one run of the kernels (docs/precision.md)."""
  inputs = make_inputs(22, B=1, T=32, H=1, K=32, V=16, r=2, mask_kind="head")
  names, _ = present_arrays(inputs)
  args = [inputs[n] for n in names]
  fwd = lambda *a: run("pallas", **dict(zip(names, a)))
  calls = _pallas_outputs(fwd, *args)
  assert sorted(calls) == ["gdp_chunk_fwd", "gdp_chunk_state_output"], sorted(calls)
  assert [len(x) for x in calls["gdp_chunk_fwd"]] == [3]  # gamma, w, u
  assert [len(x) for x in calls["gdp_chunk_state_output"]] == [2]  # o, final
  calls = _pallas_outputs(lambda *a: jax.vjp(fwd, *a)[0], *args)
  assert [len(x) for x in calls["gdp_chunk_fwd"]] == [4]  # + Ai
  assert [len(x) for x in calls["gdp_chunk_state_output"]] == [2]


def test_bad_arguments():
  k = jnp.zeros((1, 64, 1, 32), jnp.bfloat16)
  v = jnp.zeros((1, 64, 1, 16), jnp.bfloat16)
  s = jnp.zeros((1, 1, 64), jnp.float32)
  mask = lambda r: jnp.ones((1, 1, 1, r, r), jnp.float32)
  with pytest.raises(ValueError, match="key_blocks must be 1, 2, 4 or 8"):
    chunk_fwd.chunk_fwd(jnp.zeros((1, 64, 1, 256)), v, s, s, mask(16), key_blocks=16, chunk=16)
  with pytest.raises(ValueError, match="chunk must be one of"):
    chunk_fwd.chunk_fwd(k, v, s, s, mask(1), key_blocks=1, chunk=128)
  with pytest.raises(ValueError, match="exceeds 256"):
    chunk_fwd.chunk_fwd(jnp.zeros((1, 64, 1, 128)), v, s, s, mask(8), key_blocks=8, chunk=64)
  with pytest.raises(ValueError, match="key_blocks = 2"):
    chunk_fwd.chunk_fwd(k, v, s, s, mask(1), key_blocks=2, chunk=16)
  with pytest.raises(ValueError, match="powers of two"):
    chunk_fwd.chunk_fwd(k, v[..., :12], s, s, mask(1), key_blocks=1, chunk=16)
  with pytest.raises(ValueError, match="inverse must be one of"):
    chunk_fwd.chunk_fwd(k, v, s, s, mask(1), key_blocks=1, chunk=16, inverse="newton")
  with pytest.raises(ValueError, match="form must be one of"):
    chunk_fwd.chunk_fwd(k, v, s, s, mask(1), key_blocks=1, chunk=16, form="unrolled")
  with pytest.raises(ValueError, match="block_v"):
    chunk_state_output.chunk_state_output(
      k,
      k,
      jnp.zeros((1, 1, 64, 32), k.dtype),
      jnp.zeros((1, 1, 64, 16), k.dtype),
      s,
      jnp.zeros((1, 1, 32, 16)),
      key_blocks=1,
      chunk=16,
      scale=1.0,
      launch=Launch(block_v=12),
    )
  with pytest.raises(ValueError, match="w must be"):
    chunk_state_output.chunk_state_output(
      k,
      k,
      jnp.zeros((1, 1, 32, 32), k.dtype),
      jnp.zeros((1, 1, 64, 16), k.dtype),
      s,
      jnp.zeros((1, 1, 32, 16)),
      key_blocks=1,
      chunk=16,
      scale=1.0,
    )
  with pytest.raises(ValueError, match="precision must be one of"):
    gdp_triton.gated_delta_product_pallas(
      k, k, v, s, s, mask(1), jnp.zeros((1, 1, 32, 16)), 1.0, 64, precision="bf16"
    )


# --- Triton lowering (no GPU needed) ----------------------------------------------------------


def _kernel_avals(r, chunk, K, V, dtype, per_token, T=128):
  S = jax.ShapeDtypeStruct
  fwd = [
    S((1, T, 2, K), dtype),
    S((1, T, 2, V), dtype),
    S((1, 2, T), jnp.float32),
    S((1, 2, T), jnp.float32),
    S((1, T, 2, r, r) if per_token else (1, 1, 2, r, r), jnp.float32),
  ]
  state = [
    S((1, T, 2, K), dtype),
    S((1, T, 2, K), dtype),
    S((1, 2, T * r, K), dtype),
    S((1, 2, T * r, V), dtype),
    S((1, 2, T), jnp.float32),
    S((1, 2, K, V), jnp.float32),
  ]
  return fwd, state


@pytest.mark.parametrize(
  "r,chunk,K,V,dtype,per_token",
  [
    (1, 64, 128, 128, jnp.bfloat16, False),
    (2, 32, 128, 128, jnp.bfloat16, True),
    (2, 64, 128, 128, jnp.bfloat16, False),
    (4, 16, 128, 128, jnp.bfloat16, True),
    (4, 32, 128, 128, jnp.bfloat16, False),
    (1, 64, 256, 256, jnp.bfloat16, False),
    (2, 32, 256, 256, jnp.bfloat16, False),
    (1, 64, 128, 128, jnp.float32, False),
    (2, 32, 128, 128, jnp.float32, True),
    (8, 16, 128, 128, jnp.float32, True),
  ],
)
def test_fused_kernels_lower_to_triton(monkeypatch, r, chunk, K, V, dtype, per_token):
  """Both fused kernels through the Pallas Triton lowering for an H200 as they ship (diagonal
  inverse "auto" at the default TF32 precision: TF32 squaring), with their residual outputs
  (save_ai, save_states); at the first shape also without the residuals and with the inverses
  "auto" picks at the other precisions (substitution at "ieee", TF32 x 3 squaring at "tf32x3").
  """
  from tests.triton_lowering import lower_for_h200

  fwd_avals, state_avals = _kernel_avals(r, chunk, K, V, dtype, per_token)
  first = (r, chunk, K, dtype) == (1, 64, 128, jnp.bfloat16)
  variants = [(True, "auto")] + (
    [(False, "auto"), (True, "substitution"), (True, "squaring-x3")] if first else []
  )

  def fused(*a):
    outs = [
      chunk_fwd.chunk_fwd(*a[:5], key_blocks=r, chunk=chunk, save_ai=save_ai, inverse=inverse)
      for save_ai, inverse in variants
    ]
    for save_states in (True, False) if first else (True,):
      outs.append(
        chunk_state_output.chunk_state_output(
          *a[5:], key_blocks=r, chunk=chunk, scale=0.1, save_states=save_states
        )
      )
    return outs

  modules = lower_for_h200(monkeypatch, fused, *fwd_avals, *state_avals)
  assert len(modules) == len(variants) + (2 if first else 1)
  assert all("tt.func" in m for m in modules)
  if chunk * r >= chunk_fwd.LOOP_ROWS:  # the row-block loop: one block's products, not nb^3
    assert len(modules[0].splitlines()) < 4000 and modules[0].count("tt.dot ") <= 16
