"""The forward walk's argument checks and shared memory (`walk_ws.state_walk_ws`,
docs/mosaic_gpu.md#the-walk): the dimensions it reads from its arguments, the bytes of its ring
and tiles, and its scratch buffers."""

from __future__ import annotations

import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp

from pallas_kernels.mosaic_gpu import ring
from pallas_kernels.mosaic_gpu.common import F32, ROWS_PER_CHUNK, chunk_tokens, smem

N = ROWS_PER_CHUNK


def walk_dims(q, k, v, t0, mask_rows, block_v):
  """The walk's argument checks; returns (B, T padded, H, K, V, r, C, chunks, group) with H the
  value heads and `group` value heads per key head (grouped value heads). k and v of rank 5 are
  the Householder form's sub-steps (module docstring); t0 None: formed in the kernel."""
  k_shape, v_shape = k.shape, v.shape
  if k.ndim == 5:  # one sub-step's shapes
    if v.ndim != 5 or k.shape[2] != v.shape[2] or k.shape[2] != mask_rows.shape[-2]:
      raise ValueError(f"k, v: shapes {k.shape}, {v.shape}, expected [B, T, n_h, H, .], n_h = r")
    k_shape, v_shape = k.shape[:2] + k.shape[3:], v.shape[:2] + v.shape[3:]
  batch, padded, key_heads, key_dim = k_shape
  heads, value_dim = v_shape[2], v_shape[-1]
  r = mask_rows.shape[-2]
  c = chunk_tokens(r)
  dtype = k.dtype
  if q.shape != k_shape or q.dtype != dtype or v.dtype != dtype:
    raise ValueError(f"q, k, v: shapes {q.shape}, {k.shape}, {v.shape} / dtypes must agree")
  if v_shape[:2] != (batch, padded) or heads % key_heads:
    raise ValueError(f"v: shape {v.shape}, expected [B, T, H, V] with H a multiple of {key_heads}")
  if padded % c:
    raise ValueError(f"k: length {padded} must be a multiple of the chunk {c} (r={r})")
  if value_dim % block_v:
    raise ValueError(f"v: V={value_dim} must be a multiple of block_v={block_v}")
  nc = padded // c
  if t0 is not None and t0.shape != (batch, heads, nc * N, N):
    raise ValueError(f"t0: shape {t0.shape}, expected {(batch, heads, nc * N, N)}")
  return batch, padded, heads, key_dim, value_dim, r, c, nc, heads // key_heads


def smem_bytes(
  key_dim: int, block_v: int, r: int, dtype, stages: int, staged: bool, slots: int = 0
) -> int:
  """Shared memory of `state_walk_ws` (tiles and vectors; barriers are a few bytes more).

  staged: the interpreter's form, with the chain's left operands staged through `xt_s`.
  slots: the pieces' bounds (packed rows read in place), and their table row.
  """
  c = chunk_tokens(r)
  isz = jnp.dtype(dtype).itemsize
  per_stage = (c * key_dim + (2 if r > 1 else 1) * N * key_dim + N * block_v + N * N) * isz
  per_stage += (5 * N + max(c, 32) + r * N) * 4
  fixed = (2 * block_v * key_dim + 2 * block_v * N + c * N + 2 * c * block_v) * isz
  fixed += 16 + (block_v * N * isz if staged else 0) + (4 * slots + 16 if slots else 0)
  return stages * per_stage + fixed


def walk_scratch(*, stages, c, key_dim, bv, r, dtype, masked_keys, staged, n_copies, warpgroups,
                 packed, marks=False, slots=0) -> dict:  # fmt: skip
  """The shared memory of the warp-specialised walk (`state_walk_ws`): the ring of
  `stages` input stages, the chain's published tiles, the output's tiles and the barriers; with
  `marks` a per-token row per stage (the non-finite guard's marks, `output`); with `slots` (pieces)
  the bounds."""
  vecs = plgpu.SMEM((stages, N), F32)
  scratch = dict(
    q_s=smem((stages, c, key_dim), dtype),
    kb_s=smem((stages, N, key_dim), dtype),  # the keys repeated per block, then Kb (in place)
    vrep_s=smem((stages, N, bv), dtype),
    t_s=smem((stages, N, N), dtype),  # T0, then Ag (in place)
    g_rows=vecs,
    g_cols=vecs,
    g_chain=vecs,  # warpgroup 0's copy: COLS view and the last entry
    g_last=vecs,
    b_cols=vecs,
    # Rows of at least 128 bytes: a TMA destination must be 128-byte aligned (C = 16, 8).
    g_tok=plgpu.SMEM((stages, max(c, 32)), F32),
    m_s=plgpu.SMEM((stages, r, N), F32),
    st_pub=smem((2, bv, key_dim), dtype),
    vn_pub=smem((2, bv, N), dtype),
    pq_s=smem((c, N), dtype),
    o_s=smem((2, c, bv), dtype),
    sc_s=plgpu.SMEM((4,), F32),
    **ring.barriers(stages, n_copies),
    s_ready=plgpu.Barrier(num_barriers=2),
    s_free=plgpu.Barrier(num_barriers=2),
    sc_bar=plgpu.Barrier(num_arrivals=(2 if packed else 1) + (slots > 0)),
    tab_s=plgpu.SMEM((8 if slots else 4,), jnp.int32),
    done=plgpu.Barrier(num_arrivals=warpgroups),
  )
  if slots:
    scratch["bnd_s"] = plgpu.SMEM((slots,), jnp.int32)
  if masked_keys:
    scratch["kw_s"] = smem((stages, N, key_dim), dtype)
  if staged:
    scratch["xt_s"] = smem((bv, N), dtype)
  if marks:
    scratch["mk_tok"] = plgpu.SMEM((stages, max(c, 32)), F32)
  return scratch
