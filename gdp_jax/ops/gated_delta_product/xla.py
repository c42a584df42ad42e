"""The chunked (WY) form (docs/chunked_form.md) in plain jnp: the `"xla"` implementation.

Each stage is the jnp counterpart of one Pallas kernel in `pallas_kernels/`, in the same array
layout, so the kernels are tested stage by stage against these functions: q, k [B, Tp, H, K]
(time-major, T padded to whole chunks), v [B, Tp, H, V], beta and gcum [B, H, Tp] float32
(head-major), the mask [Bm, Tm, Hm, r, r] (broadcast), A, Ai [B, H, Tp*r, N] (one N x N block
per chunk, N = chunk * r, rows (t, a) token-major), w [B, H, Tp*r, K], u, v_new [B, H, Tp*r, V],
h [B, H, NT, K, V] float32, o [B, Tp, H, V]. Everything is float32 at HIGHEST precision: the
ground truth, also on a GPU. Padding tokens (beta = 0, g = 0) are exact no-ops.

`gated_delta_product_xla` takes grouped value heads (q and k repeated across each group);
`gated_delta_product_xla_varlen` runs the same stages on the packed layout of varlen.py
(docs/varlen.md), with the state recurrence `chunk_state_varlen`.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from gdp_jax.ops.gated_delta_product import nonfinite, varlen
from gdp_jax.ops.gated_delta_product.base import (
  RESET_LOG_DECAY,
  GatedDeltaProductImplementation,
  packed_states,
)
from gdp_jax.ops.heads import expand_key_heads

HIGHEST = jax.lax.Precision.HIGHEST
f32 = jnp.float32


def einsum_f32(spec, *xs):
  return jnp.einsum(spec, *xs, precision=HIGHEST)


def split_chunks(x, chunk, axis):
  """Split `axis` (length Tp) into (Tp // chunk, chunk)."""
  shape = x.shape
  return x.reshape(shape[:axis] + (shape[axis] // chunk, chunk) + shape[axis + 1 :])


def head_major_chunks(x, chunk):
  """[B, Tp, H, D] -> [B, H, NT, chunk, D] float32."""
  x = jnp.moveaxis(x.astype(f32), 2, 1)
  return split_chunks(x, chunk, 2)


def mask_chunks(mask, batch, heads, t_len, chunk):
  """[Bm, Tm, Hm, r, r] -> [B, H, NT, chunk, r, r] float32 (broadcast)."""
  r = mask.shape[-1]
  mask = jnp.broadcast_to(mask.astype(f32), (batch, t_len, heads, r, r))
  return split_chunks(jnp.moveaxis(mask, 2, 1), chunk, 2)


def chunk_decay(gc, inclusive, seg=None):
  """exp(gamma_t - gamma_s) where s < t (s <= t if inclusive) and no reset lies in (s, t], else
  exactly 0: [..., C, C].

  The exponent is masked before `exp`, so no positive argument is ever exponentiated
  (docs/chunked_form.md#safe-exp). seg: the reset counts of `gate_cumsum` (None: no resets).
  """
  c = gc.shape[-1]
  t = jnp.arange(c)[:, None]
  s = jnp.arange(c)[None, :]
  causal = (t >= s) if inclusive else (t > s)
  if seg is not None:
    causal = causal & (seg[..., :, None] == seg[..., None, :])
  diff = gc[..., :, None] - gc[..., None, :]
  return jnp.exp(jnp.where(causal, diff, -jnp.inf))


def decay_from_start(gc, seg=None):
  """exp(gamma_t), the decay from the chunk's start to the end of token t: 0 after a reset."""
  if seg is None:
    return jnp.exp(gc)
  return jnp.exp(jnp.where(seg == 0, gc, -jnp.inf))


def decay_to_end(gc, seg=None):
  """exp(gamma_L - gamma_t), the decay from the end of token t to the chunk's end L: 0 when a
  reset lies in (t, L]."""
  diff = gc[..., -1:] - gc
  if seg is None:
    return jnp.exp(diff)
  return jnp.exp(jnp.where(seg == seg[..., -1:], diff, -jnp.inf))


# ----------------------------------------------------------------------------------------------
# Stages
# ----------------------------------------------------------------------------------------------


def chunk_local_cumsum(g, chunk):
  """gamma: the cumulative sum of g from each chunk's start (inclusive). g: [B, H, Tp]."""
  return split_chunks(g.astype(f32), chunk, 2).cumsum(-1).reshape(g.shape)


def resets(g):
  """True where g is a reset: g <= RESET_LOG_DECAY (g = -inf included)."""
  return g <= RESET_LOG_DECAY


def gate_cumsum(g, chunk):
  """(gamma, seg) with resets (docs/chunked_form.md#resets). g: [B, H, Tp] float32.

  gamma: the chunk-local cumsum of g with every reset counted as 0 (so gamma stays finite and
  exact: no -inf - (-inf)); seg: int32, the number of resets from the chunk's start up to each
  token (inclusive). A decay between two tokens of one chunk is exp(gamma_t - gamma_s) when
  seg_t == seg_s and exactly 0 otherwise; exp(gamma_t) counts only while seg_t == 0.
  """
  reset = resets(g)
  gcum = chunk_local_cumsum(jnp.where(reset, 0.0, g.astype(f32)), chunk)
  seg = split_chunks(reset.astype(jnp.int32), chunk, 2).cumsum(-1).reshape(g.shape)
  return gcum, seg


def chunk_kkt(k, beta, mask, gcum, chunk, seg=None):
  """A[(t,a),(s,b)] = beta_t M_t[a,b] <k_t^(b), k_s^(b)> exp(gamma_t - gamma_s), t > s, else 0.

  This is the gated chunk matrix `Ag` (docs/chunked_form.md#the-chunk-matrix-a); it is the
  only one the forward needs, since w = (I + Ag)^-1 (exp(gamma) W~) equals
  exp(gamma) (I + A)^-1 W~ (docs/chunked_form.md#one-inverse-for-w-and-u).
  seg: the reset counts of `gate_cumsum` (None: no resets). Returns [B, H, Tp*r, N] float32.
  """
  bsz, t_len, heads, dim_k = k.shape
  r = mask.shape[-1]
  kc = head_major_chunks(k, chunk).reshape(bsz, heads, t_len // chunk, chunk, r, dim_k // r)
  mc = mask_chunks(mask, bsz, heads, t_len, chunk)  # [B,H,NT,C,r,r]
  bc = split_chunks(beta.astype(f32), chunk, 2)  # [B,H,NT,C]
  dec = chunk_decay(split_chunks(gcum, chunk, 2), False, seg_chunks(seg, chunk))  # [B,H,NT,C,C]
  kk = einsum_f32("zyntbd,zynsbd->zyntsb", kc, kc)  # <k_t^(b), k_s^(b)>
  a = (
    bc[..., :, None, None, None]
    * mc[..., :, :, None, :]  # [B,H,NT,t,a,s,b]
    * (kk * dec[..., None])[..., :, None, :, :]
  )
  n = chunk * r
  return a.reshape(bsz, heads, t_len * r, n)


def _unit_lower_inverse(m):
  """m^-1 for unit lower-triangular m [..., n, n], by recursive 2 x 2 block inversion:
  [[M11, 0], [M21, M22]]^-1 = [[X11, 0], [-X22 M21 X11, X22]], with triangular solves for the
  blocks of at most 16 rows (the block merge of pallas_kernels/triton/forward/chunk_fwd.py). XLA's
  batched triangular solve on CPU is slow from 32 rows on; this keeps the work in batched
  matmuls."""
  n = m.shape[-1]
  if n <= 16:
    eye = jnp.broadcast_to(jnp.eye(n, dtype=m.dtype), m.shape)
    return jax.scipy.linalg.solve_triangular(m, eye, lower=True, unit_diagonal=True)
  h = n // 2
  x11 = _unit_lower_inverse(m[..., :h, :h])
  x22 = _unit_lower_inverse(m[..., h:, h:])
  x21 = -einsum_f32("...ij,...jk,...kl->...il", x22, m[..., h:, :h], x11)
  top = jnp.concatenate([x11, jnp.zeros(x11.shape[:-1] + (n - h,), m.dtype)], axis=-1)
  return jnp.concatenate([top, jnp.concatenate([x21, x22], axis=-1)], axis=-2)


def solve_tril(a, chunk_rows):
  """(I + A)^-1 for each strictly lower-triangular [N, N] chunk block. [B, H, Tp*r, N]."""
  bsz, heads, rows, n = a.shape
  assert n == chunk_rows
  blocks = a.reshape(bsz, heads, rows // n, n, n)
  inv = _unit_lower_inverse(jnp.eye(n, dtype=f32) + blocks)
  return inv.reshape(a.shape)


def seg_chunks(seg, chunk):
  return None if seg is None else split_chunks(seg, chunk, 2)


def _masked_keys(k, mask, chunk):
  """W~ / beta: row (t,a) = [M_t[a,0] k_t^(0), ..., M_t[a,r-1] k_t^(r-1)]. [B,H,NT,C,r,K]."""
  bsz, t_len, heads, dim_k = k.shape
  r = mask.shape[-1]
  kc = head_major_chunks(k, chunk).reshape(bsz, heads, t_len // chunk, chunk, r, dim_k // r)
  mc = mask_chunks(mask, bsz, heads, t_len, chunk)
  kw = mc[..., :, :, :, None] * kc[..., :, None, :, :]  # [.., t, a, d, dk]
  return kw.reshape(bsz, heads, t_len // chunk, chunk, r, dim_k)


def recompute_w_u(k, v, beta, mask, gcum, ai, chunk, seg=None):
  """w = Ai (exp(gamma) beta Kw), u = Ai (beta v) per chunk (docs/chunked_form.md#w-and-u)."""
  bsz, t_len, heads, dim_k = k.shape
  dim_v = v.shape[-1]
  r = mask.shape[-1]
  n = chunk * r
  nt = t_len // chunk
  bc = split_chunks(beta.astype(f32), chunk, 2)
  gc = split_chunks(gcum, chunk, 2)
  w_tilde = (bc * decay_from_start(gc, seg_chunks(seg, chunk)))[..., None, None] * _masked_keys(
    k, mask, chunk
  )
  u_tilde = bc[..., None, None] * head_major_chunks(v, chunk)[..., :, None, :]
  u_tilde = jnp.broadcast_to(u_tilde, (bsz, heads, nt, chunk, r, dim_v))
  aic = ai.reshape(bsz, heads, nt, n, n)
  w = einsum_f32("zynij,zynjk->zynik", aic, w_tilde.reshape(bsz, heads, nt, n, dim_k))
  u = einsum_f32("zynij,zynjv->zyniv", aic, u_tilde.reshape(bsz, heads, nt, n, dim_v))
  return w.reshape(bsz, heads, t_len * r, dim_k), u.reshape(bsz, heads, t_len * r, dim_v)


def _walk_chunks(k, w, u, gcum, chunk, seg):
  """The state walk's per-chunk inputs, chunk axis third: k [B, H, NT, C, r, dk], gcum and the
  reset counts seg [B, H, NT, C], w [B, H, NT, N, K], u [B, H, NT, N, V] (float32)."""
  bsz, t_len, heads, dim_k = k.shape
  r = w.shape[2] // t_len
  nt, n = t_len // chunk, chunk * r
  kc = head_major_chunks(k, chunk).reshape(bsz, heads, nt, chunk, r, dim_k // r)
  gc = split_chunks(gcum, chunk, 2)
  sc = split_chunks(jnp.zeros(gcum.shape, jnp.int32) if seg is None else seg, chunk, 2)
  wc = w.astype(f32).reshape(bsz, heads, nt, n, dim_k)
  uc = u.astype(f32).reshape(bsz, heads, nt, n, u.shape[-1])
  return kc, gc, sc, wc, uc


def _walk_step(state, k_c, g_c, s_c, w_c, u_c):
  """One chunk of the state walk: (the state after it, v_new [B, H, N, V]) from the state
  entering it (docs/chunked_form.md#the-state-update-and-the-output)."""
  bsz, heads, chunk, r, _ = k_c.shape
  v_new = u_c - einsum_f32("zyik,zykv->zyiv", w_c, state)  # [B,H,N,V]
  k_dec = k_c * decay_to_end(g_c, s_c)[..., None, None]
  upd = einsum_f32("zytad,zytav->zyadv", k_dec, v_new.reshape(bsz, heads, chunk, r, -1))
  decay = decay_from_start(g_c, s_c)[..., -1]  # exp(gamma_L)
  return decay[..., None, None] * state + upd.reshape(state.shape), v_new


def chunk_state(k, w, u, gcum, initial_state, chunk, state_chunk, seg=None):
  """The state recurrence over chunks (docs/chunked_form.md#the-state-update-and-the-output).

  Runs over chunks of `chunk` tokens (`gcum` is their local cumsum) and keeps the state at the
  start of every `state_chunk` tokens (a multiple of `chunk`): the Pallas kernel solves small WY
  chunks but stores states only per output chunk. seg: the reset counts of `gate_cumsum`
  (None: no resets).
  Returns h [B, H, Tp/state_chunk, K, V], v_new [B, H, Tp*r, V], final state [B, H, K, V].
  """
  bsz, t_len, heads, _ = k.shape
  dim_v = u.shape[-1]
  r = w.shape[2] // t_len
  nt = t_len // chunk
  per = state_chunk // chunk
  kc, gc, sc, wc, uc = _walk_chunks(k, w, u, gcum, chunk, seg)
  one_chunk = lambda state, xs: _walk_step(state, *xs)

  def one_state_chunk(state, xs):
    start = state
    outs = []
    for j in range(per):
      state, v_new = one_chunk(state, tuple(x[j] for x in xs))
      outs.append(v_new)
    return state, (start, jnp.stack(outs))

  # scan axis first: [NT/per, per, ...]
  def scan_major(x):
    x = jnp.moveaxis(x, 2, 0)
    return x.reshape((nt // per, per) + x.shape[1:])

  xs = tuple(scan_major(x) for x in (kc, gc, sc, wc, uc))
  final, (h, v_new) = jax.lax.scan(one_state_chunk, initial_state.astype(f32), xs)
  h = jnp.moveaxis(h, 0, 2)  # [B,H,NTs,K,V]
  v_new = v_new.reshape((nt,) + v_new.shape[2:])  # [NT,B,H,N,V]
  v_new = jnp.moveaxis(v_new, 0, 2).reshape(bsz, heads, t_len * r, dim_v)
  return h, v_new, final


def chunk_state_varlen(k, w, u, gcum, start_states, first, chunk, seg=None):
  """`chunk_state` over packed sequences (docs/varlen.md), one state per chunk of `chunk`
  tokens: at a chunk where `first` [NT] (bool) is set, the state entering it is replaced by
  `start_states` [NT, B, H, K, V] (its sequence's initial state; B = 1 in the packed layout).
  Returns h [B, H, NT, K, V] (the state each chunk starts from, after the replacement),
  v_new [B, H, Tp*r, V] and ends [B, H, NT, K, V] (the state after each chunk), from which
  `varlen.final_states` reads every sequence's final state.
  """
  bsz, t_len, heads, _ = k.shape
  dim_v = u.shape[-1]
  r = w.shape[2] // t_len
  kc, gc, sc, wc, uc = _walk_chunks(k, w, u, gcum, chunk, seg)

  def one_chunk(state, xs):
    *chunk_xs, start, is_first = xs
    state = jnp.where(is_first, start, state)
    end, v_new = _walk_step(state, *chunk_xs)
    return end, (state, v_new, end)

  xs = tuple(jnp.moveaxis(x, 2, 0) for x in (kc, gc, sc, wc, uc))
  xs = xs + (start_states.astype(f32), first)
  _, (h, v_new, ends) = jax.lax.scan(one_chunk, jnp.zeros_like(start_states[0], f32), xs)
  v_new = jnp.moveaxis(v_new, 0, 2).reshape(bsz, heads, t_len * r, dim_v)
  return jnp.moveaxis(h, 0, 2), v_new, jnp.moveaxis(ends, 0, 2)


def chunk_output(q, k, v_new, h, gcum, scale, chunk, seg=None):
  """o_t = scale (exp(g_t) q_t^T S0
                 + sum_{s<=t} sum_a exp(g_t - g_s) <q_t^(a), k_s^(a)> v_new[(s,a)]).

  `chunk` here is the state chunk (h holds one state per chunk); seg: the reset counts of
  `gate_cumsum` (None: no resets). Returns [B, Tp, H, V] float32.
  """
  bsz, t_len, heads, dim_k = q.shape
  dim_v = v_new.shape[-1]
  r = v_new.shape[2] // t_len
  nt = t_len // chunk
  qc = head_major_chunks(q, chunk)
  kc = head_major_chunks(k, chunk)
  gc = split_chunks(gcum, chunk, 2)
  vc = v_new.astype(f32).reshape(bsz, heads, nt, chunk, r, dim_v)
  sc = seg_chunks(seg, chunk)
  inter = decay_from_start(gc, sc)[..., None] * einsum_f32("zyntk,zynkv->zyntv", qc, h)
  qk = einsum_f32(
    "zyntad,zynsad->zyntsa",
    qc.reshape(qc.shape[:-1] + (r, dim_k // r)),
    kc.reshape(kc.shape[:-1] + (r, dim_k // r)),
  )
  qk = qk * chunk_decay(gc, True, sc)[..., None]
  intra = einsum_f32("zyntsa,zynsav->zyntv", qk, vc)
  o = scale * (inter + intra)  # [B,H,NT,C,V]
  return jnp.moveaxis(o.reshape(bsz, heads, t_len, dim_v), 1, 2)


# ----------------------------------------------------------------------------------------------
# The whole forward
# ----------------------------------------------------------------------------------------------


def to_head_major(x):
  """[B, T, H] -> [B, H, T] float32."""
  return jnp.moveaxis(x.astype(f32), 1, 2)


def gated_delta_product_xla(q, k, v, g, beta, mask, initial_state, scale, chunk_size):
  """The chunked form over already padded inputs (Tp % chunk_size == 0).

  q, k: [B, Tp, H, K]; v: [B, Tp, HV, V]; g, beta: [B, Tp, HV]; mask: [Bm, Tm, Hm, r, r]
  (Hm in {1, HV}); initial_state [B, HV, K, V]; HV a multiple of H (grouped value heads).
  Returns (o [B, Tp, HV, V] float32, final_state [B, HV, K, V] float32).

  Causal under non-finite inputs: a nan or inf at token t leaves every output before t (and the
  gradients of a loss on them) as without it (gdp_jax/ops/gated_delta_product/nonfinite.py); g <=
  RESET_LOG_DECAY (g = -inf included) is an exact reset (`gate_cumsum`).
  """
  q, k = (expand_key_heads(x, v.shape[2]) for x in (q, k))
  (q, k, v, g, beta, mask), marks = nonfinite.clean(q, k, v, g, beta, mask)
  o, final = chunked_forward(q, k, v, g, beta, mask, initial_state, scale, chunk_size)
  return nonfinite.mark(o, final, marks)


def chunked_forward(q, k, v, g, beta, mask, initial_state, scale, chunk_size):
  """The chunked form on finite inputs (resets allowed): `gated_delta_product_xla` without the
  non-finite handling."""
  r = mask.shape[-1]
  gcum, seg = gate_cumsum(to_head_major(g), chunk_size)
  beta_hm = to_head_major(beta)
  a = chunk_kkt(k, beta_hm, mask, gcum, chunk_size, seg)
  ai = checkpoint_name(solve_tril(a, chunk_size * r), "gdp_chunk_inverses")
  w, u = recompute_w_u(k, v, beta_hm, mask, gcum, ai, chunk_size, seg)
  h, v_new, final = chunk_state(k, w, u, gcum, initial_state, chunk_size, chunk_size, seg)
  h, v_new = checkpoint_name(h, "gdp_chunk_states"), checkpoint_name(v_new, "gdp_new_values")
  o = chunk_output(q, k, v_new, h, gcum, scale, chunk_size, seg)
  return o, final


# The arrays `Saving` keeps for the backward: all else is computed again from them and the inputs.
SAVED = ("gdp_chunk_inverses", "gdp_chunk_states", "gdp_new_values")


@dataclasses.dataclass(frozen=True)
class Saving:
  """An implementation (`run(q, k, v, g, beta, mask, initial_state, scale, chunk_size)`) under
  `jax.checkpoint` saving only the named arrays of `chunked_forward` (`SAVED`): its pullback's
  residuals are those and the inputs, laid out as this file lays them out whatever the sizes
  (JAX's own residuals of jnp code change with sizes of 1, e.g. a block of one batch row).
  o comes out in q's dtype, as from the context-parallel pieces (the caller casts it anyway)."""

  run: object

  def __call__(self, q, k, v, g, beta, mask, initial_state, scale, chunk_size):
    policy = jax.checkpoint_policies.save_only_these_names(*SAVED)
    body = lambda *a: self.run(*a, scale, chunk_size)
    o, final = jax.checkpoint(body, policy=policy)(q, k, v, g, beta, mask, initial_state)
    return o.astype(q.dtype), final

  def time_multiple(self, chunk_size, key_blocks):
    return self.run.time_multiple(chunk_size, key_blocks)


def gated_delta_product_xla_varlen(
  q, k, v, g, beta, mask, initial_state, scale, chunk_size, cu_seqlens
):
  """Packed sequences (docs/varlen.md): q, k [1, T, H, K]; v [1, T, HV, V]; g, beta [1, T, HV];
  mask [1, Tm, Hm, r, r]; initial_state [N, HV, K, V] float32; cu_seqlens [N + 1] int (T not
  padded). Returns (o [1, T, HV, V] float32, final [N, HV, K, V] float32).

  The inputs are cleaned (`varlen.clean`: a non-finite input spoils its own sequence only) and
  packed into the chunk-aligned layout (`varlen.layout`: each sequence from a chunk boundary,
  zeros between); the chunked stages run on it unchanged except the state recurrence
  (`chunk_state_varlen`), and the outputs are gathered back.
  """
  t_len = q.shape[1]
  q, k = (expand_key_heads(x, v.shape[2]) for x in (q, k))
  lay = varlen.layout(cu_seqlens, t_len, chunk_size)
  (q, k, v, g, beta, mask), marks = varlen.clean(q, k, v, g, beta, mask, lay.cu_seqlens)
  q, k, v, g, beta = (varlen.pack(x, lay) for x in (q, k, v, g, beta))
  if mask.shape[1] != 1:
    mask = varlen.pack(mask, lay)
  o, final = chunked_forward_varlen(q, k, v, g, beta, mask, initial_state, scale, lay)
  return nonfinite.mark(varlen.unpack(o, lay), final, marks)


def chunked_forward_varlen(q, k, v, g, beta, mask, initial_state, scale, lay):
  """The chunked form on packed, finite inputs [1, T_pad, ...] (`varlen.pack`) with the layout
  `lay`; initial_state [N, H, K, V]. Returns (o [1, T_pad, H, V], final [N, H, K, V])."""
  chunk = lay.chunk
  r = mask.shape[-1]
  gcum, seg = gate_cumsum(to_head_major(g), chunk)
  beta_hm = to_head_major(beta)
  a = chunk_kkt(k, beta_hm, mask, gcum, chunk, seg)
  ai = solve_tril(a, chunk * r)
  w, u = recompute_w_u(k, v, beta_hm, mask, gcum, ai, chunk, seg)
  starts = varlen.chunk_initial_states(initial_state, lay)[:, None]  # [NT, 1, H, K, V]
  h, v_new, ends = chunk_state_varlen(k, w, u, gcum, starts, lay.chunk_first, chunk, seg)
  o = chunk_output(q, k, v_new, h, gcum, scale, chunk, seg)
  final = varlen.final_states(jnp.moveaxis(ends[0], 1, 0), initial_state, lay)
  return o, final


@dataclasses.dataclass(frozen=True)
class XlaGatedDeltaProduct(GatedDeltaProductImplementation):
  """The chunked WY form in jnp, float32 at HIGHEST precision; JAX differentiates it."""

  name: ClassVar[str] = "xla"
  summary: ClassVar[str] = "the chunked WY form and the steps in jnp (any backend)"

  def __call__(self, q, k, v, g, beta, mask, initial_state, scale, chunk_size):
    return gated_delta_product_xla(q, k, v, g, beta, mask, initial_state, scale, chunk_size)

  def varlen(self, q, k, v, g, beta, mask, initial_state, scale, chunk_size, cu_seqlens):
    initial_state = packed_states(initial_state, q, v, cu_seqlens)
    return gated_delta_product_xla_varlen(
      q, k, v, g, beta, mask, initial_state, scale, chunk_size, cu_seqlens
    )
