"""The Hopper forward as one warp-specialised kernel per (batch row, head, value tile).

The walk of `walk_ws.py` (its producer, chain and output warpgroups, the same functions) with a
fourth warpgroup in place of `chunk_inverse`'s launch: per ring stage it forms Kb and Kw (in
place, r > 1), the gate-free chunk matrix

  A0[(a,t),(d,s)] = beta_t (Kw Kb^T)[(a,t),(d,s)] = beta_t M_t[a,d] <k_t^(d), k_s^(d)>   (t > s)

(at r = 1 the mask, one number per token, scales the rows), `T0 = (I + A0)^-1` by
`chunk_inverse.invert` and `Ag = T0 ⊙ Dec ⊙ beta_s` straight into the stage, then releases it to
the chain, so T0, w and u never reach global memory. With the non-finite guard (`marks`) it first
cleans the stage's k and v in place and the output warpgroup writes nan where marked; with
`split_inverse` the output warpgroup forms half the inverses (docs/mosaic_gpu.md#the-fused-forward).
"""

from __future__ import annotations

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels.mosaic_gpu import diag_solve as diag_solve_mod
from pallas_kernels.mosaic_gpu import walk_ws
from pallas_kernels.mosaic_gpu.chunk_inverse import earlier_rows, invert
from pallas_kernels.mosaic_gpu.common import (
  COLS,
  F32,
  ROWS,
  ROWS_PER_CHUNK,
  bcast_rows,
  clean_tile,
  compiler_params,
  gated,
  iota,
  key_stage,
  mask_matrix,
  matmul,
  ring_stages,
  set_registers,
  smem,
  when,
)

N = ROWS_PER_CHUNK
# setmaxnreg per warpgroup (chain, output, producer, inverse): 512 threads share 64K registers,
# so the four sum to at most 512.
REGISTERS = (208, 144, 24, 136)


def smem_bytes(key_dim: int, block_v: int, r: int, dtype, stages: int, staged: bool) -> int:
  """Shared memory of `fused_walk`: the walk's (`walk_ws.smem_bytes`, its T0 ring now written by
  the inverse warpgroup) and the inverse's: compiled the float32 solve's buffers, interpreted one
  staging tile for the merges' left operands; and the guard's marks per token (at most 64)."""
  isz = jnp.dtype(dtype).itemsize
  extra = N * N * isz if staged else 2 * N * (N + diag_solve_mod.PAD) * 4
  extra += stages * N * 4
  return walk_ws.smem_bytes(key_dim, block_v, r, dtype, stages, staged) + extra


def inverse_step(w, n, solve_s, stage_a) -> None:
  """Stage `n`'s inverse, its loads waited for: (with `w.clean` first the keys and values cleaned
  in place) Kb and Kw (in place), A0, T0 and Ag into `t_s` (module docstring), then
  `prep_ready`. solve_s: None (merges only) or the float32 solve's buffers."""
  sq = (N, N)
  slot = lax.rem(n, w.stages)
  kb = w.kb_s.at[slot]
  t_s = w.t_s.at[slot]
  if w.clean:  # the non-finite guard: no nan or inf reaches a product
    clean_tile(kb)
    clean_tile(w.vrep_s.at[slot])
    plgpu.commit_smem()
  if w.masked_keys:
    key_stage(kb, w.kw_s.at[slot], w.m_s.at[slot], w.dk, w.r, w.dtype, True)
    plgpu.commit_smem()
    gram = matmul(w.kw_s.at[slot], kb.T, sq)  # [(a,t),(d,s)] = M_t[a,d] <k_t^(d), k_s^(d)>
  else:
    gram = matmul(kb, kb.T, sq)
  b_r = plgpu.load(w.b_cols.at[slot], layout=ROWS)
  coef = bcast_rows(b_r, sq)
  if not w.masked_keys:  # r = 1: the mask is one number per token
    coef = coef * mask_matrix(w.m_s.at[slot], sq, w.c, w.r)
  a0 = jnp.where(earlier_rows(w.r), gram * coef, 0.0)  # (formed here: no registers held)
  if w.without_inverse:  # profiling only: the walk's time with an inverse that costs nothing
    t0 = (iota(sq, 0) == iota(sq, 1)).astype(F32) + 0.0 * a0
  else:
    t0 = invert(a0, w.r, [t_s, *stage_a], w.dtype, solve_s)
  g_r = plgpu.load(w.g_rows.at[slot], layout=ROWS)
  g_c = plgpu.load(w.g_cols.at[slot], layout=COLS)
  b_c = plgpu.load(w.b_cols.at[slot], layout=COLS)
  t_s[...] = gated(t0, g_r, g_c, b_c, w.c).astype(w.dtype)
  plgpu.commit_smem()
  plgpu.barrier_arrive(w.prep_ready.at[slot])


def inverse(w, solve_s, stage_a, registers: int, every: int = 1) -> None:
  """The inverse warpgroup: `inverse_step` for every stage, or (`every=2`, two ring stages) for
  the even chunks, the output warpgroup taking the odd ones (`ahead_of_output`)."""
  set_registers(registers, w.warpgroups)

  def step(j, carry):
    n = j * every
    plgpu.barrier_wait(w.in_bar.at[lax.rem(n, w.stages)])
    inverse_step(w, n, solve_s, stage_a)
    return carry

  lax.fori_loop(0, (w.count + every - 1) // every, step, None)


def ahead_of_output(w, stage_a):
  """With the inverse split (`split_inverse`): the output warpgroup's step `n` first waits for
  stage n + 1's loads (and at n = 0 for stage 0's) and forms the inverse of the odd ones (by the
  merges alone: the float32 solve's buffers are the inverse warpgroup's), then writes chunk n's
  output, so the two warpgroups share the inverses while the chain walks."""

  def ahead(n):
    when(n == 0, lambda: plgpu.barrier_wait(w.in_bar.at[0]))
    nxt = n + 1

    @pl.when(nxt < w.count)
    def _():
      plgpu.barrier_wait(w.in_bar.at[lax.rem(nxt, w.stages)])
      pl.when(lax.rem(nxt, 2) == 1)(lambda: inverse_step(w, nxt, None, stage_a))

  return ahead


def fused_walk(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  gamma: jax.Array,
  gamma_rows: jax.Array,
  beta_rows: jax.Array,
  mask_rows: jax.Array,
  scale: jax.Array,
  initial_state_t: jax.Array | None = None,
  marks: jax.Array | None = None,
  *,
  block_v: int = 64,
  output_final_state: bool = False,
  stages: int | None = None,
  diag_solve: bool | None = None,
  registers: tuple[int, int, int, int] = REGISTERS,
  without_inverse: bool = False,
  split_inverse: bool = False,
  interpret=None,
):
  """The forward in one kernel: `(o [B, Tp, H, V], final state transposed [B, H, V, K] float32 or
  None)`. Arguments as `walk_ws.state_walk_ws` takes them, without T0 (formed in the kernel).

  marks: None, or the non-finite guard in the kernel (docs/mosaic_gpu.md#the-fused-forward):
    `[B, H, Tp]` float32, nonzero where the output must be nan (the state spoiled before or at
    the token); k and v are cleaned as they land, and the outputs of a non-finite q are nan too.

  diag_solve: the 16-row groups solved in float32 (None: compiled yes, interpreted no: the
    interpreter runs no raw Mosaic GPU code).
  registers: setmaxnreg of the chain, output, producer and inverse warpgroups.
  split_inverse: the output warpgroup forms the odd chunks' inverses (by the merges alone), the
    inverse warpgroup the even ones (two ring stages), to balance the two.
  without_inverse: profiling only (a wrong result): T0 = I instead of the inverse, so that the
    time shows what the walk costs when the inverse warpgroup's solve and merges cost nothing.
  """
  dims = walk_ws.walk_dims(q, k, v, None, mask_rows, block_v)
  batch, padded, heads, key_dim, value_dim, r, c, nc, group = dims
  if k.ndim == 5:
    raise ValueError("k: the fused forward takes [B, T, H, K] keys (no Householder sub-steps)")
  masked_keys = r > 1
  dtype = k.dtype
  staged = interpret is not None
  if diag_solve is None:
    diag_solve = not staged
  if diag_solve and staged:
    raise ValueError("diag_solve=True: the Mosaic GPU interpreter runs no raw Mosaic GPU code")
  bv = block_v
  stages = ring_stages(
    f"fused_walk (K={key_dim}, block_v={bv}, r={r})",
    lambda n: smem_bytes(key_dim, bv, r, dtype, n, staged),
    2 if split_inverse else stages,
  )
  # q, gamma per token, mask rows, 4 gamma rows, beta rows; per block: k, v
  scratch = walk_ws.walk_scratch(
    stages=stages, c=c, key_dim=key_dim, bv=bv, r=r, dtype=dtype, masked_keys=masked_keys,
    staged=staged, n_copies=8 + 2 * r + (marks is not None), warpgroups=4, packed=False,
    marks=marks is not None,
  )  # fmt: skip
  inv_scratch = {}
  if diag_solve:
    inv_scratch["solve_s"] = diag_solve_mod.scratch()
  if staged:
    inv_scratch["stage_a"] = smem((N, N), dtype)
    if split_inverse:  # the output warpgroup's
      inv_scratch["stage_b"] = smem((N, N), dtype)

  out_type = [jax.ShapeDtypeStruct((batch, padded, heads, value_dim), dtype)]
  if output_final_state:
    out_type.append(jax.ShapeDtypeStruct((batch, heads, value_dim, key_dim), F32))
  in_names = ["q_ref", "k_ref", "v_ref", "g_ref", "gr_ref", "beta_ref", "m_ref", "sc_ref"]
  in_names += ["h0_ref"] * (initial_state_t is not None) + ["mk_ref"] * (marks is not None)
  names = in_names + ["o_ref"] + ["ht_ref"] * output_final_state
  absent = {n: None for n in ("t0_ref", "h0_ref", "tab_ref", "ht_ref", "states_ref", "vnew_ref")}
  chain_regs, output_regs, producer_regs, inverse_regs = registers

  def body(*refs, solve_s=None, stage_a=None, stage_b=None, **scratch_refs):
    w = walk_ws.bind(
      {**absent, **dict(zip(names, refs))}, scratch_refs, nc=nc, group=group, bv=bv,
      m_shape=mask_rows.shape, stages=stages, r=r, c=c, dk=key_dim // r, key_dim=key_dim,
      dtype=dtype, householder=False, masked_keys=masked_keys, staged=staged, store_states=False,
      clean=marks is not None, without_inverse=without_inverse, warpgroups=4,
    )  # fmt: skip
    pl.when(w.wg == 2)(lambda: walk_ws.producer(w, producer_regs))
    pl.when(w.wg == 0)(lambda: walk_ws.chain(w, chain_regs))
    ahead = ahead_of_output(w, [] if stage_b is None else [stage_b]) if split_inverse else None
    pl.when(w.wg == 1)(lambda: walk_ws.output(w, gates=False, registers=output_regs, ahead=ahead))
    stage = [] if stage_a is None else [stage_a]
    every = 2 if split_inverse else 1
    pl.when(w.wg == 3)(lambda: inverse(w, solve_s, stage, inverse_regs, every))
    walk_ws.finish(w)

  args = [q, k, v, gamma, gamma_rows, beta_rows, mask_rows, scale]
  args += [x for x in (initial_state_t, marks) if x is not None]
  outs = plgpu.kernel(
    body,
    out_type=out_type,
    scratch_types={**scratch, **inv_scratch},
    grid=(batch, heads, value_dim // bv),
    grid_names=("b", "h", "v"),
    num_threads=4,
    thread_name="wg",
    compiler_params=compiler_params(),
    interpret=interpret,
    kernel_name=f"gdp_fused_forward_r{r}",
  )(*args)
  outs = list(outs)
  return outs[0], (outs[1] if output_final_state else None)
