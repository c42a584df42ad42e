"""Pallas backward kernels and the custom_vjp: each backward stage against its jnp counterpart in
gdp_jax/ops/gated_delta_product/xla_backward.py, and every gradient of `implementation="pallas"`
against jax.grad of the "reference" and "xla" implementations. On CPU the kernels run in interpret
mode; on a GPU the same tests run compiled, plus the large shapes marked `gpu` (tests/conftest.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdp_jax import gated_delta_product
from gdp_jax.ops.gated_delta_product import xla
from gdp_jax.ops.gated_delta_product import xla_backward as xb
from pallas_kernels.common.options import Launch
from pallas_kernels.triton.backward import bwd_dhu, bwd_dqkwg, bwd_dv_local, bwd_wy
from tests.cases import (
  GRAD_TOLERANCE,
  assert_close,
  loss_and_grads,
  make_inputs,
  present_arrays,
  stage_inputs,
  tol,
)

F32 = tol(jnp.float32)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _backward_stages(r, chunk, q, k, v, beta, mask, gcum, h0, do, dfinal):
  """{stage output: (kernel's, jnp form's)} of the four backward stages, in one program (one
  compile instead of one per eager operation of the jnp stages and around the kernels)."""
  ai = xla.solve_tril(xla.chunk_kkt(k, beta, mask, gcum, chunk), chunk * r)
  w, u = xla.recompute_w_u(k, v, beta, mask, gcum, ai, chunk)
  h, v_new, _ = xla.chunk_state(k, w, u, gcum, h0, chunk, chunk)
  pairs = {}

  dvl = xb.chunk_bwd_dv_local(q, k, gcum, do, 0.3, chunk, r)
  pairs["dv_local"] = (
    bwd_dv_local.chunk_bwd_dv_local(q, k, gcum, do, scale=0.3, chunk=chunk, key_blocks=r),
    dvl,
  )

  dh, dh0, dvn = xb.chunk_bwd_dhu(q, k, w, gcum, do, dvl, dfinal, 0.3, chunk)
  got2 = bwd_dhu.chunk_bwd_dhu(
    q, k, w, gcum, do, dvl, dfinal, scale=0.3, chunk=chunk, key_blocks=r,
    launch=Launch(block_v=16),
  )  # fmt: skip
  pairs.update(zip(("dh", "dh0", "dv_new"), zip(got2, (dh, dh0, dvn))))

  ref3 = xb.chunk_bwd_dqkwg(q, k, v_new, gcum, h, dh, do, dvn, 0.3, chunk)
  # key columns in blocks of 16 and V in pieces of 16: several programs per key block (their
  # dgamma parts summed) and several loop steps
  got3 = bwd_dqkwg.chunk_bwd_dqkwg(
    q, k, v_new, gcum, h, dh, do, dvn, scale=0.3, chunk=chunk, key_blocks=r,
    launch=Launch(block_v=16, block_k=16),
  )  # fmt: skip
  pairs.update(zip(("dq", "dk (dqkwg)", "dw", "dgamma (dqkwg)"), zip(got3, ref3)))

  dw = ref3[2]
  ref4 = xb.wy_bwd(k, v, beta, mask, gcum, ai, dw, dvn, chunk)
  # K and V in pieces of 16: several pieces per key block (r <= 2) and per V
  got4 = list(
    bwd_wy.wy_bwd(
      k, v, beta, mask, gcum, ai, dw, dvn, chunk=chunk, key_blocks=r,
      launch=Launch(block_v=16, block_k=16),
      dk_in=ref3[1],  # bwd_dqkwg's part of dk, added in the kernel (as the operator does)
    )
  )  # fmt: skip
  got4[3] = xb.reduce_dmask(got4[3], mask.shape)
  ref4 = (ref4[0] + ref3[1], *ref4[1:])
  pairs.update(zip(("dk", "dv", "dbeta", "dmask", "dgamma"), zip(got4, ref4)))
  return pairs


@pytest.mark.parametrize(
  "r,mask_kind,chunk", [(1, None, 32), (2, "head", 16), (4, "token", 16), (2, "shared", 32)]
)
def test_backward_stages_match_xla(r, mask_kind, chunk):
  s = stage_inputs(r, mask_kind, chunk)
  B, T, H, K = s["q"].shape
  V = s["v"].shape[-1]
  rng = np.random.default_rng(1)
  do = jnp.asarray(rng.standard_normal((B, T, H, V)), jnp.float32)
  dfinal = jnp.asarray(rng.standard_normal((B, H, K, V)), jnp.float32)
  arrays = (s["q"], s["k"], s["v"], s["beta_hm"], s["mask"], s["gcum"], s["initial_state"])
  pairs = _backward_stages(r, chunk, *arrays, do, dfinal)
  assert len(pairs) == 13, sorted(pairs)
  for name, (got, ref) in pairs.items():
    # dmask sums per-token terms over whatever the mask broadcasts: a longer float32 sum
    assert_close(got, ref, GRAD_TOLERANCE[jnp.float32] if name == "dmask" else F32, name)


def run(implementation, precision="ieee", **inputs):
  """Float32 checks against the reference use full float32 products (precision="ieee")."""
  return gated_delta_product(
    **inputs, output_final_state=True, implementation=implementation, precision=precision
  )


@pytest.mark.parametrize(
  "r,mask_kind,K,V,dtype",
  [
    (1, None, 128, 128, jnp.bfloat16),
    (2, "head", 64, 64, jnp.float32),
    (4, "token", 64, 32, jnp.bfloat16),
  ],
)
def test_backward_lowers_to_triton(monkeypatch, r, mask_kind, K, V, dtype):
  """Forward and backward kernels of jax.grad go through the Triton lowering (no GPU needed);
  "triton" named (on an H200 "pallas" is the Mosaic GPU forward)."""
  from tests.triton_lowering import lower_for_h200

  inputs = make_inputs(14, B=1, T=64, H=2, K=K, V=V, r=r, mask_kind=mask_kind, dtype=dtype)
  names, avals = present_arrays(inputs)

  def grads(*arrays):
    def loss(*a):
      o, f = run("triton", **dict(zip(names, a)))
      return jnp.sum(o.astype(jnp.float32)) + jnp.sum(f)

    # value_and_grad: with grad alone the forward's outputs are dead code (the backward reads
    # only the residuals) and chunk_state_output would not be lowered
    return jax.value_and_grad(loss, argnums=tuple(range(len(names))))(*arrays)

  modules = lower_for_h200(monkeypatch, grads, *avals)
  names = {m.split("tt.func public @")[1].split("(")[0] for m in modules}
  # the fused forward (chunk_fwd, chunk_state_output); the backward recomputes w, u and h
  expected = {
    "gdp_chunk_fwd",
    "gdp_chunk_state_output",
    "gdp_recompute_w_u",
    "gdp_chunk_h",
    "gdp_bwd_dv_local",
    "gdp_bwd_dhu",
    "gdp_bwd_dqkwg",
    "gdp_bwd_wy",
    "gdp_chunk_cumsum",
  }
  assert expected <= names, sorted(names)


@pytest.mark.gpu
@pytest.mark.parametrize("r,dtype", [(1, jnp.bfloat16), (2, jnp.float32)])
def test_gradients_large_on_gpu(r, dtype):
  inputs = make_inputs(15, B=1, T=4096, H=2, K=128, V=128, r=r, mask_kind="head", dtype=dtype)
  g_xla = loss_and_grads(functools.partial(run, "xla"), inputs)
  g_pal = loss_and_grads(functools.partial(run, "pallas"), inputs)
  for name in g_xla:
    assert_close(g_pal[name], g_xla[name], GRAD_TOLERANCE[dtype], f"d{name}")
