"""The state walk and the output of the Hopper forward: one warp-specialised program per (batch
row, head, value tile) (docs/mosaic_gpu.md#the-walk has the math).

The float32 state, transposed (`S^T [BV, K]`), stays in registers over the chunks. Three
warpgroups: the producer (2) streams each chunk's q, k, v, T0, gates, beta and mask rows through
the TMA ring (`ring.py`, docs/mosaic_gpu.md#the-ring); warpgroup 1, off the chain, forms the
block and masked keys and the gated inverse `Ag` in place, then the output; the chain (0) runs
three dependent products per chunk, its left operands in registers, and publishes `S^T` and
`v_new^T` for the output. k and v of rank 5 are the Householder form's sub-steps, one per row
(docs/mosaic_gpu.md#the-householder-form). Every warpgroup waits for the others before it exits
(an early exit while another still issued wgmmas faulted on sm_90 with jax 0.11.2).
"""

from __future__ import annotations

import types

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels.mosaic_gpu import ring
from pallas_kernels.mosaic_gpu.common import (
  COLS,
  F32,
  ROWS,
  ROWS_PER_CHUNK,
  WGMMA,
  bcast_cols,
  bcast_rows,
  check_seq_table,
  clean_tile,
  compiler_params,
  copy_tiles,
  gate_stage,
  iota,
  matmul,
  matmul_reg,
  read_seq_table,
  ring_stages,
  set_registers,
  token_of,
  when,
)
from pallas_kernels.mosaic_gpu.walk_shapes import smem_bytes, walk_dims, walk_scratch

N = ROWS_PER_CHUNK


def bind(refs: dict, scratch: dict, *, nc: int, group: int, bv: int, m_shape, **statics):
  """One program's view of a walk (`producer`, `chain`, `output` read it): the refs, the statics
  and the program's batch row (or sequence), head, key head, value columns and chunks."""
  optional = dict(kw_s=None, xt_s=None, mk_tok=None, mk_ref=None, clean=False, blk_ref=None)
  optional.update(pieces=False, od_ref=None, sd_ref=None, vd_ref=None, bnd_ref=None, bnd_s=None)
  optional.update(value_tiles=None, vz_ref=None, oid_ref=None, end_ref=None)
  w = types.SimpleNamespace(**{**optional, **refs, **scratch, **statics}, bv=bv)
  w.b, w.h, iv = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("v")
  w.hk = lax.div(w.h, group)  # the key head of value head h
  w.wg = lax.axis_index("wg")
  w.seq = w.b  # the state's index: the batch row, or the sequence
  w.first, w.count = 0, nc  # the chunks walked
  if refs.get("tab_ref") is not None:  # the sequence's chunks, from its row of the table
    bounds = (w.bnd_ref, w.bnd_s) if w.pieces else None
    w.first, w.count = read_seq_table(
      refs["tab_ref"], refs["sc_ref"], w.tab_s, w.sc_s, w.sc_bar, w.seq, w.wg, bounds
    )
    w.b = 0
  # pieces (docs/mosaic_gpu.md#packed-sequences-in-place): the first chunk's writes go to the
  # dummy outputs when the piece's row says so (its flags), the states entering the bounds to
  # their slots (from the number of bounds before the first chunk)
  w.silent_first = lax.rem(w.tab_s[2], 2) == 1 if w.pieces else False
  w.slot0 = w.tab_s[3] if w.pieces else 0
  # the pieces' transitions (`transitions`): tiles past the value's walk v = 0 over the span
  w.transition = iv >= w.value_tiles if w.value_tiles is not None else False
  if w.value_tiles is not None:
    w.count = jnp.where(w.transition, w.tab_s[5], w.count)
  w.cols_v = pl.ds(iv * bv, bv)
  w.mb = w.b if m_shape[0] > 1 else 0
  w.mh = w.h if m_shape[1] > 1 else 0
  w.m_n = m_shape[2]
  return w


def producer(w, registers: int = 40):
  """The producer warpgroup: streams a chunk's q, k, v, T0, gates, beta, mask rows (and marks:
  `w.mk_ref`) with TMA into the ring, refilling a stage once both consumers released it."""
  set_registers(registers, w.warpgroups)
  c, b, hk, h = w.c, w.b, w.hk, w.h

  def fill(i, put):
    n = w.first + i  # the chunk of the i-th step
    rows = pl.ds(n * c, c)
    put(w.q_ref.at[b, rows, hk], w.q_s)
    put(w.t0_ref.at[b, h, pl.ds(n * N, N)], w.t_s)
    put(w.g_ref.at[b, h, rows], w.g_tok, pl.ds(0, c))
    if w.mk_ref is not None:
      put(w.mk_ref.at[b, h, rows], w.mk_tok, pl.ds(0, c))
    put(w.m_ref.at[w.mb, w.mh, n if w.m_n > 1 else 0], w.m_s)
    chunk_rows = pl.ds(n * N, N)
    for dst in (w.g_rows, w.g_cols, w.g_chain, w.g_last):
      put(w.gr_ref.at[b, h, chunk_rows], dst)
    put(w.beta_ref.at[b, h, chunk_rows], w.b_cols)
    for a in range(w.r):  # tiles: C-row pieces stay 1024-byte aligned for every r
      if w.householder:
        k_src, v_src = w.k_ref.at[b, rows, a, hk], w.v_ref.at[b, rows, a, h, w.cols_v]
      else:
        k_src, v_src = w.k_ref.at[b, rows, hk], w.v_ref.at[b, rows, h, w.cols_v]
      put(k_src, w.kb_s, pl.ds(a * c, c))
      if w.value_tiles is None:
        put(v_src, w.vrep_s, pl.ds(a * c, c))
      else:  # a transition tile reads zeros
        zeros = w.vz_ref.at[0, pl.ds(0, c), 0]
        when(w.transition, lambda: put(zeros, w.vrep_s, pl.ds(a * c, c)))
        when(~w.transition, lambda v_src=v_src: put(v_src, w.vrep_s, pl.ds(a * c, c)))

  ring.produce(fill, stages=w.stages, count=w.count, loaded=w.in_bar, free=w.in_free)


def chain(w, registers: int = 232):
  """The chain warpgroup: `S^T` in float32 registers, three dependent products per chunk,
  publishing `S^T` and `v_new^T` for the output warpgroup (module docstring)."""
  set_registers(registers, w.warpgroups)
  bv, key_dim, dtype, stages, staged = w.bv, w.key_dim, w.dtype, w.stages, w.staged
  if w.h0_ref is not None:  # straight from global memory into the WGMMA layout
    s0 = plgpu.load(w.h0_ref.at[w.seq, w.h, w.cols_v], layout=WGMMA, optimized=False)
  else:
    s0 = plgpu.layout_cast(jnp.zeros((bv, key_dim), F32), WGMMA)
  wshape = (bv, N)

  def step(n, carry):
    s_t, bound = carry
    slot = lax.rem(n, stages)
    half = lax.rem(n, 2)
    if w.pieces:  # the state entering a bound chunk, to its slot (but for a silent chunk)
      at_bound = w.first + n == w.bnd_s[bound]
      keep = at_bound & jnp.logical_not((n == 0) & w.silent_first)
      when(keep, lambda: put(w.ht_ref.at[bound, w.h, w.cols_v], s_t))
      bound = bound + at_bound.astype(jnp.int32)
    plgpu.barrier_wait(w.in_bar.at[slot])

    @pl.when(n >= 2)
    def _():  # the output warpgroup is done with the tiles published two chunks ago
      plgpu.barrier_wait(w.s_free.at[half])

    if w.store_states:  # and their copies to global memory have read them
      plgpu.wait_smem_to_gmem(2, wait_read_only=True)
    s_lo = s_t.astype(dtype)
    w.st_pub.at[half][...] = s_lo
    g_c = plgpu.load(w.g_chain.at[slot], layout=COLS)
    key_decay = jnp.exp(g_c)
    g_end = w.g_last[slot, N - 1]
    stage_s = w.st_pub.at[half] if staged else None
    # Kw = Kb, the keys as loaded (r = 1; Householder): S^T Kw^T need not wait for the stage,
    # unless the keys are cleaned in it (`w.clean`: the guard in the loads)
    early = not w.masked_keys and not w.clean
    if w.r == 1 and not w.masked_keys:  # the mask is one number per token: it scales S^T k^T
      key_decay = key_decay * plgpu.load(w.m_s.at[slot].at[0], layout=COLS)
    kw = w.kw_s if w.masked_keys else w.kb_s
    if early:
      pw = matmul_reg(s_lo, kw.at[slot].T, wshape, stage=stage_s)
    plgpu.barrier_wait(w.prep_ready.at[slot])
    if not early:
      pw = matmul_reg(s_lo, kw.at[slot].T, wshape, stage=stage_s)
    v_t = plgpu.load(w.vrep_s.at[slot].T, layout=WGMMA).astype(F32)
    x_t = (v_t - pw * bcast_cols(key_decay, wshape)).astype(dtype)
    vn_t = matmul_reg(x_t, w.t_s.at[slot].T, wshape, stage=w.xt_s)
    w.vn_pub.at[half][...] = vn_t.astype(dtype)
    plgpu.commit_smem()
    plgpu.barrier_arrive(w.s_ready.at[half])
    if w.store_states:
      chunk = w.first + n
      store_chunk(
        w,
        n,
        lambda: (
          w.states_ref.at[w.b, w.h, chunk, w.cols_v],
          w.vnew_ref.at[w.b, w.h, chunk, w.cols_v],
        ),
        lambda: (w.sd_ref.at[0, w.h, 0, w.cols_v], w.vd_ref.at[0, w.h, 0, w.cols_v]),
        (w.st_pub.at[half], w.vn_pub.at[half]),
      )
    vd_t = (vn_t * bcast_cols(jnp.exp(g_end - g_c), wshape)).astype(dtype)
    s_new = matmul_reg(
      vd_t, w.kb_s.at[slot], (bv, key_dim), init=jnp.exp(g_end) * s_t, stage=w.xt_s
    )
    plgpu.barrier_arrive(w.in_free.at[slot])
    if w.blk_ref is not None:  # block states: the state after every `w.every`-th chunk
      ends = w.first + n + 1

      @pl.when(lax.rem(ends, w.every) == 0)
      def _():  # straight from registers to global memory
        w.blk_ref.at[w.b, w.h, lax.div(ends, w.every) - 1, w.cols_v][...] = s_new

    return s_new, bound

  s_t, _ = lax.fori_loop(0, w.count, step, (s0, w.slot0))
  for j in range(2):  # consume the last releases of the published tiles
    i = w.count - 2 + j
    when(i >= 0, lambda i=i: plgpu.barrier_wait(w.s_free.at[i % 2]))
  if w.ht_ref is not None and not w.pieces:  # straight from registers to global memory
    w.ht_ref.at[w.seq, w.h, w.cols_v][...] = s_t
  if w.end_ref is not None:  # the state after the piece's last walked chunk
    w.end_ref.at[w.seq, w.h, w.cols_v][...] = s_t
  if w.store_states:
    plgpu.wait_smem_to_gmem(0)


def output(w, *, registers: int = 232):
  """The output warpgroup, off the chain: per stage first Kw, Kb (in place) and Ag (in place
  from T0), then the chain may go (`prep_ready`); then `Kb q^T ⊙ D` and, once the chain has
  published the chunk's `S^T` and `v_new^T`, the output, which it stores."""
  set_registers(registers, w.warpgroups)
  if w.tab_ref is None:  # (packed: read with the table, in `bind`)
    plgpu.copy_gmem_to_smem(w.sc_ref, w.sc_s, w.sc_bar)
    plgpu.barrier_wait(w.sc_bar)
  scale_v = w.sc_s[0]
  c, dtype, stages = w.c, w.dtype, w.stages
  pshape = (N, c)
  causal_pq = token_of(iota(pshape, 0), c) <= iota(pshape, 1)
  oshape = (w.bv, c)

  def step(n, carry):
    slot = lax.rem(n, stages)
    half = lax.rem(n, 2)
    rows = pl.ds((w.first + n) * c, c)
    # off the chain: Kw, Kb (in place) and Ag (in place), then the chain may go
    plgpu.barrier_wait(w.in_bar.at[slot])
    if w.clean:  # the non-finite guard in the loads: no nan or inf reaches a product
      clean_tile(w.kb_s.at[slot])
      clean_tile(w.vrep_s.at[slot])
      plgpu.commit_smem()
    g_r = plgpu.load(w.g_rows.at[slot], layout=ROWS)
    g_c = plgpu.load(w.g_cols.at[slot], layout=COLS)
    b_c = plgpu.load(w.b_cols.at[slot], layout=COLS)
    kw = w.kw_s.at[slot] if w.masked_keys else None
    gate_stage(w.kb_s.at[slot], kw, w.t_s.at[slot], w.m_s.at[slot], g_r, g_c, b_c, w.dk, w.r,
               dtype, mask_keys=w.masked_keys)  # fmt: skip
    plgpu.commit_smem()
    plgpu.barrier_arrive(w.prep_ready.at[slot])
    # The intra-chunk scores, transposed: (Kb q^T ⊙ D)^T.
    g_t = plgpu.load(w.g_tok.at[slot].at[pl.ds(0, c)], layout=COLS)
    pq = matmul(w.kb_s.at[slot], w.q_s.at[slot].T, pshape)
    d_pq = jnp.exp(
      jnp.where(causal_pq, bcast_cols(g_t, pshape) - bcast_rows(g_r, pshape), -jnp.inf)
    )
    w.pq_s.T[...] = (pq * d_pq).astype(dtype)
    plgpu.commit_smem()
    plgpu.barrier_wait(w.s_ready.at[half])
    o_t = matmul(w.st_pub.at[half], w.q_s.at[slot].T, oshape) * bcast_cols(jnp.exp(g_t), oshape)
    o_t = o_t + matmul(w.vn_pub.at[half], w.pq_s.T, oshape)
    if w.mk_tok is not None:  # the guard: nan where marked, and where q was (o non-finite)
      mk = bcast_cols(plgpu.load(w.mk_tok.at[slot].at[pl.ds(0, c)], layout=COLS), oshape)
      o_t = jnp.where((jnp.abs(o_t) < jnp.inf) & (mk == 0.0), o_t, jnp.nan)
    plgpu.barrier_arrive(w.s_free.at[half])
    plgpu.barrier_arrive(w.in_free.at[slot])
    plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # o_s[half] of chunk n - 2 has left
    w.o_s.at[half].T[...] = (o_t * scale_v).astype(dtype)
    plgpu.commit_smem()
    if w.value_tiles is None:
      real = lambda: (w.o_ref.at[w.b, rows, w.h, w.cols_v],)
      store_chunk(
        w, n, real, lambda: (w.od_ref.at[0, pl.ds(0, c), w.h, w.cols_v],), (w.o_s.at[half],)
      )
    else:  # the pieces' transitions: no silent chunk; a transition tile's output to o_id
      cols_t = pl.ds((lax.axis_index("v") - w.value_tiles) * w.bv, w.bv)
      when(
        w.transition,
        lambda: copy_tiles((w.o_s.at[half],), lambda: (w.oid_ref.at[w.h, rows, cols_t],)),
      )
      when(
        ~w.transition,
        lambda: copy_tiles((w.o_s.at[half],), lambda: (w.o_ref.at[w.b, rows, w.h, w.cols_v],)),
      )
    return carry

  lax.fori_loop(0, w.count, step, None)
  plgpu.wait_smem_to_gmem(0)


def put(ref, x) -> None:
  """ref[...] = x (straight from registers to global memory)."""
  ref[...] = x


def store_chunk(w, n, real, dummy, tiles):
  """Step n's copies of `tiles` to global memory (`common.copy_tiles`): the silent first chunk of
  a piece to the dummy outputs."""
  copy_tiles(tiles, real, dummy, silent=(n == 0) & w.silent_first if w.pieces else None)


def finish(w):
  """Every warpgroup waits for the others before it exits (module docstring)."""
  plgpu.barrier_arrive(w.done)
  plgpu.barrier_wait(w.done)


def state_walk_ws(
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
  store_states: bool = False,
  stages: int | None = None,
  seq_table: jax.Array | None = None,
  pieces: jax.Array | None = None,
  marks: jax.Array | None = None,
  state_every_chunks: int | None = None,
  transitions: bool = False,
  interpret=None,
):
  """The state walk and the output, per (batch, head, value tile) (module docstring).

  Args:
    q, k: `[B, Tp, Hk, K]`, `Tp` a multiple of the chunk `C = 64 // r`; v: `[B, Tp, H, V]`,
      `H` a multiple of `Hk` (grouped value heads: key head `h // (H / Hk)` serves head `h`).
    t0: `[B, H, NC * N, N]`, `chunk_inverse`'s T0.
    gamma: `[B, H, Tp]` float32, the chunk-local cumulative log-decay per token;
      gamma_rows, beta_rows: `[B, H, NC * N]` float32 per block-major row (`forward.block_rows`).
    mask_rows: `[Bm, Hm, NCm, r, N]` float32 (`forward.mask_rows`).
    scale: `[4]` float32, the output scale in entry 0.
    initial_state_t: None or `[B, H, V, K]` float32, the initial state transposed.
    block_v: value columns per program.
    output_final_state: also return the final state transposed, `[B, H, V, K]` float32.
    store_states: also return, per chunk, the state at its start transposed `[B, H, NC, V, K]`
      and `v_new^T` `[B, H, NC, V, N]` (block-major columns), both in the input dtype: the
      residuals of the backward (`backward_walk.py`), copied from the tiles the chain publishes.
    stages: ring stages (None: the most that fit).
    seq_table: None, or packed sequences on the chunk-aligned padded layout (docs/varlen.md, B = 1):
      int32 `[N, 4]`, row n `(first chunk, chunk count, ., .)` of sequence n (the last two
      entries unused: a row is one 16-byte copy; `varlen.sequence_chunks(...).T` fits). The
      grid's first axis is then the sequence: program (n, h, v) walks sequence n's chunks from
      its initial state (`initial_state_t [N, H, V, K]`) and writes its final state
      (`[N, H, V, K]`); chunks of no sequence are not walked (their output rows stay unwritten).
    pieces: None, or with seq_table the packed row read in place, cut into pieces
      (docs/mosaic_gpu.md#packed-sequences-in-place, gdp_jax/ops/gated_delta_product/pieces.py):
      the bounds, int32 `[S]` (S a multiple of 4), and seq_table `[P, 8]`, row p (first chunk,
      chunk count, flags, the number of bounds before the first chunk, ...): program p walks its
      chunks from a zero state (no initial_state_t), writes nothing of its first chunk when
      flag 1 is set (its output, states and v_new go to dummy outputs, dropped), and writes the
      state entering chunk bounds[j] to slot j of the "final state" `[S, H, V, K]`.
    marks: None, or the non-finite guard in the loads (docs/mosaic_gpu.md#the-guard-in-the-loads):
      `[B, H, Tp]` float32, 1 where a token's output is to be nan (nonfinite.py's marks); k and v
      are cleaned in place as they land, and the output is nan where marked or non-finite.
    state_every_chunks: None, or e: also return the float32 state after every e chunks,
      transposed, `[B, H, NC // e, V, K]` (row j after chunks [0, (j + 1) e); unpacked rows),
      written by the chain from its registers (docs/operator.md#block-boundary-states).
    transitions: with pieces, a long sequence cut anywhere (docs/mosaic_gpu.md
      #long-sequences-in-pieces): K / block_v more column tiles after V's walk each piece with
      v = 0 over its table row's chunk count in entry 5 (its span), from the initial state's
      columns V to V + K (the identity where a piece needs its transition); the states
      (initial, the slots', and the state after each piece's last walked chunk, returned last,
      `[P, H, V + K, K]`) have V + K columns, the transition tiles' outputs go to `o_id`
      `[H, Tp, K]` (B = 1; head-major for the products that use it), returned after the final
      state.
    interpret: None on an sm_90 GPU, or `plgpu.InterpretGPUParams()`.

  Returns:
    `(o [B, Tp, H, V], final state transposed or None)`, with `store_states` the two per-chunk
    arrays after them, and with `state_every_chunks` the block states last.
  """
  dims = walk_dims(q, k, v, t0, mask_rows, block_v)
  batch, padded, heads, key_dim, value_dim, r, c, nc, group = dims
  state_dim = value_dim + key_dim * transitions  # the state's columns (transitions: V + K)
  householder = k.ndim == 5
  masked_keys = r > 1 and not householder  # Kb and Kw formed from the keys
  dtype = k.dtype
  staged = interpret is not None
  packed = seq_table is not None
  num_states = check_seq_table(seq_table, batch, initial_state_t, "initial_state_t")
  bv = block_v
  stages = ring_stages(
    f"state_walk_ws (K={key_dim}, block_v={bv}, r={r})",
    lambda n: smem_bytes(
      key_dim, bv, r, dtype, n, staged, 0 if pieces is None else pieces.shape[0]
    ),
    stages,
  )
  # q, T0, gamma per token, mask rows, 4 gamma rows, beta rows; per block: k, v
  scratch = walk_scratch(
    stages=stages, c=c, key_dim=key_dim, bv=bv, r=r, dtype=dtype, masked_keys=masked_keys,
    staged=staged, n_copies=9 + 2 * r + (marks is not None), warpgroups=3, packed=packed,
    marks=marks is not None, slots=0 if pieces is None else pieces.shape[0],
  )  # fmt: skip
  if state_every_chunks is not None and (packed or state_every_chunks < 1):
    raise ValueError(f"state_every_chunks={state_every_chunks}: a positive count, unpacked rows")
  if marks is not None and ((packed and pieces is None) or marks.shape != (batch, heads, padded)):
    raise ValueError(f"marks: shape {marks.shape}, expected {(batch, heads, padded)}, one row")
  if pieces is not None and (
    seq_table is None or seq_table.shape[-1] != 8 or (initial_state_t is not None) != transitions
  ):
    raise ValueError("pieces: a seq_table [P, 8], an initial state with transitions only")
  if transitions and (pieces is None or store_states or not output_final_state or k.ndim == 5):
    raise ValueError("transitions: pieces of the operator's row, the slots and no store_states")

  out_type = [jax.ShapeDtypeStruct((batch, padded, heads, value_dim), dtype)]
  if output_final_state:
    states = num_states if pieces is None else pieces.shape[0]
    out_type.append(jax.ShapeDtypeStruct((states, heads, state_dim, key_dim), F32))
  if transitions:
    out_type.append(jax.ShapeDtypeStruct((heads, padded, key_dim), dtype))
  if store_states:
    out_type.append(jax.ShapeDtypeStruct((batch, heads, nc, value_dim, key_dim), dtype))
    out_type.append(jax.ShapeDtypeStruct((batch, heads, nc, value_dim, N), dtype))
  if state_every_chunks is not None:
    blocks = nc // state_every_chunks
    out_type.append(jax.ShapeDtypeStruct((batch, heads, blocks, value_dim, key_dim), F32))
  if transitions:
    out_type.append(jax.ShapeDtypeStruct((num_states, heads, state_dim, key_dim), F32))
  dummies = []  # pieces: where silent chunks write
  if pieces is not None:
    dummies.append(jax.ShapeDtypeStruct((1, c, heads, value_dim), dtype))
  if pieces is not None and store_states:
    dummies.append(jax.ShapeDtypeStruct((1, heads, 1, value_dim, key_dim), dtype))
    dummies.append(jax.ShapeDtypeStruct((1, heads, 1, value_dim, N), dtype))
  in_names = ["q_ref", "k_ref", "v_ref", "t0_ref", "g_ref", "gr_ref", "beta_ref", "m_ref", "sc_ref"]
  in_names += ["h0_ref"] * (initial_state_t is not None) + ["tab_ref"] * packed
  in_names += ["mk_ref"] * (marks is not None) + ["bnd_ref"] * (pieces is not None)
  in_names += ["vz_ref"] * transitions
  out_names = ["o_ref"] + ["ht_ref"] * output_final_state + ["oid_ref"] * transitions
  out_names += ["states_ref", "vnew_ref"] * store_states
  out_names += ["blk_ref"] * (state_every_chunks is not None) + ["end_ref"] * transitions
  out_names += ["od_ref", "sd_ref", "vd_ref"][: len(dummies)]
  names = in_names + out_names
  absent = {
    n: None
    for n in (
      "h0_ref",
      "tab_ref",
      "mk_ref",
      "ht_ref",
      "states_ref",
      "vnew_ref",
      "blk_ref",
      "bnd_ref",
    )
  }

  def body(*refs, **scratch_refs):
    w = bind(
      {**absent, **dict(zip(names, refs))}, scratch_refs, nc=nc, group=group, bv=bv,
      m_shape=mask_rows.shape, stages=stages, r=r, c=c, dk=key_dim // r, key_dim=key_dim,
      dtype=dtype, householder=householder, masked_keys=masked_keys, staged=staged,
      store_states=store_states, warpgroups=3, clean=marks is not None,
      every=state_every_chunks, pieces=pieces is not None,
      value_tiles=value_dim // bv if transitions else None,
    )  # fmt: skip
    pl.when(w.wg == 2)(lambda: producer(w))
    pl.when(w.wg == 0)(lambda: chain(w))
    pl.when(w.wg == 1)(lambda: output(w))
    finish(w)

  args = [q, k, v, t0, gamma, gamma_rows, beta_rows, mask_rows, scale]
  if initial_state_t is not None:
    args.append(initial_state_t)
  if seq_table is not None:
    args.append(seq_table)
  if marks is not None:
    args.append(marks)
  if pieces is not None:
    args.append(pieces)
  if transitions:
    args.append(jnp.zeros((1, c, 1, bv), dtype))
  outs = plgpu.kernel(
    body,
    out_type=out_type + dummies,
    scratch_types=scratch,
    grid=(num_states, heads, state_dim // bv),
    grid_names=("b", "h", "v"),
    num_threads=3,
    thread_name="wg",
    compiler_params=compiler_params(),
    interpret=interpret,
    kernel_name=f"gdp_state_walk_ws_r{r}",
  )(*args)
  outs = list(outs)[: len(out_type)]
  o = outs.pop(0)
  final = outs.pop(0) if output_final_state else None
  return (o, final, *outs)  # (transitions: o_id first, the pieces' end states last)
