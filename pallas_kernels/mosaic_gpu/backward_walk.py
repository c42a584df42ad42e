"""The reverse state walk of the backward: one warp-specialised program per (batch, head, value
tile), the forward walk (`walk_ws.py`) mirrored (docs/mosaic_gpu.md#the-reverse-walk has the math).

Carries `dS^T [BV, K]` float32 in registers from the last chunk to the first (from d
final_state) and stores per chunk dh^T (the gradient of the state at the chunk's end) and
dv_new^T, which the chunk-parallel kernel (`chunk_grads.py`) takes; the `dS^T` left at the end is
d initial_state. Three warpgroups: the producer streams the chunks, last first, through the TMA
ring (`ring.py`); warpgroup 1 prepares each stage off the chain (`Kb`, `Kw`, `Ag`, the
intra-chunk term, `scale E q`); warpgroup 0 runs the chain's three dependent products. r in 1,
2, 4: the products over a chunk's tokens need `C >= 16`.
"""

from __future__ import annotations

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels.mosaic_gpu import ring
from pallas_kernels.mosaic_gpu.common import (
  BACKWARD_R,
  COLS,
  F32,
  ROWS,
  ROWS_PER_CHUNK,
  WGMMA,
  bcast_cols,
  bcast_rows,
  check_seq_table,
  chunk_tokens,
  compiler_params,
  copy_tiles,
  gate_stage,
  iota,
  matmul,
  matmul_reg,
  matmul_sum,
  read_seq_table,
  ring_stages,
  smem,
  token_of,
)

N = ROWS_PER_CHUNK
SUPPORTED_R = BACKWARD_R


def smem_bytes(
  key_dim: int, block_v: int, r: int, dtype, stages: int, staged: bool, slots: int = 0
) -> int:
  """Shared memory of `state_grad_walk` (tiles and vectors; barriers are a few bytes more);
  `slots`: the pieces' bounds (packed rows read in place) and their table row."""
  c = chunk_tokens(r)
  isz = jnp.dtype(dtype).itemsize
  per_stage = (c * key_dim + (2 if r > 1 else 1) * N * key_dim + c * block_v + N * N) * isz
  per_stage += block_v * N * isz  # dv_local
  per_stage += (5 * N + max(c, 32) + r * N) * 4
  fixed = (2 * block_v * key_dim + 2 * N * block_v) * isz
  fixed += 16 + ((block_v + c) * N * isz if staged else 0) + (4 * slots + 16 if slots else 0)
  return stages * per_stage + fixed


def state_grad_walk(
  q: jax.Array,
  k: jax.Array,
  do: jax.Array,
  t0: jax.Array,
  gamma: jax.Array,
  gamma_rows: jax.Array,
  beta_rows: jax.Array,
  mask_rows: jax.Array,
  scale: jax.Array,
  dfinal_t: jax.Array | None = None,
  *,
  block_v: int = 64,
  stages: int | None = None,
  seq_table: jax.Array | None = None,
  pieces: jax.Array | None = None,
  interpret=None,
):
  """The reverse walk (module docstring).

  Args:
    q, k: `[B, Tp, Hk, K]`, `Tp` a multiple of the chunk `C = 64 // r`; do: `[B, Tp, H, V]`,
      `H` a multiple of `Hk` (grouped value heads), V a multiple of block_v.
    t0, gamma, gamma_rows, beta_rows, mask_rows, scale: as the forward walk takes them
      (`walk_ws.state_walk_ws`).
    dfinal_t: None or `[B, H, V, K]` float32, d final_state transposed.
    seq_table: None, or packed sequences on the chunk-aligned padded layout (B = 1), the forward
      walk's table (`walk_ws.state_walk_ws`): program (n, h, v) walks sequence n's chunks, last
      first, from its `dfinal_t [N, H, V, K]` and writes its `d initial_state^T`; chunks of no
      sequence are not walked (their dh^T and dv_new^T stay unwritten).
    pieces: None, or the forward's bounds `[S]` with its table of pieces of the packed row read
      in place (`walk_ws.state_walk_ws`, docs/mosaic_gpu.md#packed-sequences-in-place): program
      p walks its chunks last first from a zero dS, writes nothing of its first step when flag 2
      of its row is set (a silent step: to dummy outputs, dropped), and adds slot j of
      `dfinal_t [S, H, V, K]` (the gradient of the state entering chunk bounds[j]) to dS once
      past that chunk (from entry 4 of its row, the last bound of its chunks).

  Returns:
    `dh^T [B, H, NC, V, K]` (q's dtype; the gradient of the state at the end of each chunk,
    transposed), `dv_new^T [B, H, NC, V, N]` (q's dtype; block-major columns) and
    `d initial_state^T [B, H, V, K]` float32 (`[N, H, V, K]` with seq_table).
  """
  batch, padded, key_heads, key_dim = k.shape
  heads, value_dim = do.shape[2], do.shape[-1]
  r = mask_rows.shape[-2]
  if r not in SUPPORTED_R:
    raise ValueError(f"mask size r={r}: the reverse walk supports r in {SUPPORTED_R}")
  c = chunk_tokens(r)
  dtype = k.dtype
  if q.shape != k.shape or q.dtype != dtype or do.dtype != dtype:
    raise ValueError(f"q, k, do: shapes {q.shape}, {k.shape}, {do.shape} / dtypes must agree")
  if do.shape[:2] != (batch, padded) or heads % key_heads:
    raise ValueError(f"do: shape {do.shape}, expected [B, T, H, V], H a multiple of {key_heads}")
  if padded % c or value_dim % block_v:
    raise ValueError(f"T={padded}, V={value_dim}: whole chunks of {c} and tiles of {block_v}")
  nc = padded // c
  if t0.shape != (batch, heads, nc * N, N):
    raise ValueError(f"t0: shape {t0.shape}, expected {(batch, heads, nc * N, N)}")
  group = heads // key_heads
  m_b, m_h, m_n = mask_rows.shape[:3]
  has_dfinal = dfinal_t is not None
  packed = seq_table is not None
  slots = 0 if pieces is None else pieces.shape[0]
  if slots and not (packed and dfinal_t is not None and dfinal_t.shape[0] == slots):
    raise ValueError(f"pieces: a seq_table and dfinal_t of {slots} slots")
  num_states = check_seq_table(seq_table, batch, None if slots else dfinal_t, "dfinal_t")
  staged = interpret is not None
  bv = block_v
  dk = key_dim // r
  stages = ring_stages(
    f"state_grad_walk (K={key_dim}, block_v={bv}, r={r})",
    lambda n: smem_bytes(key_dim, bv, r, dtype, n, staged, slots),
    stages,
  )
  # q, T0, gamma per token, mask rows, 3 gamma rows, beta rows, do; per block: k
  n_copies = 9 + r

  vecs = plgpu.SMEM((stages, N), F32)
  # tiles the products contract over their C tokens (major dimension): a k group of C at most
  tok_swizzle = min(128, c * jnp.dtype(dtype).itemsize)
  scratch = dict(
    q_s=smem((stages, c, key_dim), dtype, tok_swizzle),  # q, then scale E q (in place)
    kb_s=smem((stages, N, key_dim), dtype),  # the keys repeated per block, then Kb (in place)
    do_s=smem((stages, c, bv), dtype, tok_swizzle),
    t_s=smem((stages, N, N), dtype),  # T0, then Ag (in place)
    dvl_s=smem((stages, N, bv), dtype),  # dv_local
    g_rows=vecs,
    g_cols=vecs,
    g_chain=vecs,  # warpgroup 0's copy: COLS view and the last entry
    b_cols=vecs,
    # Rows of at least 128 bytes: a TMA destination must be 128-byte aligned (C = 16).
    g_tok=plgpu.SMEM((stages, max(c, 32)), F32),
    m_s=plgpu.SMEM((stages, r, N), F32),
    dh_pub=smem((2, bv, key_dim), dtype),
    dvn_pub=smem((2, bv, N), dtype),
    sc_s=plgpu.SMEM((4,), F32),
    **ring.barriers(stages, n_copies),
    sc_bar=plgpu.Barrier(num_arrivals=(2 if packed else 1) + (slots > 0)),
    tab_s=plgpu.SMEM((8 if slots else 4,), jnp.int32),
    done=plgpu.Barrier(num_arrivals=3),
  )
  if r > 1:
    scratch["kw_s"] = smem((stages, N, key_dim), dtype)
  if slots:
    scratch["bnd_s"] = plgpu.SMEM((slots,), jnp.int32)
  if staged:
    scratch["xt_s"] = smem((bv, N), dtype)
    scratch["pq_s"] = smem((N, c), dtype)

  out_type = [
    jax.ShapeDtypeStruct((batch, heads, nc, value_dim, key_dim), dtype),
    jax.ShapeDtypeStruct((batch, heads, nc, value_dim, N), dtype),
    jax.ShapeDtypeStruct((num_states, heads, value_dim, key_dim), F32),
  ]
  if slots:  # where silent steps write
    out_type.append(jax.ShapeDtypeStruct((1, heads, 1, value_dim, key_dim), dtype))
    out_type.append(jax.ShapeDtypeStruct((1, heads, 1, value_dim, N), dtype))

  def body(*refs, q_s, kb_s, do_s, t_s, dvl_s, g_rows, g_cols, g_chain, b_cols, g_tok, m_s,
           dh_pub, dvn_pub, sc_s, in_bar, prep_ready, in_free, sc_bar, tab_s, done, kw_s=None,
           xt_s=None, pq_s=None, bnd_s=None):  # fmt: skip
    refs = list(refs)
    q_ref, k_ref, do_ref, t0_ref, g_ref = (refs.pop(0) for _ in range(5))
    gr_ref, beta_ref, m_ref, sc_ref = (refs.pop(0) for _ in range(4))
    dfinal_ref = refs.pop(0) if has_dfinal else None
    tab_ref = refs.pop(0) if packed else None
    bnd_ref = refs.pop(0) if slots else None
    dh_ref, dvn_ref, dh0_ref, *dummy_refs = refs
    b, h, iv = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("v")
    hk = lax.div(h, group)  # the key head of value head h
    wg = lax.axis_index("wg")
    seq = b  # the state's index: the batch row, or the sequence
    first, count = 0, nc  # the chunks walked (last first)
    if packed:  # the sequence's chunks, from its row of the table
      bounds = (bnd_ref, bnd_s) if slots else None
      first, count = read_seq_table(tab_ref, sc_ref, tab_s, sc_s, sc_bar, seq, wg, bounds)
      b = 0
    # pieces: the first step silent (flag 2), the slots from the last bound of the chunks on
    silent_first = lax.div(tab_s[2], 2) == 1 if slots else False
    last_bound = tab_s[4] if slots else 0
    last = first + count - 1  # the chunk of the first step
    cols_v = pl.ds(iv * bv, bv)
    mb = b if m_b > 1 else 0
    mh = h if m_h > 1 else 0

    @pl.when(wg == 2)
    def _producer():
      plgpu.set_max_registers(40, action="decrease")

      def fill(i, put):
        n = last - i  # the chunks last first
        rows = pl.ds(n * c, c)
        put(q_ref.at[b, rows, hk], q_s)
        put(t0_ref.at[b, h, pl.ds(n * N, N)], t_s)
        put(g_ref.at[b, h, rows], g_tok, pl.ds(0, c))
        put(m_ref.at[mb, mh, n if m_n > 1 else 0], m_s)
        put(do_ref.at[b, rows, h, cols_v], do_s)
        chunk_rows = pl.ds(n * N, N)
        for dst in (g_rows, g_cols, g_chain):
          put(gr_ref.at[b, h, chunk_rows], dst)
        put(beta_ref.at[b, h, chunk_rows], b_cols)
        for a in range(r):  # tiles: C-row pieces stay 1024-byte aligned for every r
          put(k_ref.at[b, rows, hk], kb_s, pl.ds(a * c, c))

      ring.produce(fill, stages=stages, count=count, loaded=in_bar, free=in_free)

    @pl.when(wg == 0)
    def _chain():
      plgpu.set_max_registers(232, action="increase")

      # straight from global memory into the WGMMA layout
      def load_dfinal(index=seq):
        return plgpu.load(dfinal_ref.at[index, h, cols_v], layout=WGMMA, optimized=False)

      if has_dfinal and not slots:
        ds0 = load_dfinal()
      else:
        ds0 = plgpu.layout_cast(jnp.zeros((bv, key_dim), F32), WGMMA)
      wshape = (bv, N)
      sshape = (bv, key_dim)

      def step(i, carry):
        ds_t, bound = carry
        n = last - i
        slot = lax.rem(i, stages)
        half = lax.rem(i, 2)
        if slots:  # past a bound chunk: d(the state entering it), from its slot
          past = (bound >= 0) & (n + 1 == bnd_s[jnp.maximum(bound, 0)])
          ds_t = lax.cond(past, lambda: ds_t + load_dfinal(bound), lambda: ds_t)
          bound = bound - past.astype(jnp.int32)
        plgpu.barrier_wait(in_bar.at[slot])
        # the copies of the tiles published two chunks ago have read them
        plgpu.wait_smem_to_gmem(2, wait_read_only=True)
        ds_lo = ds_t.astype(dtype)
        dh_pub.at[half][...] = ds_lo
        g_c = plgpu.load(g_chain.at[slot], layout=COLS)
        g_end = g_chain[slot, N - 1]
        key_coef = jnp.exp(g_c)
        if r == 1:  # the mask is one number per token: it scales the columns of dX^T
          key_coef = key_coef * plgpu.load(m_s.at[slot].at[0], layout=COLS)
        plgpu.barrier_wait(prep_ready.at[slot])
        stage_s = dh_pub.at[half] if staged else None
        y = matmul_reg(ds_lo, kb_s.at[slot].T, wshape, stage=stage_s)  # dS^T Kb^T
        dvl = plgpu.load(dvl_s.at[slot].T, layout=WGMMA).astype(F32)
        dvn_lo = (dvl + y * bcast_cols(jnp.exp(g_end - g_c), wshape)).astype(dtype)
        dvn_pub.at[half][...] = dvn_lo
        dx = matmul_reg(dvn_lo, t_s.at[slot], wshape, stage=xt_s)  # dv_new^T Ag
        u = (dx * bcast_cols(-key_coef, wshape)).astype(dtype)
        kw = kb_s.at[slot] if r == 1 else kw_s.at[slot]
        products = ((do_s.at[slot].T, q_s.at[slot]), (u, kw))
        ds_new = matmul_sum(jnp.exp(g_end) * ds_t, products, sshape, stage=xt_s)
        plgpu.commit_smem()

        copy_tiles(
          (dh_pub.at[half], dvn_pub.at[half]),
          lambda: (dh_ref.at[b, h, n, cols_v], dvn_ref.at[b, h, n, cols_v]),
          lambda: tuple(d.at[0, h, 0, cols_v] for d in dummy_refs),
          silent=(i == 0) & silent_first if slots else None,
        )
        plgpu.barrier_arrive(in_free.at[slot])
        return ds_new, bound

      ds_t, _ = lax.fori_loop(0, count, step, (ds0, last_bound))
      dh0_ref.at[seq, h, cols_v][...] = ds_t  # straight from registers to global memory
      plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 1)
    def _prep():
      plgpu.set_max_registers(232, action="increase")
      if not packed:  # (packed: read with the table, above)
        plgpu.copy_gmem_to_smem(sc_ref, sc_s, sc_bar)
        plgpu.barrier_wait(sc_bar)
      scale_v = sc_s[0]
      pshape = (N, c)
      causal_pq = token_of(iota(pshape, 0), c) <= iota(pshape, 1)
      qshape = (key_dim, c)

      def step(i, carry):
        slot = lax.rem(i, stages)
        plgpu.barrier_wait(in_bar.at[slot])
        g_r = plgpu.load(g_rows.at[slot], layout=ROWS)
        g_c = plgpu.load(g_cols.at[slot], layout=COLS)
        b_c = plgpu.load(b_cols.at[slot], layout=COLS)
        kw = kw_s.at[slot] if r > 1 else None
        kb_lo = gate_stage(
          kb_s.at[slot], kw, t_s.at[slot], m_s.at[slot], g_r, g_c, b_c, dk, r, dtype
        )
        plgpu.commit_smem()
        # The intra-chunk scores transposed, (q Kb^T ⊙ D)^T, then dv_local.
        g_t = plgpu.load(g_tok.at[slot].at[pl.ds(0, c)], layout=COLS)
        if r == 1:
          pq = matmul(kb_s.at[slot], q_s.at[slot].T, pshape)
        else:  # Kb from registers: q's tile has a smaller swizzle than Kb's (wgmma wants one)
          kb_stage = kb_s.at[slot] if staged else None
          pq = matmul_reg(kb_lo, q_s.at[slot].T, pshape, stage=kb_stage)
        d_pq = jnp.exp(
          jnp.where(causal_pq, bcast_cols(g_t, pshape) - bcast_rows(g_r, pshape), -jnp.inf)
        )
        pq_lo = (pq * d_pq).astype(dtype)
        dvl = matmul_reg(pq_lo, do_s.at[slot], (N, bv), stage=pq_s)
        dvl_s.at[slot][...] = (dvl * scale_v).astype(dtype)
        # scale E q in place of q (the chain's do^T (scale E q)).
        q_t = plgpu.load(q_s.at[slot].T, layout=WGMMA).astype(F32)
        q_s.at[slot].T[...] = (q_t * bcast_cols(scale_v * jnp.exp(g_t), qshape)).astype(dtype)
        plgpu.commit_smem()
        plgpu.barrier_arrive(prep_ready.at[slot])
        plgpu.barrier_arrive(in_free.at[slot])
        return carry

      lax.fori_loop(0, count, step, None)

    plgpu.barrier_arrive(done)
    plgpu.barrier_wait(done)

  args = [q, k, do, t0, gamma, gamma_rows, beta_rows, mask_rows, scale]
  if dfinal_t is not None:
    args.append(dfinal_t)
  if seq_table is not None:
    args.append(seq_table)
  if pieces is not None:
    args.append(pieces)
  dh_t, dv_new, dh0_t, *_ = plgpu.kernel(
    body,
    out_type=out_type,
    scratch_types=scratch,
    grid=(num_states, heads, value_dim // bv),
    grid_names=("b", "h", "v"),
    num_threads=3,
    thread_name="wg",
    compiler_params=compiler_params(),
    interpret=interpret,
    kernel_name=f"gdp_state_grad_walk_r{r}",
  )(*args)
  return dh_t, dv_new, dh0_t
