"""The state walk and output kernel of the forward: one program per (batch, head, value tile).

Carries the float32 state transposed, `S^T [BV, K]`, in registers over the chunks. Per chunk of
`C` tokens with block-major rows `(a, t)` (`N = C r = 64`, see `common.py`) and `gamma` the
chunk-local cumulative log-decay (docs/chunked_form.md#gamma):

  Ag[(a,t),(d,s)] = T0[(a,t),(d,s)] exp(gamma_t - gamma_s) beta_s   (t >= s; T0: chunk_inverse)
  X^T    = Vrep^T - (S^T Kw^T) diag(exp(gamma))                        [BV, N]
  v_new^T = X^T Ag^T                                                   [BV, N]
  o^T    = scale ((S^T q^T) diag(exp(gamma)) + v_new^T (Kb q^T ⊙ D))   [BV, C], D causal incl.
  S^T   <- exp(gamma_L) S^T + (v_new^T diag(exp(gamma_L - gamma))) Kb  [BV, K]

with `Vrep` the value rows repeated per block, `Kw` the masked keys (row `(a,t)` is
`[M_t[a,d] k_t^(d)]_d`) and `Kb` the block keys (row `(a,t)` is `k_t^(a)` in block `a`'s
columns, zeros elsewhere), as in docs/chunked_form.md#the-chunk-matrix-a. Since
`(I + A)^-1 = E T0 E^-1` (E = diag(exp(gamma)), docs/chunked_form.md#one-inverse-for-w-and-u),
`v_new = u - w S0 = (T0 ⊙ decay) diag(beta) (Vrep - E Kw S0)`: w and u are never formed.

This is the plain form: one warpgroup, operands staged through shared memory, no overlap between
the chunk's loads and its products. It runs in the Mosaic GPU interpreter; the warp-specialised
form (a TMA producer warpgroup and consumer warpgroups) is the next step.
"""

from __future__ import annotations

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels.mosaic_gpu.common import (
  COLS,
  F32,
  ROWS,
  ROWS_PER_CHUNK,
  WGMMA,
  bcast_cols,
  bcast_rows,
  check_smem,
  chunk_tokens,
  compiler_params,
  iota,
  mask_matrix,
  matmul,
  smem,
  token_of,
)

N = ROWS_PER_CHUNK


def walk_dims(q, k, v, t0, mask_rows, block_v):
  """The walks' argument checks; returns (B, T padded, H, K, V, r, C, chunks)."""
  batch, padded, heads, key_dim = k.shape
  value_dim = v.shape[-1]
  r = mask_rows.shape[-2]
  c = chunk_tokens(r)
  dtype = k.dtype
  if q.shape != k.shape or q.dtype != dtype or v.dtype != dtype:
    raise ValueError(f"q, k, v: shapes {q.shape}, {k.shape}, {v.shape} / dtypes must agree")
  if padded % c:
    raise ValueError(f"k: length {padded} must be a multiple of the chunk {c} (r={r})")
  if value_dim % block_v:
    raise ValueError(f"v: V={value_dim} must be a multiple of block_v={block_v}")
  nc = padded // c
  if t0.shape != (batch, heads, nc * N, N):
    raise ValueError(f"t0: shape {t0.shape}, expected {(batch, heads, nc * N, N)}")
  return batch, padded, heads, key_dim, value_dim, r, c, nc


def state_walk(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  t0: jax.Array,
  gamma: jax.Array,
  gamma_rows: jax.Array,
  beta_rows: jax.Array,
  mask_rows: jax.Array,
  scale: jax.Array,
  initial_state_t: jax.Array | None = None,
  *,
  block_v: int = 64,
  output_final_state: bool = False,
  interpret=None,
):
  """The output `o [B, Tp, H, V]` (dtype of q) and, if asked, the final state `[B, H, V, K]`.

  Args:
    q, k: `[B, Tp, H, K]`; v: `[B, Tp, H, V]`; one 16-bit dtype. `Tp` a multiple of `C = 64 // r`.
    t0: `[B, H, NC * 64, 64]` from `chunk_inverse`.
    gamma: `[B, H, Tp]` float32 chunk-local inclusive cumulative sums of the log-decay.
    gamma_rows, beta_rows: `[B, H, NC * 64]` float32, gamma and beta per block-major row `(a, t)`
      of each chunk (`forward.block_rows`; whole rows keep TMA destinations 128-byte aligned).
    mask_rows: `[Bm, Hm, NCm, r, 64]` float32, as for `chunk_inverse`.
    scale: `[4]` float32, the output scale in entry 0 (may be traced).
    initial_state_t: None (zeros) or `[B, H, V, K]` float32, the initial state transposed.
    block_v: value columns per program (64 or V).
    output_final_state: also return the final state, transposed `[B, H, V, K]` float32.
  """
  batch, padded, heads, key_dim, value_dim, r, c, nc = walk_dims(q, k, v, t0, mask_rows, block_v)
  dtype = k.dtype
  m_b, m_h, m_n = mask_rows.shape[:3]
  has_h0 = initial_state_t is not None
  keep_state = has_h0 or output_final_state
  bv = block_v
  dk = key_dim // r
  isz = jnp.dtype(dtype).itemsize
  check_smem(
    "state_walk",
    (c * key_dim + 3 * N * key_dim + N * bv + 2 * N * N + bv * key_dim + 3 * bv * N) * isz
    + (N * c + c * bv) * isz
    + (bv * key_dim * 4 if keep_state else 0)
    + (4 * N + c + r * N + 4) * 4,
  )

  vec = plgpu.SMEM((N,), F32)
  scratch = dict(
    q_s=smem((c, key_dim), dtype),
    krep_s=smem((N, key_dim), dtype),
    kb_s=smem((N, key_dim), dtype),
    kw_s=smem((N, key_dim), dtype),
    vrep_s=smem((N, bv), dtype),
    t_s=smem((N, N), dtype),
    ag_s=smem((N, N), dtype),
    st_lo_s=smem((bv, key_dim), dtype),
    xt_s=smem((bv, N), dtype),
    vnt_s=smem((bv, N), dtype),
    vdt_s=smem((bv, N), dtype),
    pq_s=smem((c, N), dtype),  # (Kb q^T ⊙ D)^T: minor dimension N for the swizzle
    o_s=smem((c, bv), dtype),
    g_rows=vec,  # gamma per row (a, t), ROWS view
    g_cols=vec,  # gamma per column (d, s), COLS view
    g_last=vec,  # gamma, read as scalars
    b_cols=vec,  # beta per column (d, s), COLS view
    g_tok=plgpu.SMEM((c,), F32),  # gamma per token t (columns of o^T), COLS view
    m_s=plgpu.SMEM((r, N), F32),
    sc_s=plgpu.SMEM((4,), F32),
    bar=plgpu.Barrier(num_arrivals=8 + 2 * r),
    once=plgpu.Barrier(num_arrivals=1 + has_h0),
  )
  if keep_state:
    scratch["st_s"] = plgpu.SMEM((bv, key_dim), F32)

  out_type = [jax.ShapeDtypeStruct((batch, padded, heads, value_dim), dtype)]
  if output_final_state:
    out_type.append(jax.ShapeDtypeStruct((batch, heads, value_dim, key_dim), F32))

  def body(
    *refs,
    q_s,
    krep_s,
    kb_s,
    kw_s,
    vrep_s,
    t_s,
    ag_s,
    st_lo_s,
    xt_s,
    vnt_s,
    vdt_s,
    pq_s,
    o_s,
    g_rows,
    g_cols,
    g_last,
    b_cols,
    g_tok,
    m_s,
    sc_s,
    bar,
    once,
    st_s=None,
  ):
    refs = list(refs)
    q_ref, k_ref, v_ref, t0_ref, g_ref = (refs.pop(0) for _ in range(5))
    gr_ref, beta_ref, m_ref, sc_ref = (refs.pop(0) for _ in range(4))
    h0_ref = refs.pop(0) if has_h0 else None
    o_ref = refs.pop(0)
    ht_ref = refs.pop(0) if output_final_state else None
    b, h, iv = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("v")
    cols_v = pl.ds(iv * bv, bv)
    mb = b if m_b > 1 else 0
    mh = h if m_h > 1 else 0

    plgpu.copy_gmem_to_smem(sc_ref, sc_s, once)
    if has_h0:
      plgpu.copy_gmem_to_smem(h0_ref.at[b, h, cols_v], st_s, once)
    plgpu.barrier_wait(once)
    scale_v = sc_s[0]
    if has_h0:
      s0 = plgpu.load(st_s, layout=WGMMA)
    else:
      s0 = plgpu.layout_cast(jnp.zeros((bv, key_dim), F32), WGMMA)

    sq = (N, N)
    tok_r, tok_c = token_of(iota(sq, 0), c), token_of(iota(sq, 1), c)
    kshape = (N, key_dim)
    own = lax.div(iota(kshape, 1), dk) == lax.div(iota(kshape, 0), c)
    pshape = (N, c)
    causal_pq = token_of(iota(pshape, 0), c) <= iota(pshape, 1)  # row (a, s), column t: s <= t

    def step(n, s_t):
      rows = pl.ds(n * c, c)
      mn = n if m_n > 1 else 0
      plgpu.copy_gmem_to_smem(q_ref.at[b, rows, h], q_s, bar)
      plgpu.copy_gmem_to_smem(t0_ref.at[b, h, pl.ds(n * N, N)], t_s, bar)
      plgpu.copy_gmem_to_smem(g_ref.at[b, h, rows], g_tok, bar)
      plgpu.copy_gmem_to_smem(m_ref.at[mb, mh, mn], m_s, bar)
      chunk_rows = pl.ds(n * N, N)
      for dst in (g_rows, g_cols, g_last):
        plgpu.copy_gmem_to_smem(gr_ref.at[b, h, chunk_rows], dst, bar)
      plgpu.copy_gmem_to_smem(beta_ref.at[b, h, chunk_rows], b_cols, bar)
      for a in range(r):  # tiles: C-row pieces stay 1024-byte aligned for every r
        part = pl.ds(a * c, c)
        plgpu.copy_gmem_to_smem(k_ref.at[b, rows, h], krep_s.at[part], bar)
        plgpu.copy_gmem_to_smem(v_ref.at[b, rows, h, cols_v], vrep_s.at[part], bar)
      plgpu.barrier_wait(bar)

      # Block keys Kb and masked keys Kw.
      kfull = plgpu.load(krep_s, layout=WGMMA).astype(F32)
      kw_s[...] = (kfull * mask_matrix(m_s, kshape, dk, r)).astype(dtype)
      if r > 1:
        kb_s[...] = jnp.where(own, kfull, 0.0).astype(dtype)
      kb = krep_s if r == 1 else kb_s
      # The gated inverse times beta per column.
      g_r = plgpu.load(g_rows, layout=ROWS)
      g_c = plgpu.load(g_cols, layout=COLS)
      decay = jnp.exp(
        jnp.where(tok_r >= tok_c, bcast_rows(g_r, sq) - bcast_cols(g_c, sq), -jnp.inf)
      )
      beta_c = bcast_cols(plgpu.load(b_cols, layout=COLS), sq)
      ag_s[...] = (plgpu.load(t_s, layout=WGMMA).astype(F32) * decay * beta_c).astype(dtype)
      st_lo_s[...] = s_t.astype(dtype)
      plgpu.commit_smem()

      # The chain: X^T, v_new^T, the state update.
      wshape = (bv, N)
      g_last_v = g_last[N - 1]
      gc_w = plgpu.load(g_cols, layout=COLS)
      pw = matmul(st_lo_s, kw_s.T, wshape)
      v_t = plgpu.load(vrep_s.T, layout=WGMMA).astype(F32)
      xt_s[...] = (v_t - pw * bcast_cols(jnp.exp(gc_w), wshape)).astype(dtype)
      plgpu.commit_smem()
      vn_t = matmul(xt_s, ag_s.T, wshape)
      vnt_s[...] = vn_t.astype(dtype)
      vdt_s[...] = (vn_t * bcast_cols(jnp.exp(g_last_v - gc_w), wshape)).astype(dtype)
      plgpu.commit_smem()
      s_new = jnp.exp(g_last_v) * s_t + matmul(vdt_s, kb, (bv, key_dim))

      # The output, transposed: o^T [BV, C].
      g_t = plgpu.load(g_tok, layout=COLS)
      g_pr = plgpu.load(g_rows, layout=ROWS)
      pq = matmul(kb, q_s.T, pshape)
      d_pq = jnp.exp(
        jnp.where(causal_pq, bcast_cols(g_t, pshape) - bcast_rows(g_pr, pshape), -jnp.inf)
      )
      pq_s.T[...] = (pq * d_pq).astype(dtype)
      plgpu.commit_smem()
      oshape = (bv, c)
      o_t = matmul(st_lo_s, q_s.T, oshape) * bcast_cols(jnp.exp(g_t), oshape)
      o_t = o_t + matmul(vnt_s, pq_s.T, oshape)
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous chunk's o left o_s
      o_s.T[...] = (o_t * scale_v).astype(dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(o_s, o_ref.at[b, rows, h, cols_v])
      return s_new

    s_t = lax.fori_loop(0, nc, step, s0)
    if output_final_state:
      st_s[...] = s_t
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(st_s, ht_ref.at[b, h, cols_v])
    plgpu.wait_smem_to_gmem(0)

  args = [q, k, v, t0, gamma, gamma_rows, beta_rows, mask_rows, scale]
  if initial_state_t is not None:
    args.append(initial_state_t)
  outs = plgpu.kernel(
    body,
    out_type=out_type,
    scratch_types=scratch,
    grid=(batch, heads, value_dim // bv),
    grid_names=("b", "h", "v"),
    compiler_params=compiler_params(),
    interpret=interpret,
    kernel_name=f"gdp_state_walk_r{r}",
  )(*args)
  if output_final_state:
    return outs[0], outs[1]
  return outs[0], None
