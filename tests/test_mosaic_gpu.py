"""The Mosaic GPU forward kernels (pallas_kernels/mosaic_gpu/) on a CPU.

Two checks a CPU can make (the compiled kernels, their speed, registers and spills need an sm_90
GPU: benchmarks/mosaic_gpu_check.py):
- lowering: every kernel lowers for the cuda platform at the benchmark shape (B=8, T=4096, H=16,
  K=V=128, bf16), which also checks the kernels' shared memory against the H200's 227 KB;
- interpretation: the kernels run in jax's Mosaic GPU interpreter (shared memory, barriers, TMA
  and wgmma simulated on the CPU) at small shapes, against the operator's recurrence
  ("reference": of the operator's forms the cheapest to compile).
All kernels are written in the interpreter-friendly form (operands of every product staged in
shared memory, fresh accumulators), so nothing is left to the GPU alone for correctness except
what the hardware adds: ptxas, register allocation, real asynchrony and timing.

The interpreter runs the warpgroups of the warp-specialised walk (walk_ws.py) as threads of XLA's
CPU client, whose thread pool has one thread per core: on a 2-core machine its three warpgroups
starve and hang. The interpreted cases therefore run in a subprocess with NPROC=8 (the pool size
XLA's CPU client reads). The walk's chain runs its products with register left operands on a GPU
and stages them through shared memory in the interpreter (`common.matmul_reg`): the same
arithmetic, which the GPU check (benchmarks/mosaic_gpu_check.py) compares against xla compiled.
"""

from __future__ import annotations

import functools
import json
import sys

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
import pytest

import gdp_jax
from gdp_jax.ops.gated_delta_product import pieces
from pallas_kernels.common import compat
from pallas_kernels.mosaic_gpu import backward_walk, chunk_grads, common, walk_shapes
from pallas_kernels.mosaic_gpu.chunk_inverse import chunk_inverse
from pallas_kernels.mosaic_gpu.forward import block_rows, forward, householder_forward, mask_rows
from tests.cases import run_interpreted_subprocess

F32 = jnp.float32


def _rel_rms(got, want):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.sqrt(np.mean((got - want) ** 2) / np.mean(want**2)))


def _inputs(seed, batch, t_len, heads, key_dim, value_dim, r, mask_kind, dtype=jnp.bfloat16):
  ks = jax.random.split(jax.random.PRNGKey(seed), 7)

  def unit(x):
    return x / jnp.linalg.norm(x, axis=-1, keepdims=True)

  q = unit(jax.random.normal(ks[0], (batch, t_len, heads, key_dim))).astype(dtype)
  k = unit(jax.random.normal(ks[1], (batch, t_len, heads, key_dim))).astype(dtype)
  v = jax.random.normal(ks[2], (batch, t_len, heads, value_dim)).astype(dtype)
  g = -0.3 * jax.random.uniform(ks[3], (batch, t_len, heads))
  beta = jax.random.uniform(ks[4], (batch, t_len, heads))
  shapes = {"none": None, "shared": (r, r), "head": (heads, r, r)}
  shapes["token"] = (batch, t_len, heads, r, r)
  shape = shapes[mask_kind]
  mask = None if shape is None else jax.random.uniform(ks[5], shape)
  h0 = 0.1 * jax.random.normal(ks[6], (batch, heads, key_dim, value_dim))
  return q, k, v, g, beta, mask, h0


@functools.partial(jax.jit, static_argnames=("scale",))
def _reference(q, k, v, g, beta, mask, h0, scale=None):
  up = functools.partial(jnp.asarray, dtype=F32)
  return gdp_jax.gated_delta_product(
    up(q),
    up(k),
    up(v),
    g,
    beta,
    mask,
    scale=scale,
    initial_state=h0,
    output_final_state=True,
    implementation="reference",
  )


# ---------------------------------------------------------------------------------------------
# Lowering at the benchmark shape.


@pytest.mark.parametrize(
  "r,mask_kind,with_state",
  [
    (1, "none", False),
    (1, "token", True),
    (2, "token", False),
    (2, "head", True),
    (4, "shared", True),
    (8, "shared", False),
  ],
)
def test_forward_lowers_for_cuda_at_benchmark_shape(r, mask_kind, with_state):
  batch, t_len, heads, dim = 8, 4096, 16, 128
  spec = jax.ShapeDtypeStruct
  act = spec((batch, t_len, heads, dim), jnp.bfloat16)
  gate = spec((batch, t_len, heads), F32)
  shapes = {"none": None, "shared": (r, r), "head": (heads, r, r)}
  shapes["token"] = (batch, t_len, heads, r, r)
  mask = None if shapes[mask_kind] is None else spec(shapes[mask_kind], F32)
  h0 = spec((batch, heads, dim, dim), F32) if with_state else None

  def run(q, k, v, g, beta, mask, h0):
    return forward(q, k, v, g, beta, mask, initial_state=h0, output_final_state=with_state)

  lowered = (
    jax.jit(run).trace(act, act, act, gate, gate, mask, h0).lower(lowering_platforms=("cuda",))
  )
  text = lowered.as_text()
  calls = [line for line in text.splitlines() if "custom_call" in line and "mosaic_gpu" in line]
  assert len(calls) == 2, calls  # chunk_inverse and state_walk


@pytest.mark.parametrize("n_h", [2, 4])
def test_householder_forward_lowers_for_cuda_at_benchmark_shape(n_h):
  batch, t_len, heads, dim = 8, 4096, 16, 128
  spec = jax.ShapeDtypeStruct
  q = spec((batch, t_len, heads, dim), jnp.bfloat16)
  sub = spec((batch, t_len * n_h, heads, dim), jnp.bfloat16)
  g = spec((batch, t_len, heads), F32)
  beta = spec((batch, t_len * n_h, heads), F32)
  h0 = spec((batch, heads, dim, dim), F32)

  def run(q, k, v, g, beta, h0):
    return householder_forward(q, k, v, g, beta, initial_state=h0, output_final_state=True)

  text = jax.jit(run).trace(q, sub, sub, g, beta, h0).lower(lowering_platforms=("cuda",)).as_text()
  calls = [line for line in text.splitlines() if "custom_call" in line and "mosaic_gpu" in line]
  assert len(calls) == 2, calls  # chunk_inverse and state_walk


@pytest.mark.parametrize("r", common.SUPPORTED_R)
def test_chunk_inverse_with_the_float32_solve_lowers_for_cuda(r):
  # the raw Mosaic GPU solve of the diagonal blocks (diag_solve.py) runs only compiled: lowering
  # is what a CPU can check of it (the interpreter runs the merges instead)
  batch, t_len, heads, dim = 8, 4096, 16, 128
  spec = jax.ShapeDtypeStruct
  k = spec((batch, t_len, heads, dim), jnp.bfloat16)
  beta_rows = spec((batch, heads, t_len * r), F32)
  rows = spec((1, heads, 1, r, common.ROWS_PER_CHUNK), F32)
  run = functools.partial(chunk_inverse, diag_solve=True)
  text = jax.jit(run).trace(k, beta_rows, rows).lower(lowering_platforms=("cuda",)).as_text()
  assert sum("mosaic_gpu" in line and "custom_call" in line for line in text.splitlines()) == 1
  with pytest.raises(ValueError, match="interpreter"):
    chunk_inverse(
      jnp.zeros((1, 64, 1, 64), jnp.bfloat16),
      jnp.zeros((1, 1, 64 * r), F32),
      jnp.zeros((1, 1, 1, r, common.ROWS_PER_CHUNK), F32),
      diag_solve=True,
      interpret=plgpu.InterpretGPUParams(),
    )


def test_shared_memory_limit_is_enforced():
  with pytest.raises(ValueError, match="shared memory"):
    common.check_smem("kernel", common.SMEM_LIMIT + 1)


# ---------------------------------------------------------------------------------------------
# The kernels in the interpreter. All interpreted cases run in one subprocess with NPROC=8 (see
# the module docstring), which prints their measures as JSON; the tests below check them.


def _t0_reference(k, beta, mask, r):
  """(I + A0)^-1 per chunk from the definition (block-major rows, common.py), float64."""
  batch, t_len, heads, key_dim = k.shape
  c = common.chunk_tokens(r)
  nc = t_len // c
  dk = key_dim // r
  kf = np.asarray(k, np.float64).reshape(batch, nc, c, heads, r, dk)
  bf = np.asarray(beta, np.float64).reshape(batch, nc, c, heads)
  m = np.broadcast_to(np.asarray(mask, np.float64), (batch, t_len, heads, r, r))
  m = m.reshape(batch, nc, c, heads, r, r)
  gram = np.einsum("bnthdx,bnshdx->bnhdts", kf, kf)  # <k_t^(d), k_s^(d)>
  # A0[(a,t),(d,s)] = beta_t M_t[a,d] <k_t^(d), k_s^(d)>, t > s
  a0 = np.einsum("bnth,bnthad,bnhdts->bnhatds", bf, m, gram)
  a0 = a0 * np.tril(np.ones((c, c)), -1)[None, None, None, None, :, None, :]
  a0 = a0.reshape(batch, nc, heads, r * c, r * c)
  inv = np.linalg.inv(np.eye(r * c) + a0)
  return np.transpose(inv, (0, 2, 1, 3, 4)).reshape(batch, heads, nc * r * c, r * c)


INVERSE_CASES = [(1, "none"), (2, "token"), (4, "head")]
# (r, mask kind, T, dtype, initial/final state)
FORWARD_CASES = [
  (1, "token", 70, "bfloat16", True),
  (2, "token", 45, "bfloat16", True),
  (4, "head", 33, "float16", True),
  (2, "shared", 64, "bfloat16", False),
  (1, "none", 150, "bfloat16", False),
]


def _case_name(case):
  return "-".join(str(x) for x in case)


def _run_interpreted_cases():
  """Runs every interpreted case here (in the subprocess); returns {name: measures}."""
  out = {}
  for r, mask_kind in INVERSE_CASES:
    batch, heads, key_dim = 1, 2, 64
    t_len = 2 * common.chunk_tokens(r)
    _, k, _, _, beta, mask, _ = _inputs(r, batch, t_len, heads, key_dim, 64, r, mask_kind)
    rows = mask_rows(mask, batch, t_len, heads, t_len, r)
    beta_rows = block_rows(jnp.swapaxes(beta, 1, 2), r)
    # two chunks in one program: the second one's loads in flight while the first is inverted
    t0 = jax.jit(
      functools.partial(chunk_inverse, chunks_per_program=2, interpret=plgpu.InterpretGPUParams())
    )(k, beta_rows, rows)
    got = np.asarray(t0.astype(F32))
    mask_np = np.ones((r, r)) if mask is None else np.asarray(mask)
    want = _t0_reference(k.astype(F32), beta, mask_np, r)
    wrong = _t0_reference(k.astype(F32), beta, np.swapaxes(mask_np, -1, -2), r)
    out[_case_name(("inverse", r, mask_kind))] = dict(
      err=float(np.abs(got - want).max()), err_wrong=float(np.abs(got - wrong).max())
    )
  for case in FORWARD_CASES:
    r, mask_kind, t_len, dtype, state = case
    q, k, v, g, beta, mask, h0 = _inputs(7 + r, 1, t_len, 2, 64, 64, r, mask_kind, jnp.dtype(dtype))
    h0 = h0 if state else None
    params = plgpu.InterpretGPUParams(detect_races=True)
    # jitted: one program instead of one per eager operation around the kernels
    run = functools.partial(forward, scale=0.3, output_final_state=state, interpret=params)
    o, final = jax.jit(run)(q, k, v, g, beta, mask, initial_state=h0)
    want_o, want_final = _reference(q, k, v, g, beta, mask, h0, scale=0.3)
    row = dict(
      o=_rel_rms(o.astype(F32), want_o), shape_ok=o.shape == v.shape and o.dtype == q.dtype
    )
    row["races"] = bool(compat.interpreter_races().races_found)
    if state:
      row["state"] = _rel_rms(final, want_final)
    if mask is not None and r > 1:  # what a wrong mask orientation scores
      wrong_o, _ = _reference(q, k, v, g, beta, jnp.swapaxes(mask, -1, -2), h0, scale=0.3)
      row["o_wrong"] = _rel_rms(o.astype(F32), wrong_o)
    out[_case_name(case)] = row
  for n_h, t_len in HOUSEHOLDER_CASES:
    out[_case_name(("householder", n_h, t_len))] = _householder_case(n_h, t_len)
  return out


# (n_h, T): whole chunks of 64 / n_h tokens and a part of one
HOUSEHOLDER_CASES = [(2, 40), (4, 20)]


def _householder_case(n_h, t_len):
  """The Householder form's kernels (`householder_forward`) against its recurrence, and against
  the recurrence with each token's sub-steps in reverse order (what a kernel that ignored their
  order would match)."""
  batch, heads, dim = 1, 2, 64
  q, _, _, g, _, _, h0 = _inputs(30 + n_h, batch, t_len, heads, dim, dim, 1, "none")
  _, k, v, _, beta, _, _ = _inputs(40 + n_h, batch, t_len * n_h, heads, dim, dim, 1, "none")
  beta = (1.5 * beta).astype(jnp.bfloat16)  # beyond 1: the products of (I - beta k k^T) count
  params = plgpu.InterpretGPUParams(detect_races=True)
  run = functools.partial(householder_forward, scale=0.3, output_final_state=True, interpret=params)
  o, final = jax.jit(run)(q, k, v, g, beta, initial_state=h0)
  races = bool(compat.interpreter_races().races_found)

  @jax.jit
  def recurrence(k, v, beta):
    up = functools.partial(jnp.asarray, dtype=F32)
    return gdp_jax.householder_delta_product(
      up(q), up(k), up(v), g, up(beta), num_householder=n_h, scale=0.3, initial_state=h0,
      output_final_state=True, implementation="reference",
    )  # fmt: skip

  want_o, want_final = recurrence(k, v, beta)
  rev = lambda x: x.reshape((batch, t_len, n_h) + x.shape[2:])[:, :, ::-1].reshape(x.shape)
  wrong_o, _ = recurrence(rev(k), rev(v), rev(beta))
  return dict(
    o=_rel_rms(o.astype(F32), want_o),
    state=_rel_rms(final, want_final),
    o_wrong=_rel_rms(o.astype(F32), wrong_o),
    shape_ok=o.shape == q.shape[:3] + (dim,) and o.dtype == q.dtype,
    races=races,
  )


@pytest.fixture(scope="module")
def interpreted():
  return run_interpreted_subprocess(__file__, timeout=540)


@pytest.mark.parametrize("r,mask_kind", INVERSE_CASES)
def test_chunk_inverse_interpreted(interpreted, r, mask_kind):
  row = interpreted[_case_name(("inverse", r, mask_kind))]
  # bf16 storage of entries of size up to ~1: half an ulp is 2^-9.
  assert row["err"] < 4e-3, row
  if r > 1:  # the check can fail: a wrong mask orientation is far off
    assert row["err_wrong"] > 2e-2, row


@pytest.mark.parametrize("case", FORWARD_CASES, ids=_case_name)
def test_forward_interpreted_matches_the_reference(interpreted, case):
  row = interpreted[_case_name(case)]
  assert row["shape_ok"], row
  assert not row["races"], row
  assert row["o"] < 1e-2, row
  assert row.get("state", 0.0) < 1e-2, row
  if "o_wrong" in row:  # the check can fail
    assert row["o_wrong"] > 2e-2, row


@pytest.mark.parametrize("n_h,t_len", HOUSEHOLDER_CASES)
def test_householder_forward_interpreted_matches_its_recurrence(interpreted, n_h, t_len):
  row = interpreted[_case_name(("householder", n_h, t_len))]
  assert row["shape_ok"] and not row["races"], row
  assert row["o"] < 1e-2 and row["state"] < 1e-2, row
  assert row["o_wrong"] > 5e-2, row  # the check can fail: the sub-steps' order matters


# ---------------------------------------------------------------------------------------------
# Arguments the kernels refuse.


def test_refuses_unsupported_arguments():
  q, k, v, g, beta, _, _ = _inputs(0, 1, 16, 1, 64, 64, 1, "none")
  with pytest.raises(ValueError, match="r=3"):
    forward(q, k, v, g, beta, jnp.ones((3, 3)))
  with pytest.raises(TypeError, match="bfloat16, float16"):
    forward(q.astype(F32), k.astype(F32), v.astype(F32), g, beta)
  with pytest.raises(ValueError, match="beta"):
    forward(q, k, v, g, beta[:, :8])
  with pytest.raises(ValueError, match="K=96"):
    pad = jnp.zeros(q.shape[:3] + (32,), q.dtype)
    forward(jnp.concatenate([q, pad], -1), jnp.concatenate([k, pad], -1), v, g, beta)


def test_backward_kernels_refuse_what_they_cannot_take():
  spec = jax.ShapeDtypeStruct
  bf = jnp.bfloat16
  q = spec((1, 64, 1, 128), bf)
  v = spec((1, 64, 1, 256), bf)
  vecs = spec((1, 1, 64), F32)
  # V = 256: the chunk-parallel kernel keeps the whole state of a chunk in shared memory
  with pytest.raises(ValueError, match="V=256"):
    chunk_grads.chunk_grads(
      q, q, v, v, spec((1, 1, 64, 64), bf), *(spec((1, 1, 1, 256, 128), bf),) * 4,
      spec((1, 1, 64), F32), vecs, vecs, spec((1, 1, 1, 1, 64), F32), spec((4,), F32),
    )  # fmt: skip
  # r = 8: the products over a chunk's 8 tokens are below wgmma's 16-deep step
  with pytest.raises(ValueError, match="r=8"):
    backward_walk.state_grad_walk(
      q, q, spec((1, 64, 1, 64), bf), spec((1, 1, 512, 64), bf), spec((1, 1, 64), F32),
      vecs, vecs, spec((1, 1, 1, 8, 64), F32), spec((4,), F32),
    )  # fmt: skip
  # the shared-memory estimate is what the lowering checks against the limit: it must fit
  for r in (1, 2, 4):
    assert chunk_grads.smem_bytes(128, 128, r, bf, staged=False) <= common.SMEM_LIMIT, r
    need = functools.partial(backward_walk.smem_bytes, 128, 64, r, bf, staged=False)
    assert common.ring_stages("state_grad_walk", lambda n: need(stages=n)) >= 2, r
    # with the most bounds of packed rows read in place (pieces.MAX_SLOTS) in shared memory
    for walk in (walk_shapes.smem_bytes, backward_walk.smem_bytes):
      for key_dim in (64, 128):
        need = functools.partial(walk, key_dim, 64, r, bf, staged=False, slots=pieces.MAX_SLOTS)
        assert common.ring_stages("walk", lambda n: need(stages=n)) >= 2, (walk, key_dim, r)


if __name__ == "__main__" and "--interpreted" in sys.argv:
  print("RESULT " + json.dumps(_run_interpreted_cases()))
