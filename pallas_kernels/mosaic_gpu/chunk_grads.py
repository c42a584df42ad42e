"""The chunk-parallel kernel of the backward: every input gradient of one chunk, given the states
the forward walk stored and the state gradients the reverse walk stored
(docs/mosaic_gpu.md#the-chunk-parallel-gradients has the math).

One program per (batch, head, chunk), one warpgroup, every operand loaded once with TMA and all
products on the tensor cores: dq, dk (from the block keys' and the masked keys' gradients), dv,
the mask's gradient and the per-row parts of the gates' and beta's gradients, which the caller
sums per token (docs/chunked_form.md#the-backward). Products with a chunk's C tokens as rows are
formed transposed, the token sums over key blocks as products with a 0/1 matrix.
"""

from __future__ import annotations

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels.mosaic_gpu.common import (
  BACKWARD_R,
  COLS,
  F32,
  ROWS,
  ROWS_PER_CHUNK,
  SUPPORTED_DIMS,
  WGMMA,
  bcast_cols,
  bcast_rows,
  check_smem,
  chunk_decay,
  chunk_tokens,
  compiler_params,
  iota,
  mask_matrix,
  matmul,
  matmul_reg,
  matmul_sum,
  own_block,
  smem,
  token_of,
)

N = ROWS_PER_CHUNK
SUPPORTED_R = BACKWARD_R
VECTOR_ROWS = 6  # rows of the per-chunk vectors before the mask's r (see `chunk_grads`)


def smem_bytes(key_dim: int, value_dim: int, r: int, dtype, staged: bool) -> int:
  """Shared memory of `chunk_grads` (tiles and vectors; barriers are a few bytes more)."""
  c = chunk_tokens(r)
  isz = jnp.dtype(dtype).itemsize
  tiles = c * key_dim + c * value_dim  # q, do
  tiles += N * key_dim * (2 if r == 1 else 3)  # keys, Kw (and Kb)
  tiles += 2 * N * value_dim  # Vrep (then X), dX (r > 1: sharing the keys' tile)
  tiles += 2 * N * N  # T0, Ag (then dT0, Y and G)
  tiles += 2 * value_dim * key_dim + 2 * value_dim * N  # S^T, dh^T, v_new^T, dv_new^T
  if r > 1:
    tiles += N * c + c * value_dim - N * value_dim  # R, dv; dX in the keys' tile
  if staged:  # no limit: the shared tiles apart, and the staging tile
    tiles += N * value_dim + N * c + c * key_dim + max(key_dim, value_dim) * N
  vectors = (VECTOR_ROWS + r) * N + 5 * N + max(c, 32) + r * N + 4
  return tiles * isz + vectors * 4 + 64


def chunk_grads(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  do: jax.Array,
  t0: jax.Array,
  states_t: jax.Array,
  vnew_t: jax.Array,
  dh_t: jax.Array,
  dvnew_t: jax.Array,
  gamma: jax.Array,
  gamma_rows: jax.Array,
  beta_rows: jax.Array,
  mask_rows: jax.Array,
  scale: jax.Array,
  *,
  interpret=None,
):
  """The chunk-parallel gradients (module docstring).

  Args:
    q, k: `[B, Tp, Hk, K]`; v, do: `[B, Tp, H, V]` (H a multiple of Hk: grouped value heads);
      `Tp` a multiple of the chunk `C = 64 // r`.
    t0: `[B, H, NC * N, N]` (`chunk_inverse`); states_t, dh_t: `[B, H, NC, V, K]`, the state at
      each chunk's start and the gradient of the state at its end, transposed; vnew_t, dvnew_t:
      `[B, H, NC, V, N]`, v_new and its gradient transposed (block-major columns).
    gamma, gamma_rows, beta_rows, mask_rows, scale: as the forward walk takes them
      (`walk_ws.state_walk_ws`).

  Returns:
    `dq, dk [B, Tp, H, K]` (per value head, in q's dtype), `dv [B, Tp, H, V]` and the per-chunk
    vectors `[B, H, NC, 6 + r, N]` float32: rows 0-1 the gates' gradient per block-major row
    (as rows and as columns of the chunk matrices), 2-3 beta's likewise, 4 the gates' gradient
    per token (first C entries), 5 the gradient of the chunk's last gamma (every entry), 6 + d the
    mask gradient `dM_t[a, d]` at row `(a, t)`.
  """
  batch, padded, key_heads, key_dim = k.shape
  heads, value_dim = v.shape[2], v.shape[-1]
  r = mask_rows.shape[-2]
  if r not in SUPPORTED_R:
    raise ValueError(f"mask size r={r}: chunk_grads supports r in {SUPPORTED_R}")
  if key_dim not in SUPPORTED_DIMS or value_dim not in SUPPORTED_DIMS:
    raise ValueError(f"K={key_dim}, V={value_dim}: chunk_grads takes each in {SUPPORTED_DIMS}")
  c = chunk_tokens(r)
  nc = padded // c
  dtype = k.dtype
  if padded % c or q.shape != k.shape or do.shape != v.shape or v.shape[:2] != (batch, padded):
    raise ValueError(f"q, k, v, do: shapes {q.shape}, {k.shape}, {v.shape}, {do.shape}")
  if heads % key_heads:
    raise ValueError(f"v: {heads} heads, expected a multiple of the {key_heads} key heads")
  for name, x, shape in (
    ("t0", t0, (batch, heads, nc * N, N)),
    ("states_t", states_t, (batch, heads, nc, value_dim, key_dim)),
    ("dh_t", dh_t, (batch, heads, nc, value_dim, key_dim)),
    ("vnew_t", vnew_t, (batch, heads, nc, value_dim, N)),
    ("dvnew_t", dvnew_t, (batch, heads, nc, value_dim, N)),
  ):
    if x.shape != shape:
      raise ValueError(f"{name}: shape {x.shape}, expected {shape}")
  group = heads // key_heads
  m_b, m_h, m_n = mask_rows.shape[:3]
  staged = interpret is not None
  dk = key_dim // r
  check_smem("chunk_grads", smem_bytes(key_dim, value_dim, r, dtype, staged))
  n_vec = VECTOR_ROWS + r
  # tiles a product contracts over their C tokens (major dimension): a k group of C at most
  tok_swizzle = min(128, c * jnp.dtype(dtype).itemsize)

  scratch = dict(
    q_s=smem((c, key_dim), dtype, tok_swizzle),  # q, at the end dq
    do_s=smem((c, value_dim), dtype),
    kw_s=smem((N, key_dim), dtype),  # Kw, at the end dk (r = 1) or the summed dk rows
    nn_s=smem((N, N), dtype),  # Ag, then dT0, Y and G in turn
    st_s=smem((value_dim, key_dim), dtype),
    dht_s=smem((value_dim, key_dim), dtype),
    vnt_s=smem((value_dim, N), dtype),
    g_tok=plgpu.SMEM((max(c, 32),), F32),
    # one buffer per layout a vector is read in (one ref read in two layouts defeats the
    # lowering's layout inference)
    g_rows=plgpu.SMEM((N,), F32),
    g_cols=plgpu.SMEM((N,), F32),
    g_last=plgpu.SMEM((N,), F32),
    b_rows=plgpu.SMEM((N,), F32),
    b_cols=plgpu.SMEM((N,), F32),
    m_s=plgpu.SMEM((r, N), F32),
    sc_s=plgpu.SMEM((4,), F32),
    vec_s=plgpu.SMEM((n_vec, N), F32),
    bar_keys=plgpu.Barrier(num_arrivals=r + 7),
    bar_states=plgpu.Barrier(num_arrivals=r + 2),
    bar_scores=plgpu.Barrier(num_arrivals=6),
  )

  xshape = (N, value_dim)

  def shared(*refs):
    """Tiles with disjoint lifetimes in one piece of shared memory (in the interpreter, which
    has no limit, apart)."""
    return refs if staged else plgpu.RefUnion(*refs)

  # Tiles that share memory, by lifetime: the keys repeated per block (r = 1: also Kb; r > 1:
  # read once for Kb and Kw) | dX (r = 1: also dv); dv_new^T | the scores' gradient
  # (scale do v_new^T ⊙ D)^T and dk (r > 1); the values repeated per block, then X | the
  # scores' gradient (r = 1).
  krep, dx, vrep = (smem((N, key_dim), dtype), smem((N, value_dim), dtype), smem(xshape, dtype))
  dvnt, dpdt = smem((value_dim, N), dtype), smem((N, c), dtype)
  if r == 1:
    scratch.update(keys_dx=(krep, dx), dvnt_scores=(dvnt,), x_scores=shared(vrep, dpdt))
  else:
    dk_tile = smem((c, key_dim), dtype)
    scratch.update(
      keys_dx=shared(krep, dx), dvnt_scores=shared(dvnt, (dpdt, dk_tile)), x_scores=(vrep,)
    )
    scratch["kb_s"] = smem((N, key_dim), dtype)
    scratch["r_s"] = smem((N, c), dtype)
    scratch["dv_s"] = smem((c, value_dim), dtype)
  scratch["t0_s"] = smem((N, N), dtype)
  if staged:  # the interpreter stages register left operands through shared memory
    scratch["stage_s"] = smem((max(key_dim, value_dim), N), dtype)

  out_type = [
    jax.ShapeDtypeStruct((batch, padded, heads, key_dim), dtype),
    jax.ShapeDtypeStruct((batch, padded, heads, key_dim), dtype),
    jax.ShapeDtypeStruct((batch, padded, heads, value_dim), dtype),
    jax.ShapeDtypeStruct((batch, heads, nc, n_vec, N), F32),
  ]

  def body(q_ref, k_ref, v_ref, do_ref, t0_ref, st_ref, vn_ref, dh_ref, dvn_ref, g_ref, gr_ref,
           br_ref, m_ref, sc_ref, dq_ref, dk_ref, dv_ref, vec_ref, *, q_s, do_s, kw_s, nn_s, st_s,
           dht_s, vnt_s, g_tok, g_rows, g_cols, g_last, b_rows, b_cols, m_s, sc_s, vec_s, bar_keys,
           bar_states, bar_scores,
           keys_dx, dvnt_scores, x_scores, t0_s, kb_s=None, r_s=None, dv_s=None,
           stage_s=None):  # fmt: skip
    krep_s, dx_s = keys_dx
    if r == 1:
      (dvnt_s,), (vrep_s, dpdt_s) = dvnt_scores, x_scores
      dk_s = None
    else:
      (dvnt_s, (dpdt_s, dk_s)), (vrep_s,) = dvnt_scores, x_scores
    b, h, n = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("n")
    hk = lax.div(h, group)
    rows = pl.ds(n * c, c)
    chunk_rows = pl.ds(n * N, N)
    mb = b if m_b > 1 else 0
    mh = h if m_h > 1 else 0
    mn = n if m_n > 1 else 0
    # Three groups of loads, in the order the products need them, so that the first products
    # run while the states still arrive.
    for a in range(r):  # C-row pieces stay 1024-byte aligned for every r
      part = pl.ds(a * c, c)
      plgpu.copy_gmem_to_smem(k_ref.at[b, rows, hk], krep_s.at[part], bar_keys)
    plgpu.copy_gmem_to_smem(t0_ref.at[b, h, chunk_rows], t0_s, bar_keys)
    for dst in (g_rows, g_cols, g_last):
      plgpu.copy_gmem_to_smem(gr_ref.at[b, h, chunk_rows], dst, bar_keys)
    for dst in (b_rows, b_cols):
      plgpu.copy_gmem_to_smem(br_ref.at[b, h, chunk_rows], dst, bar_keys)
    plgpu.copy_gmem_to_smem(m_ref.at[mb, mh, mn], m_s, bar_keys)
    for a in range(r):
      plgpu.copy_gmem_to_smem(v_ref.at[b, rows, h], vrep_s.at[pl.ds(a * c, c)], bar_states)
    plgpu.copy_gmem_to_smem(st_ref.at[b, h, n], st_s, bar_states)
    plgpu.copy_gmem_to_smem(dvn_ref.at[b, h, n], dvnt_s, bar_states)
    plgpu.copy_gmem_to_smem(q_ref.at[b, rows, hk], q_s, bar_scores)
    plgpu.copy_gmem_to_smem(do_ref.at[b, rows, h], do_s, bar_scores)
    plgpu.copy_gmem_to_smem(dh_ref.at[b, h, n], dht_s, bar_scores)
    plgpu.copy_gmem_to_smem(vn_ref.at[b, h, n], vnt_s, bar_scores)
    plgpu.copy_gmem_to_smem(g_ref.at[b, h, rows], g_tok.at[pl.ds(0, c)], bar_scores)
    plgpu.copy_gmem_to_smem(sc_ref, sc_s, bar_scores)
    if r > 1:  # R[(a, t), s] = [t == s]: sums over key blocks as products
      rshape = (N, c)
      r_s[...] = jnp.where(token_of(iota(rshape, 0), c) == iota(rshape, 1), 1.0, 0.0).astype(dtype)
    plgpu.barrier_wait(bar_keys)
    g_end = g_last[N - 1]

    def rows_vec(ref):
      return plgpu.load(ref, layout=ROWS)

    def cols_vec(ref):
      return plgpu.load(ref, layout=COLS)

    sq = (N, N)
    kshape = (N, key_dim)
    tok_r, tok_c = token_of(iota(sq, 0), c), token_of(iota(sq, 1), c)
    g_r, g_c, b_c = rows_vec(g_rows), cols_vec(g_cols), cols_vec(b_cols)

    # The keys: Kw and Kb (r = 1: the mask is one number per row).
    kfull = plgpu.load(krep_s, layout=WGMMA).astype(F32)
    own = own_block(kshape, dk, c)
    if r == 1:
      m_rows = rows_vec(m_s.at[0])
      mmat = bcast_rows(m_rows, kshape)
      kb_ref = krep_s
    else:
      mmat = mask_matrix(m_s, kshape, dk, r)
      kb_s[...] = jnp.where(own, kfull, 0.0).astype(dtype)
      kb_ref = kb_s
    kw_s[...] = (kfull * mmat).astype(dtype)
    # Ag = T0 ⊙ Dec ⊙ beta_s
    decay = chunk_decay(g_r, g_c, c)
    nn_s[...] = (plgpu.load(t0_s, layout=WGMMA).astype(F32) * decay * bcast_cols(b_c, sq)).astype(
      dtype
    )
    plgpu.commit_smem()

    # X = Vrep - E Kw S, in place of Vrep.
    plgpu.barrier_wait(bar_states)
    ks = matmul(kw_s, st_s.T, xshape)
    x = plgpu.load(vrep_s, layout=WGMMA).astype(F32) - ks * bcast_rows(jnp.exp(g_r), xshape)
    vrep_s[...] = x.astype(dtype)
    # dX^T = dv_new^T Ag; dv = sum over blocks of dX.
    dxt = matmul(dvnt_s, nn_s, (value_dim, N))
    dxt_lo = dxt.astype(dtype)
    dx_s.T[...] = dxt_lo
    if r > 1:
      stage = stage_s.at[pl.ds(0, value_dim)] if staged else None
      dvt = matmul_reg(dxt_lo, r_s, (value_dim, c), stage=stage)
      dv_s.T[...] = dvt.astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(dx_s if r == 1 else dv_s, dv_ref.at[b, rows, h])

    # dAg = dv_new X^T -> the gates' and beta's parts through Ag, and dT0.
    dag = matmul(dvnt_s.T, vrep_s.T, sq)
    t0v = plgpu.load(t0_s, layout=WGMMA).astype(F32)
    t0_dec = t0v * decay
    w_ag = dag * t0_dec * bcast_cols(b_c, sq)  # dAg ⊙ Ag
    dg_rows = jnp.sum(w_ag, axis=1)
    dg_cols = -jnp.sum(w_ag, axis=0)
    u = dag * t0_dec
    db_cols = jnp.sum(u, axis=0)
    nn_s[...] = (dag * decay * bcast_cols(b_c, sq)).astype(dtype)  # dT0
    plgpu.commit_smem()
    # dA0 = -(T0^T dT0 T0^T) ⊙ L, then G = diag(beta) dA0.
    y = matmul(t0_s.T, nn_s, sq)
    nn_s[...] = y.astype(dtype)
    plgpu.commit_smem()
    f = -matmul(nn_s, t0_s.T, sq)
    f = jnp.where(tok_r > tok_c, f, 0.0)
    kk = matmul(kw_s, kb_ref.T, sq)
    db_rows = jnp.sum(f * kk, axis=1)
    nn_s[...] = (f * bcast_rows(rows_vec(b_rows), sq)).astype(dtype)  # G

    # The intra-chunk scores, transposed: P^T = Kb q^T ⊙ D^T, and their gradient.
    plgpu.barrier_wait(bar_scores)
    scale_v = sc_s[0]
    pshape = (N, c)
    g_t = cols_vec(g_tok.at[pl.ds(0, c)])
    causal = token_of(iota(pshape, 0), c) <= iota(pshape, 1)
    dmat = jnp.exp(jnp.where(causal, bcast_cols(g_t, pshape) - bcast_rows(g_r, pshape), -jnp.inf))
    if r == 1:
      pt = matmul(krep_s, q_s.T, pshape)
    else:  # Kb from registers: q's tile has a smaller swizzle than Kb's (wgmma wants one)
      kb_lo = plgpu.load(kb_s, layout=WGMMA)
      pt = matmul_reg(kb_lo, q_s.T, pshape, stage=kb_s if staged else None)
    dpt = matmul(vnt_s.T, do_s.T, pshape) * scale_v  # scale v_new do^T
    w_p = dpt * pt * dmat
    dg_rows = dg_rows - jnp.sum(w_p, axis=1)
    dg_tok = jnp.sum(w_p, axis=0)
    dpdt_s[...] = (dpt * dmat).astype(dtype)
    plgpu.commit_smem()

    # dKb = G^T Kw + (scale do v_new^T ⊙ D)^T q + diag(exp(gamma_L - gamma)) v_new dS'^T
    stage_k = stage_s.at[pl.ds(0, key_dim)] if staged else None
    kb32 = plgpu.load(kb_ref, layout=WGMMA).astype(F32)
    vds = matmul(vnt_s.T, dht_s, kshape) * bcast_rows(jnp.exp(g_end - g_r), kshape)
    z = jnp.sum(vds * kb32, axis=1)
    dg_rows = dg_rows - z
    dg_last = jnp.sum(z)
    dkb = matmul_sum(vds, ((nn_s.T, kw_s), (dpdt_s, q_s)), kshape, stage=stage_k)
    # dKw = G Kb - E dX S^T
    dkw_x = matmul(dx_s, st_s, kshape) * bcast_rows(-jnp.exp(g_r), kshape)
    dg_rows = dg_rows + jnp.sum(dkw_x * plgpu.load(kw_s, layout=WGMMA).astype(F32), axis=1)
    dkw = matmul_sum(dkw_x, ((nn_s, kb_ref),), kshape, stage=stage_k)
    if r == 1:
      dm_rows = [jnp.sum(dkw * plgpu.load(krep_s, layout=WGMMA).astype(F32), axis=1)]
    else:  # the keys repeated per block again (their tile holds dX now): [tok_i == tok_j] Kb
      rep = jnp.where(tok_r == tok_c, 1.0, 0.0).astype(dtype)
      dm = dkw * matmul_reg(rep, kb_s, kshape, stage=nn_s if staged else None)
      col_block = lax.div(iota(kshape, 1), dk)
      dm_rows = [jnp.sum(jnp.where(col_block == d, dm, 0.0), axis=1) for d in range(r)]
    dktot = jnp.where(own, dkb, 0.0) + mmat * dkw
    kw_s[...] = dktot.astype(dtype)
    plgpu.commit_smem()
    if r > 1:  # dk^T = dKtot^T R
      dkt_lo = plgpu.load(kw_s.T, layout=WGMMA)
      stage = stage_s.at[pl.ds(0, key_dim)] if staged else None
      dk_s.T[...] = matmul_reg(dkt_lo, r_s, (key_dim, c), stage=stage).astype(dtype)
      plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(kw_s if r == 1 else dk_s, dk_ref.at[b, rows, h])

    # dq^T = scale S do^T E + Kb^T (scale do v_new^T ⊙ D)^T, in place of q.
    qshape = (key_dim, c)
    dqs = matmul(st_s.T, do_s.T, qshape) * bcast_cols(scale_v * jnp.exp(g_t), qshape)
    qt = plgpu.load(q_s.T, layout=WGMMA).astype(F32)
    dg_tok = dg_tok + jnp.sum(dqs * qt, axis=0)
    kbt_lo = plgpu.load(kb_ref.T, layout=WGMMA)
    dqt = matmul_sum(dqs, ((kbt_lo, dpdt_s),), qshape, stage=stage_k)
    q_s.T[...] = dqt.astype(dtype)
    # The state's own decay: exp(gamma_L) <S, dS'>.
    s_v = plgpu.load(st_s, layout=WGMMA).astype(F32)
    ds_v = plgpu.load(dht_s, layout=WGMMA).astype(F32)
    dg_last = dg_last + jnp.exp(g_end) * jnp.sum(jnp.sum(s_v * ds_v, axis=1))

    vec_s.at[0][...] = dg_rows
    vec_s.at[1][...] = dg_cols
    vec_s.at[2][...] = db_rows
    vec_s.at[3][...] = db_cols
    vec_s.at[4].at[pl.ds(0, c)][...] = dg_tok
    first = plgpu.broadcasted_iota(jnp.int32, (N,), 0, layout=ROWS) == 0
    vec_s.at[5][...] = jnp.where(first, dg_last, 0.0)
    for d, dm_d in enumerate(dm_rows):
      vec_s.at[VECTOR_ROWS + d][...] = dm_d
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_s, dq_ref.at[b, rows, h])
    plgpu.copy_smem_to_gmem(vec_s, vec_ref.at[b, h, n])
    plgpu.wait_smem_to_gmem(0)

  args = (q, k, v, do, t0, states_t, vnew_t, dh_t, dvnew_t, gamma, gamma_rows, beta_rows)
  return plgpu.kernel(
    body,
    out_type=out_type,
    scratch_types=scratch,
    grid=(batch, heads, nc),
    grid_names=("b", "h", "n"),
    compiler_params=compiler_params(),
    interpret=interpret,
    kernel_name=f"gdp_chunk_grads_r{r}",
  )(*args, mask_rows, scale)
