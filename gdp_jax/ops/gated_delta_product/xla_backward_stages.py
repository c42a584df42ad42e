"""The backward of the chunked (WY) form, stages 1-5 in plain jnp, each the counterpart of one
Pallas backward kernel (docs/chunked_form.md#the-backward has the formulas and the pitfalls
each stage avoids, checked against autodiff).

1. `chunk_bwd_dv_local`: the part of dv_new that reaches o inside its chunk.
2. `chunk_bwd_dhu` (`chunk_bwd_dhu_varlen` over packed sequences, docs/varlen.md): the reverse
   recurrence of the state gradient over chunks, from dfinal to d initial_state.
3. `chunk_bwd_dqkwg`: dq, dk, dw and dgcum per chunk.
4. `wy_bwd`: through w = Ai W~, u = Ai U~ and the gated KKT (dk, dv, dbeta, dmask, dgcum);
   `reduce_dmask` sums dmask over what the mask broadcasts.
5. `chunk_local_reverse_cumsum`: dg from dgcum.

Layouts as in `xla` (q, k [B,Tp,H,K]; beta, gcum [B,H,Tp]; w, dw [B,H,Tp*r,K]; h, dh
[B,H,NT,K,V]); float32 at HIGHEST; every decay that could be positive is masked before `exp`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gdp_jax.ops.gated_delta_product.xla import (
  chunk_decay,
  decay_from_start,
  decay_to_end,
  einsum_f32,
  f32,
  head_major_chunks,
  mask_chunks,
  seg_chunks,
  split_chunks,
)

__all__ = [
  "chunk_bwd_dv_local",
  "chunk_bwd_dhu",
  "chunk_bwd_dhu_varlen",
  "chunk_bwd_dqkwg",
  "wy_bwd",
  "reduce_dmask",
  "chunk_local_reverse_cumsum",
]


def _blocks(x, chunk, r):
  """[B, Tp, H, K] -> [B, H, NT, C, r, dk] float32."""
  bsz, t_len, heads, dim = x.shape
  return head_major_chunks(x, chunk).reshape(bsz, heads, t_len // chunk, chunk, r, dim // r)


def _to_time_major(x):
  """[B, H, NT, C, ...] -> [B, Tp, H, (prod of ...)]."""
  bsz, heads, nt, c = x.shape[:4]
  x = x.reshape(bsz, heads, nt * c, -1)
  return jnp.moveaxis(x, 1, 2)


def _rows(x, chunk, r):
  """[B, H, Tp*r, D] -> [B, H, NT, C, r, D] float32."""
  bsz, heads, rows, dim = x.shape
  return x.astype(f32).reshape(bsz, heads, rows // (chunk * r), chunk, r, dim)


# ----------------------------------------------------------------------------------------------
# 1. dv from o inside the chunk
# ----------------------------------------------------------------------------------------------


def chunk_bwd_dv_local(q, k, gcum, do, scale, chunk, r, seg=None):
  """dv_local[(s,a)] = scale sum_{t>=s in chunk} D[t,s] <q_t^(a), k_s^(a)> do_t.

  q, k: [B,Tp,H,K]; gcum: [B,H,Tp]; do: [B,Tp,H,V]; r: the number of key blocks; seg: the reset
  counts of `xla.gate_cumsum` (None: no resets; the same for every stage below).
  Returns dv_local [B,H,Tp*r,V] float32.
  """
  bsz, t_len, heads, _ = q.shape
  dim_v = do.shape[-1]
  qc, kc = _blocks(q, chunk, r), _blocks(k, chunk, r)
  doc = head_major_chunks(do, chunk)  # [B,H,NT,C,V]
  gc = split_chunks(gcum, chunk, 2)
  qk = einsum_f32("zyntad,zynsad->zyntsa", qc, kc)  # <q_t^(a), k_s^(a)>
  p = scale * qk * chunk_decay(gc, True, seg_chunks(seg, chunk))[..., None]
  dv = einsum_f32("zyntsa,zyntv->zynsav", p, doc)
  return dv.reshape(bsz, heads, t_len * r, dim_v)


# ----------------------------------------------------------------------------------------------
# 2. the state gradient, backward over chunks
# ----------------------------------------------------------------------------------------------


def chunk_bwd_dhu(q, k, w, gcum, do, dv_local, dfinal, scale, chunk, seg=None):
  """The reverse recurrence over chunks.

  q, k: [B,Tp,H,K]; w: [B,H,Tp*r,K]; gcum: [B,H,Tp]; do: [B,Tp,H,V];
  dv_local: [B,H,Tp*r,V] (stage 1); dfinal: [B,H,K,V] or None (zeros).
  Returns (dh [B,H,NT,K,V]: dh[n] = dL/d(state at the end of chunk n), dh[NT-1] = dfinal;
           dh0 [B,H,K,V] = dL/d initial_state;
           dv_new [B,H,Tp*r,V] = dv_local + the part through the state updates).
  """
  bsz, t_len, heads, dim_k = q.shape
  dim_v = do.shape[-1]
  r = w.shape[2] // t_len
  if dfinal is None:
    dfinal = jnp.zeros((bsz, heads, dim_k, dim_v), f32)

  def one_chunk(dh, xs):
    ds0, dv_new = _dhu_chunk(dh, *xs, scale)
    return ds0, (dh, dv_new)

  xs = _dhu_inputs(q, k, w, gcum, do, dv_local, chunk, seg)
  dh0, (dh, dv_new) = jax.lax.scan(one_chunk, dfinal.astype(f32), xs, reverse=True)
  dh = jnp.moveaxis(dh, 0, 2)  # [B,H,NT,K,V]
  dv_new = jnp.moveaxis(dv_new, 0, 2).reshape(bsz, heads, t_len * r, dim_v)
  return dh, dh0, dv_new


def _dhu_inputs(q, k, w, gcum, do, dv_local, chunk, seg):
  """The per-chunk inputs of the reverse state recurrence, chunk axis first."""
  bsz, t_len, heads, dim_k = q.shape
  dim_v = do.shape[-1]
  r = w.shape[2] // t_len
  nt = t_len // chunk
  n = chunk * r
  qc = head_major_chunks(q, chunk)  # [B,H,NT,C,K]
  kc = _blocks(k, chunk, r)  # [B,H,NT,C,r,dk]
  gc = split_chunks(gcum, chunk, 2)
  sc = split_chunks(jnp.zeros(gcum.shape, jnp.int32) if seg is None else seg, chunk, 2)
  wc = w.astype(f32).reshape(bsz, heads, nt, n, dim_k)
  doc = head_major_chunks(do, chunk)
  dvl = dv_local.astype(f32).reshape(bsz, heads, nt, n, dim_v)
  return tuple(jnp.moveaxis(x, 2, 0) for x in (qc, kc, gc, sc, wc, doc, dvl))


def _dhu_chunk(dh, q_c, k_c, g_c, s_c, w_c, do_c, dvl_c, scale):
  """One chunk of the reverse recurrence: dh (the gradient of the state leaving the chunk) ->
  (dS0, the gradient of the state entering it; dv_new of the chunk)."""
  bsz, heads, _, r, dk = k_c.shape
  dim_v = dh.shape[-1]
  from_start = decay_from_start(g_c, s_c)  # exp(gamma), [B,H,C]
  k_dec = k_c * decay_to_end(g_c, s_c)[..., None, None]  # [B,H,C,r,dk]
  dv_state = einsum_f32("zytad,zyadv->zytav", k_dec, dh.reshape(bsz, heads, r, dk, dim_v))
  dv_new = dvl_c + dv_state.reshape(dvl_c.shape)
  q_dec = q_c * (scale * from_start)[..., None]
  ds0 = (
    from_start[..., -1, None, None] * dh
    + einsum_f32("zytk,zytv->zykv", q_dec, do_c)
    - einsum_f32("zyik,zyiv->zykv", w_c, dv_new)
  )
  return ds0, dv_new


def chunk_bwd_dhu_varlen(q, k, w, gcum, do, dv_local, dfinal, lay, scale, seg=None):
  """`chunk_bwd_dhu` over packed sequences (docs/varlen.md), chunks of `lay.chunk` tokens.

  The reverse of `xla.chunk_state_varlen`: the gradient of the state leaving a sequence's last
  chunk (`lay.chunk_last`) is that sequence's dfinal, not the next chunk's dS0 (the next chunk
  starts another sequence from its own initial state); the dS0 of a sequence's first chunk
  (`lay.chunk_first`) is the gradient of that sequence's initial state.
  dfinal: [N, H, K, V] float32 (B = 1 in the packed layout).
  Returns (dh [1,H,NT,K,V]: the gradient of the state leaving each chunk; dh0 [N,H,K,V]: the
  gradient of each initial state (an empty sequence's is its dfinal); dv_new [1,H,Tp*r,V]).
  """
  bsz, t_len, heads, _ = q.shape
  dim_v = do.shape[-1]
  r = w.shape[2] // t_len
  xs = _dhu_inputs(q, k, w, gcum, do, dv_local, lay.chunk, seg)
  dfinal = dfinal.astype(f32)
  dfinal_chunks = jnp.take(dfinal, lay.chunk_seq, axis=0)[:, None]  # [NT,1,H,K,V]

  def one_chunk(carry, xs):
    *chunk_xs, df, is_last, is_first = xs
    dh = jnp.where(is_last, df, carry)
    ds0, dv_new = _dhu_chunk(dh, *chunk_xs, scale)
    return jnp.where(is_first, 0.0, ds0), (dh, ds0, dv_new)

  xs = xs + (dfinal_chunks, lay.chunk_last, lay.chunk_first)
  start = jnp.zeros(dfinal_chunks.shape[1:], f32)
  _, (dh, ds0, dv_new) = jax.lax.scan(one_chunk, start, xs, reverse=True)
  ds0 = jnp.where(lay.chunk_first[:, None, None, None, None], ds0, 0.0)[:, 0]  # [NT,H,K,V]
  dh0 = jnp.zeros_like(dfinal).at[lay.chunk_seq].add(ds0)  # one first chunk per sequence
  dh0 = jnp.where(lay.empty[:, None, None, None], dfinal, dh0)
  dh = jnp.moveaxis(dh, 0, 2)
  dv_new = jnp.moveaxis(dv_new, 0, 2).reshape(bsz, heads, t_len * r, dim_v)
  return dh, dh0, dv_new


# ----------------------------------------------------------------------------------------------
# 3. dq, dk, dw and dgcum from o and the state updates
# ----------------------------------------------------------------------------------------------


def chunk_bwd_dqkwg(q, k, v_new, gcum, h, dh, do, dv_new, scale, chunk, seg=None):
  """Per chunk (chunks independent): gradients of o and of the state update given h, dh.

  q, k: [B,Tp,H,K]; v_new, dv_new: [B,H,Tp*r,V]; gcum: [B,H,Tp]; h, dh: [B,H,NT,K,V];
  do: [B,Tp,H,V].
  Returns (dq [B,Tp,H,K], dk [B,Tp,H,K] (the part from o and the state update),
           dw [B,H,Tp*r,K], dgcum [B,H,Tp] (the part from o and h, before the reverse cumsum)),
  all float32.
  """
  bsz, t_len, heads, dim_k = q.shape
  dim_v = do.shape[-1]
  r = v_new.shape[2] // t_len
  dk = dim_k // r
  nt = t_len // chunk
  qc, kc = _blocks(q, chunk, r), _blocks(k, chunk, r)  # [B,H,NT,C,r,dk]
  doc = head_major_chunks(do, chunk)  # [B,H,NT,C,V]
  vn = _rows(v_new, chunk, r)  # [B,H,NT,C,r,V]
  dvn = dv_new.astype(f32).reshape(bsz, heads, nt, chunk * r, dim_v)
  gc = split_chunks(gcum, chunk, 2)  # [B,H,NT,C]
  sc = seg_chunks(seg, chunk)
  from_start = decay_from_start(gc, sc)  # exp(gamma), [B,H,NT,C]
  hb = h.astype(f32).reshape(bsz, heads, nt, r, dk, dim_v)
  dhb = dh.astype(f32).reshape(bsz, heads, nt, r, dk, dim_v)

  # intra-chunk attention part of o
  ds = einsum_f32("zyntv,zynsav->zyntsa", doc, vn)  # <do_t, v_new[(s,a)]>
  ds = scale * ds * chunk_decay(gc, True, sc)[..., None]
  dq = einsum_f32("zyntsa,zynsad->zyntad", ds, kc)
  dkk = einsum_f32("zyntsa,zyntad->zynsad", ds, qc)
  z = ds * einsum_f32("zyntad,zynsad->zyntsa", qc, kc)
  dg = z.sum((-2, -1)) - z.sum((-3, -1))

  # the inter-chunk part of o: scale exp(gamma_t) q_t^T S0
  dq_inter = (scale * from_start)[..., None, None] * einsum_f32("zyntv,zynadv->zyntad", doc, hb)
  dq = dq + dq_inter
  dg = dg + (dq_inter * qc).sum((-2, -1))

  # the state update: S_end^(a) = exp(g_L) S0^(a) + sum_t exp(g_L - g_t) k_t^(a) v_new[(t,a)]^T
  dk_state = decay_to_end(gc, sc)[..., None, None] * einsum_f32("zyntav,zynadv->zyntad", vn, dhb)
  dkk = dkk + dk_state
  c = (dk_state * kc).sum((-2, -1))  # [B,H,NT,C]
  last = from_start[..., -1] * (hb * dhb).sum((-3, -2, -1)) + c.sum(-1)
  dg = dg - c
  dg = dg.at[..., -1].add(last)

  # v_new = u - w S0
  dw = -einsum_f32("zyniv,zynkv->zynik", dvn, h.astype(f32))

  return (
    _to_time_major(dq),
    _to_time_major(dkk),
    dw.reshape(bsz, heads, t_len * r, dim_k),
    dg.reshape(bsz, heads, t_len),
  )


# ----------------------------------------------------------------------------------------------
# 4. the WY backward: through recompute_w_u, solve_tril and chunk_kkt
# ----------------------------------------------------------------------------------------------


def reduce_dmask(dmask_tok, mask_shape):
  """Per-token dmask [B,H,Tp,r,r] -> the mask's 5-D shape [Bm,Tm,Hm,r,r] (sum over broadcast)."""
  d = jnp.moveaxis(dmask_tok, 1, 2)  # [B,Tp,H,r,r]
  axes = tuple(i for i in range(3) if mask_shape[i] == 1 and d.shape[i] != 1)
  return d.sum(axes, keepdims=True).reshape(mask_shape)


def wy_bwd(k, v, beta, mask, gcum, ai, dw, du, chunk, w=None, u=None, seg=None):
  """Backward of (k, v, beta, mask, gcum) -> (w, u) = recompute_w_u(..., solve_tril(chunk_kkt)).

  k: [B,Tp,H,K]; v: [B,Tp,H,V]; beta, gcum: [B,H,Tp]; mask: [Bm,Tm,Hm,r,r];
  ai: [B,H,Tp*r,N] = (I + Ag)^-1; dw: [B,H,Tp*r,K]; du: [B,H,Tp*r,V];
  w, u: the forward's w = Ai W~, u = Ai U~ if at hand (else recomputed here from ai).
  Returns (dk [B,Tp,H,K], dv [B,Tp,H,V], dbeta [B,H,Tp], dmask [Bm,Tm,Hm,r,r] float32,
           dgcum [B,H,Tp] (before the reverse cumsum)), all float32.
  """
  bsz, t_len, heads, dim_k = k.shape
  dim_v = v.shape[-1]
  r = mask.shape[-1]
  dk = dim_k // r
  nt = t_len // chunk
  n = chunk * r
  kc = _blocks(k, chunk, r)  # [B,H,NT,C,r,dk]
  vc = head_major_chunks(v, chunk)  # [B,H,NT,C,V]
  mc = mask_chunks(mask, bsz, heads, t_len, chunk)  # [B,H,NT,C,r,r]
  bc = split_chunks(beta.astype(f32), chunk, 2)  # [B,H,NT,C]
  gc = split_chunks(gcum, chunk, 2)
  sc = seg_chunks(seg, chunk)
  eg = decay_from_start(gc, sc)
  aic = ai.astype(f32).reshape(bsz, heads, nt, n, n)
  dwc = dw.astype(f32).reshape(bsz, heads, nt, n, dim_k)
  duc = du.astype(f32).reshape(bsz, heads, nt, n, dim_v)

  # W~ (and w = Ai W~, u = Ai U~ unless given)
  kw = mc[..., :, :, :, None] * kc[..., :, None, :, :]  # [.., t, a, b, dk]
  w_tilde = (bc * eg)[..., None, None, None] * kw
  w_tilde = w_tilde.reshape(bsz, heads, nt, n, dim_k)
  if w is None:
    w = einsum_f32("zynij,zynjk->zynik", aic, w_tilde)
  else:
    w = w.astype(f32).reshape(bsz, heads, nt, n, dim_k)
  if u is None:
    u_tilde = jnp.broadcast_to(
      (bc[..., None] * vc)[..., :, None, :], (bsz, heads, nt, chunk, r, dim_v)
    )
    u = einsum_f32("zynij,zynjv->zyniv", aic, u_tilde.reshape(bsz, heads, nt, n, dim_v))
  else:
    u = u.astype(f32).reshape(bsz, heads, nt, n, dim_v)

  # through w = Ai W~, u = Ai U~
  dwt = einsum_f32("zynji,zynjk->zynik", aic, dwc)  # Ai^T dw, [.., N, K]
  dut = einsum_f32("zynji,zynjv->zyniv", aic, duc)  # Ai^T du, [.., N, V]
  dwt6 = dwt.reshape(bsz, heads, nt, chunk, r, r, dk)  # [.., t, a, b, dk]
  dut5 = dut.reshape(bsz, heads, nt, chunk, r, dim_v)
  kdw = (dwt6 * kc[..., :, None, :, :]).sum(-1)  # <dW~[(t,a),b], k_t^(b)>
  dk_out = (bc * eg)[..., None, None] * (mc[..., :, :, None] * dwt6).sum(-3)
  dv_out = bc[..., None] * dut5.sum(-2)
  dbeta = eg * (mc * kdw).sum((-2, -1)) + (dut5 * vc[..., None, :]).sum((-2, -1))
  dmask = (bc * eg)[..., None, None] * kdw
  dgc = (dwt * w_tilde).reshape(bsz, heads, nt, chunk, r * dim_k).sum(-1)

  # through Ai = (I + Ag)^-1: dAg = -Ai^T dAi Ai^T = -(dW~ w^T + dU~ u^T), token-strictly-lower
  dag = -(einsum_f32("zynik,zynjk->zynij", dwt, w) + einsum_f32("zyniv,zynjv->zynij", dut, u))
  dag = dag.reshape(bsz, heads, nt, chunk, r, chunk, r)  # [.., t, a, s, b]
  e = dag * chunk_decay(gc, False, sc)[..., :, None, :, None]  # zero unless t > s
  kk = einsum_f32("zyntbd,zynsbd->zyntsb", kc, kc)  # <k_t^(b), k_s^(b)>
  ekk = (e * kk[..., :, None, :, :]).sum(-2)  # sum_s: [.., t, a, b]
  dbeta = dbeta + (mc * ekk).sum((-2, -1))
  dmask = dmask + bc[..., None, None] * ekk
  f = bc[..., None, None] * (mc[..., :, :, None, :] * e).sum(-3)  # [.., t, s, b]
  dk_out = dk_out + (
    einsum_f32("zyntsb,zynsbd->zyntbd", f, kc) + einsum_f32("zyntsb,zyntbd->zynsbd", f, kc)
  )
  # gamma enters Ag through D: z[t,s] = sum_{a,b} (dAg * Ag)[(t,a),(s,b)] = sum_b F_b kk_b
  z = (f * kk).sum(-1)  # [.., t, s]
  dgc = dgc + z.sum(-1) - z.sum(-2)

  dmask = reduce_dmask(dmask.reshape(bsz, heads, t_len, r, r), mask.shape)
  return (
    _to_time_major(dk_out),
    _to_time_major(dv_out),
    dbeta.reshape(bsz, heads, t_len),
    dmask,
    dgc.reshape(bsz, heads, t_len),
  )


# ----------------------------------------------------------------------------------------------
# 5. the reverse cumsum
# ----------------------------------------------------------------------------------------------


def chunk_local_reverse_cumsum(dgcum, chunk):
  """dg_t = sum_{s >= t in t's chunk} dgcum_s: the vjp of `xla.chunk_local_cumsum`. [B,H,Tp]."""
  x = split_chunks(dgcum.astype(f32), chunk, 2)
  return jnp.flip(jnp.flip(x, -1).cumsum(-1), -1).reshape(dgcum.shape)
