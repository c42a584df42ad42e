"""Pallas forward-stage kernels the backward reuses (cumsum, wy, chunk_h) against their jnp
counterparts in gdp_jax/ops/gated_delta_product/xla.py, and the whole `implementation="pallas"`
forward against the recurrent reference and through the Triton lowering (the fused kernels
themselves: tests/test_fused_forward.py).

On CPU the kernels run in interpret mode (pallas_kernels/config.py); on a GPU the same tests run the
compiled kernels, plus the large shapes marked `gpu` (tests/conftest.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

from gdp_jax import gated_delta_product
from gdp_jax.ops.gated_delta_product import xla
from pallas_kernels.common import cumsum
from pallas_kernels.common.options import Launch
from pallas_kernels.triton.forward import chunk_h, wy
from tests.cases import assert_close, make_inputs, present_arrays, stage_inputs, tol

STAGE_CASES = [(1, None, 32), (2, "head", 32), (4, "token", 16), (2, "shared", 16)]


@functools.partial(jax.jit, static_argnames=("chunk", "r"))
def forward_stages(g_hm, k, v, beta, mask, gcum, h0, *, chunk, r):
  """Every stage, kernel and jnp form, as one program (one compile instead of one per
  operation): {name: (kernel's, jnp's)}."""
  out = {"cumsum": (cumsum.chunk_local_cumsum(g_hm, chunk), gcum)}
  if g_hm.shape[-1] == chunk:
    rev_ref = jnp.flip(xla.chunk_local_cumsum(jnp.flip(g_hm, -1), chunk), -1)
    out["reverse cumsum"] = (cumsum.chunk_local_cumsum(g_hm, chunk, reverse=True), rev_ref)
  ai_ref = xla.solve_tril(xla.chunk_kkt(k, beta, mask, gcum, chunk), chunk * r)
  w_ref, u_ref = xla.recompute_w_u(k, v, beta, mask, gcum, ai_ref, chunk)
  w, u = wy.recompute_w_u(k, v, beta, mask, gcum, ai_ref, chunk=chunk, key_blocks=r)
  out["w"], out["u"] = (w, w_ref), (u, u_ref)
  h_ref, vn_ref, fin_ref = xla.chunk_state(k, w_ref, u_ref, gcum, h0, chunk, chunk)
  h, vn, fin = chunk_h.chunk_state(
    k, w_ref, u_ref, gcum, h0, chunk=chunk, key_blocks=r, launch=Launch(block_v=16)
  )
  out["h"], out["v_new"], out["final state"] = (h, h_ref), (vn, vn_ref), (fin, fin_ref)
  return out


@pytest.mark.parametrize("r,mask_kind,chunk", STAGE_CASES)
def test_stages_match_xla(r, mask_kind, chunk):
  s = stage_inputs(r, mask_kind, chunk)
  names = ("g_hm", "k", "v", "beta_hm", "mask", "gcum", "initial_state")
  stages = forward_stages(*(s[n] for n in names), chunk=chunk, r=r)
  assert ("reverse cumsum" in stages) == (s["g_hm"].shape[-1] == chunk)
  for name, (got, want) in stages.items():
    assert_close(got, want, tol(jnp.float32), name)


def test_reverse_cumsum_within_chunks():
  g = -jnp.abs(jax.random.normal(jax.random.key(0), (2, 3, 64)))
  rev = cumsum.chunk_local_cumsum(g, 16, reverse=True)
  chunks = g.reshape(2, 3, 4, 16)
  expected = jnp.flip(jnp.cumsum(jnp.flip(chunks, -1), -1), -1).reshape(g.shape)
  assert_close(rev, expected, tol(jnp.float32), "reverse cumsum")


def run(implementation, precision="ieee", **inputs):
  """Float32 checks against the reference use full float32 products (precision="ieee")."""
  return gated_delta_product(
    **inputs, output_final_state=True, implementation=implementation, precision=precision
  )


def test_forward_without_state_and_odd_dims():
  """No initial state; V not a power of two and dk = 4 < 16 (both padded inside); r = 8."""
  inputs = make_inputs(5, B=1, T=20, H=1, K=32, V=24, r=8, mask_kind="shared", with_state=False)
  # jitted: one compile each instead of one per operation
  o_ref, f_ref = jax.jit(functools.partial(run, "reference"))(**inputs)
  o, f = jax.jit(functools.partial(run, "pallas"))(**inputs)
  assert_close(o, o_ref, tol(jnp.float32), "o")
  assert_close(f, f_ref, tol(jnp.float32), "final state")


@pytest.mark.gpu
@pytest.mark.parametrize("r,dtype", [(1, jnp.bfloat16), (2, jnp.bfloat16), (4, jnp.float32)])
def test_forward_large_on_gpu(r, dtype):
  inputs = make_inputs(7, B=2, T=4096, H=4, K=128, V=128, r=r, mask_kind="head", dtype=dtype)
  o_ref, f_ref = run("xla", **inputs)
  o, f = run("pallas", **inputs)
  assert_close(o, o_ref, tol(dtype), "o")
  assert_close(f, f_ref, tol(dtype), "final state")


@pytest.mark.gpu
@pytest.mark.parametrize("precision,bound", [(None, 5e-3), ("highest", 1e-4), ("ieee", 2e-5)])
def test_float32_precisions_on_gpu(precision, bound):
  """TF32 (the default), tf32x3 ("highest") and IEEE against the xla form (HIGHEST)."""
  inputs = make_inputs(16, B=2, T=1024, H=4, K=128, V=128, r=1, mask_kind=None)
  o_ref, _ = run("xla", **inputs)
  o, _ = run("pallas", precision=precision, **inputs)
  assert_close(o, o_ref, bound, f"o at precision {precision}")


@pytest.mark.parametrize(
  "r,mask_kind,K,V,dtype",
  [
    (1, None, 128, 128, jnp.bfloat16),
    (2, "head", 128, 128, jnp.bfloat16),
    (4, "token", 64, 32, jnp.float32),
    (8, "shared", 32, 24, jnp.bfloat16),
  ],
)
def test_forward_lowers_to_triton(monkeypatch, r, mask_kind, K, V, dtype):
  """The forward that ships goes through the Pallas Triton lowering for an H200 (no GPU needed):
  chunk_fwd (block merge; diagonal inverse "auto": TF32 squaring at the default precision) and
  chunk_state_output, with the default options."""
  from pallas_kernels.common import options
  from tests.triton_lowering import lower_for_h200

  # (the non-finite guard's second branch would lower the same kernels again)
  opts = options.DEFAULT.replace(nonfinite_guard=False)
  inputs = make_inputs(8, B=1, T=64, H=2, K=K, V=V, r=r, mask_kind=mask_kind, dtype=dtype)
  names, avals = present_arrays(inputs)

  def fwd(*arrays):
    # "triton" named: on an H200 "pallas" is the Mosaic GPU forward
    return run("triton", precision=None, options=opts, **dict(zip(names, arrays)))

  modules = lower_for_h200(monkeypatch, fwd, *avals)
  assert len(modules) == 2  # chunk_fwd, chunk_state_output
  assert all("tt.func" in m for m in modules)
