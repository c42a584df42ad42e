"""The fused intra-chunk forward (docs/kernels.md#chunk_fwd-everything-inside-one-chunk): one
program per (chunk, batch, head) does the chunk-local cumsum of g, the chunk KKT, its unit
lower-triangular inverse and the w/u products, keeping A and its inverse in registers.

Rows of the chunk matrices are in (t, a) order (rows.py), cut in blocks of 16 rows. The inverse
is forward substitution on each diagonal block and block merges below it
(docs/chunked_form.md#the-inverse-by-16-row-blocks); w carries exp(gamma), so no exp of a
positive argument is formed. Row blocks are loaded from their refs with `pl.ds`
(docs/pallas_triton.md). Up to LOOP_ROWS rows the blocks are unrolled (`_blocks_kernel`); from
there (r = 8) they run in a `fori_loop` (`_loop_kernel`; docs/performance.md#compile-time).
Packed sequences in place (`table=`, docs/varlen.md#the-pallas-kernels): the chunk's tokens are
read from the packed row with masked loads (packed.py `ChunkRows`), the rows past its sequence's
end as zeros, so the results are exactly those of the chunk-aligned copy.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.common import backend, options, packed, rows, specs, tril

BLOCK = 16
CHUNKS = (16, 32, 64)
MAX_ROWS = 256
f32 = jnp.float32


class _Chunk:
  """Loads of one chunk's row blocks from the refs (every block straight from its ref)."""

  def __init__(self, k_ref, v_ref, beta_ref, mask_ref, r, per_token_mask):
    self.k_ref, self.v_ref, self.beta_ref, self.mask_ref = k_ref, v_ref, beta_ref, mask_ref
    self.r = r
    self.tb = BLOCK // r  # tokens per 16-row block
    self.per_token_mask = per_token_mask
    self.dtype = k_ref.dtype

  def toks(self, i):
    return pl.ds(i * self.tb, self.tb)

  def mask_rows(self, i):
    """The mask tile's rows for block i (all of it when the mask is not per token)."""
    return self.toks(i) if self.per_token_mask else slice(None)

  def beta(self, i):
    """beta per row of block i: [16] float32."""
    return rows.per_row(self.beta_ref[self.toks(i)].astype(f32), self.r)

  def masked_keys(self, i):
    """Kw_i, the masked keys of block i: [16, K] float32."""
    return rows.masked_keys(self.k_ref[self.toks(i), :], self.mask_ref, self.r, self.mask_rows(i))

  def block_keys(self, i):
    """Kb_i, the block keys of block i: [16, K] float32."""
    return rows.block_keys(self.k_ref[self.toks(i), :], self.r)

  def w_rhs(self, i, gamma_i):
    """exp(gamma) beta Kw for block i, in the input dtype: [16, K]."""
    scale = jnp.exp(gamma_i) * self.beta(i)
    return (scale[:, None] * self.masked_keys(i)).astype(self.dtype)

  def u_rhs(self, i):
    """beta v for block i (each token's row repeated r times), in the input dtype: [16, V]."""
    bv = self.beta_ref[self.toks(i)].astype(f32)[:, None] * self.v_ref[self.toks(i), :].astype(f32)
    return rows.repeat_rows(bv.astype(self.dtype), self.r)


# Diagonal-inverse methods: forward substitution, or repeated squaring with its six products as
# three TF32 products on the tensor cores ("squaring-x3", close to float32) or as one TF32
# product ("squaring-tf32", for half inputs).
SQUARING_PRECISION = {"squaring-x3": "tf32x3", "squaring-tf32": "tf32"}
INVERSES = ("auto", "substitution", *SQUARING_PRECISION)
# "auto": squaring at the kernel's float32 precision where that runs on the tensor cores, forward
# substitution for "ieee" (docs/kernels.md#chunk_fwd-everything-inside-one-chunk).
AUTO_INVERSE = {"tf32": "squaring-tf32", "tf32x3": "squaring-x3", "ieee": "substitution"}


def _invert_diagonal(a_blocks, method="substitution"):
  """(I + A_ii)^-1 of strictly lower [16, 16] float32 tiles, in registers.

  methods "squaring*": (I - A)(I + A^2)(I + A^4)(I + A^8), six small products per block at the
  method's precision (SQUARING_PRECISION; pallas_kernels/common/tril.py). method "substitution":
  forward substitution, below.

  With X = I + Y: Y[j] = -A[j] + sum_{k<j} (-A[j, k]) Y[k]. Y starts as -A, so row j of Y still
  holds -A[j] when step j picks it (jnp.where on the row index + sum: no slicing). Rows 0 and 1
  are already final. All blocks advance in the same loop (independent work for the scheduler).
  """
  if method in SQUARING_PRECISION:
    precision = SQUARING_PRECISION[method]
    return [tril.unit_lower_inverse(a, precision=precision) for a in a_blocks]
  idx = jax.lax.broadcasted_iota(jnp.int32, (BLOCK, BLOCK), 0)
  col = jax.lax.broadcasted_iota(jnp.int32, (BLOCK, BLOCK), 1)

  def body(j, ys):
    out = []
    for y in ys:
      row = jnp.sum(jnp.where(idx == j, y, 0.0), axis=0)  # -A[j], zero from column j
      row = row + jnp.sum(row[:, None] * y, axis=0)
      out.append(jnp.where(idx == j, row[None, :], y))
    return tuple(out)

  ys = jax.lax.fori_loop(2, BLOCK, body, tuple(-a for a in a_blocks))
  eye = (idx == col).astype(f32)
  return [y + eye for y in ys]


def _blocks_kernel(
  k_ref,
  v_ref,
  g_ref,
  beta_ref,
  mask_ref,
  gamma_ref,
  w_ref,
  u_ref,
  *ai_ref,
  r,
  per_token_mask,
  precision,
  inverse,
):
  """Every product on [16, 16] blocks; X kept as its lower-triangular blocks."""
  bt = k_ref.shape[0]
  nb = bt * r // BLOCK
  c = _Chunk(k_ref, v_ref, beta_ref, mask_ref, r, per_token_mask)
  dtype = c.dtype
  dot = functools.partial(backend.dot, precision=precision)
  local = jax.lax.broadcasted_iota(jnp.int32, (BLOCK,), 0) // r  # token of each row in a block
  blk = lambda i: pl.ds(i * BLOCK, BLOCK)

  # gamma: chunk-local cumsum of g, block by block with a running prefix.
  gammas = []  # per row, [16] each
  prefix = jnp.zeros((), f32)
  for i in range(nb):
    g = g_ref[c.toks(i)].astype(f32)
    gam = prefix + jnp.cumsum(g)
    prefix = prefix + jnp.sum(g)
    gamma_ref[c.toks(i)] = gam
    gammas.append(rows.per_row(gam, r))

  def a_block(kw_i, i, kb_j, j):
    """A_ij, gated and token-strictly causal: [16, 16] float32."""
    decay = rows.causal_decay(gammas[i], gammas[j], local + i * c.tb, local + j * c.tb, strict=True)
    kk = dot(kw_i.astype(dtype), kb_j.astype(dtype), trans_b=True)
    return c.beta(i)[:, None] * kk * decay

  # Diagonal blocks and their inverses.
  diag = []
  for i in range(nb):
    diag.append(a_block(c.masked_keys(i), i, c.block_keys(i), i))
  x = {(i, i): xi for i, xi in enumerate(_invert_diagonal(diag, inverse))}
  del diag

  # Row blocks: merge (X_ij for j < i), then w_i, u_i (and the row of Ai).
  half = dtype != f32
  for i in range(nb):
    if i:
      kw_i = c.masked_keys(i)
      a_row = [a_block(kw_i, i, c.block_keys(k), k) for k in range(i)]
      for j in range(i - 1, -1, -1):
        acc = None
        for k in range(j, i):
          term = dot(a_row[k], x[k, j])
          acc = term if acc is None else acc + term
        x[i, j] = -dot(x[i, i], acc)
      del a_row
    w_acc = u_acc = None
    for j in range(i + 1):
      xij = x[i, j].astype(dtype) if half else x[i, j]
      tw = dot(xij, c.w_rhs(j, gammas[j]))
      tu = dot(xij, c.u_rhs(j))
      w_acc = tw if w_acc is None else w_acc + tw
      u_acc = tu if u_acc is None else u_acc + tu
    w_ref[blk(i), :] = w_acc.astype(w_ref.dtype)
    u_ref[blk(i), :] = u_acc.astype(u_ref.dtype)
    if ai_ref:
      zeros = jnp.zeros((BLOCK, BLOCK), ai_ref[0].dtype)
      for j in range(nb):
        ai_ref[0][blk(i), blk(j)] = x[i, j].astype(ai_ref[0].dtype) if j <= i else zeros


# form="auto": from this many rows (r = 8: 16 tokens x 8 rows) the row blocks run in a loop
# (`_loop_kernel`): unrolled (`_blocks_kernel`), the merge's block products grow as nb^3 (220
# products at nb = 8, a 40,000-line Triton module that took minutes to compile;
# docs/performance.md#compile-time). Read at each call (benchmarks/compile_profile.py tries 64).
LOOP_ROWS = 128
FORMS = ("auto", "blocks", "loop")


def _token_rows(x, i, tb):
  """Tokens i * tb ... i * tb + tb - 1 of a per-token [BT] value, exactly (a one-hot sum: the
  Triton lowering cannot slice a value at a traced offset): [tb]."""
  bt = x.shape[0]
  want = jax.lax.broadcasted_iota(jnp.int32, (tb, bt), 0) + i * tb
  have = jax.lax.broadcasted_iota(jnp.int32, (tb, bt), 1)
  return jnp.sum(jnp.where(want == have, x[None, :], 0.0), axis=1)


def _loop_kernel(
  k_ref,
  v_ref,
  g_ref,
  beta_ref,
  mask_ref,
  gamma_ref,
  w_ref,
  u_ref,
  *ai_ref,
  r,
  per_token_mask,
  precision,
  inverse,
):
  """The same outputs as `_blocks_kernel`, with the row blocks in a `fori_loop` (one copy of
  the loop body in the Triton module, whatever nb). X is carried as one [N, N] tile (the row
  blocks not done yet are zero), so row block i's merge is one product with the whole of it:

    X_i,<i = -X_ii (A_i,<i X),   w_i = X_i,: (exp(gamma) beta Kw),   u_i = X_i,: (beta v)

  with A_i,: = beta_i M (Kw_i Kb^T) exp(gamma_i - gamma) (token-strictly causal) a [16, N] row.
  The whole chunk's keys, values and gamma are reloaded in each step (not held across the loop:
  registers). The diagonal block X_ii is placed into the row exactly (a select, no product)."""
  bt = k_ref.shape[0]
  n = bt * r
  nb = n // BLOCK
  c = _Chunk(k_ref, v_ref, beta_ref, mask_ref, r, per_token_mask)
  dtype = c.dtype
  dot = functools.partial(backend.dot, precision=precision)
  whole = pl.ds(0, bt)
  local = jax.lax.broadcasted_iota(jnp.int32, (BLOCK,), 0) // r  # token of each row in a block
  tok_all = rows.row_tokens(n, r)
  col_block = jax.lax.broadcasted_iota(jnp.int32, (BLOCK, n), 1) // BLOCK
  row_block = jax.lax.broadcasted_iota(jnp.int32, (n, n), 0) // BLOCK
  half = dtype != f32

  gamma_ref[whole] = jnp.cumsum(g_ref[whole].astype(f32))  # chunk-local cumsum of g

  def body(i, x):
    gam = jnp.cumsum(g_ref[whole].astype(f32))  # [BT], as stored above
    gam_all = rows.per_row(gam, r)  # [N]
    gam_i = rows.per_row(_token_rows(gam, i, c.tb), r)  # [16]
    beta_i = c.beta(i)
    kw_i = c.masked_keys(i)
    kb_i = c.block_keys(i)
    k_all = k_ref[whole, :]
    kb_all = rows.block_keys(k_all, r)  # [N, K]
    tok_i = local + i * c.tb
    # A_i,: (token-strictly causal: zero from the diagonal block's own tokens on) and A_ii.
    decay = rows.causal_decay(gam_i, gam_all, tok_i, tok_all, strict=True)
    a_row = beta_i[:, None] * dot(kw_i.astype(dtype), kb_all.astype(dtype), trans_b=True) * decay
    decay_ii = rows.causal_decay(gam_i, gam_i, tok_i, tok_i, strict=True)
    a_ii = beta_i[:, None] * dot(kw_i.astype(dtype), kb_i.astype(dtype), trans_b=True) * decay_ii
    (x_ii,) = _invert_diagonal([a_ii], inverse)
    # X_i,: = -X_ii (A_i,<i X) + X_ii at column block i.
    merged = dot(x_ii, dot(jnp.where(col_block < i, a_row, 0.0), x))
    x_ii_tiled = jnp.broadcast_to(x_ii[:, None, :], (BLOCK, nb, BLOCK)).reshape(BLOCK, n)
    x_row = jnp.where(col_block == i, x_ii_tiled, -merged)
    # w_i, u_i from the whole chunk's right-hand sides [N, K] and [N, V].
    beta_all = rows.per_row(beta_ref[whole].astype(f32), r)
    kw_all = rows.masked_keys(k_all, mask_ref, r, whole if per_token_mask else slice(None))
    w_rhs = ((jnp.exp(gam_all) * beta_all)[:, None] * kw_all).astype(dtype)
    bv = beta_ref[whole].astype(f32)[:, None] * v_ref[whole, :].astype(f32)
    u_rhs = rows.repeat_rows(bv.astype(dtype), r)
    x_op = x_row.astype(dtype) if half else x_row
    rows_i = pl.ds(i * BLOCK, BLOCK)
    w_ref[rows_i, :] = dot(x_op, w_rhs).astype(w_ref.dtype)
    u_ref[rows_i, :] = dot(x_op, u_rhs).astype(u_ref.dtype)
    if ai_ref:
      ai_ref[0][rows_i, :] = x_row.astype(ai_ref[0].dtype)
    x_rows = jnp.broadcast_to(x_row[None], (nb, BLOCK, n)).reshape(n, n)
    return jnp.where(row_block == i, x_rows, x)

  jax.lax.fori_loop(0, nb, body, jnp.zeros((n, n), f32))


def _in_place(kernel, chunk):
  """`kernel` on whole-row refs k, v [T, D] and g, beta [T] of the packed row and a per-chunk
  table [2, NT] (the last input): program c's chunk starts at token table[0, c] and holds
  table[1, c] tokens; the kernel sees them as its chunk's blocks (`packed.ChunkRows`). The Triton
  lowering has no scalar prefetch, so the offset is read inside the kernel, not by index maps."""

  def run(k_ref, v_ref, g_ref, beta_ref, mask_ref, table_ref, *out_refs, **kw):
    c = pl.program_id(0)
    start, valid = table_ref[0, c], table_ref[1, c]
    view = lambda ref: packed.ChunkRows(ref, start, valid, chunk)
    return kernel(view(k_ref), view(v_ref), view(g_ref), view(beta_ref), mask_ref, *out_refs, **kw)

  return run


def _divides(k, v):
  """k's key heads divide v's value heads (grouped value heads)."""
  return k.shape[2] > 0 and v.shape[2] % k.shape[2] == 0


def _check(k, v, g, beta, mask, key_blocks, chunk, in_place=False):
  if k.ndim != 4 or v.ndim != 4 or k.shape[:2] != v.shape[:2] or not _divides(k, v):
    raise ValueError(
      f"k must be [B, Tp, H, K] and v [B, Tp, HV, V] with the same B, Tp and HV a multiple of "
      f"H; got k {k.shape}, v {v.shape}"
    )
  bsz, t_len, _, dim_k = k.shape
  heads, dim_v = v.shape[2:]
  for name, x in (("g", g), ("beta", beta)):
    if x.shape != (bsz, heads, t_len):
      raise ValueError(f"{name} must be [B, H, Tp] = {(bsz, heads, t_len)}, got {x.shape}")
  r = key_blocks
  if mask.ndim != 5 or mask.shape[-2:] != (r, r):
    raise ValueError(f"mask must be [Bm, Tm, Hm, r, r] with r = key_blocks = {r}, got {mask.shape}")
  if chunk not in CHUNKS:
    raise ValueError(f"chunk must be one of {CHUNKS}, got {chunk!r}")
  if r not in (1, 2, 4, 8):
    raise ValueError(
      f"key_blocks must be 1, 2, 4 or 8 (a 16-row block must hold whole tokens; "
      f"r = 16 is not supported), got {r!r}"
    )
  if chunk * r > MAX_ROWS:
    raise ValueError(f"chunk * key_blocks = {chunk} * {r} rows exceeds {MAX_ROWS}")
  if t_len % chunk and not in_place:
    raise ValueError(f"Tp = {t_len} must be a multiple of chunk = {chunk}")
  dk = dim_k // r
  if dim_k % r or dk < 16 or dk & (dk - 1) or dim_v < 16 or dim_v & (dim_v - 1):
    raise ValueError(
      f"K / key_blocks and V must be powers of two >= 16 (pad them); got K = "
      f"{dim_k}, key_blocks = {r}, V = {dim_v}"
    )


def chunk_fwd(
  k,
  v,
  g,
  beta,
  mask,
  *,
  key_blocks,
  chunk,
  precision="tf32",
  save_ai=False,
  inverse="auto",
  launch=options.DEFAULT.chunk_fwd,
  table=None,
  form="auto",
):
  """The fused intra-chunk forward.

  k [B, Tp, H, K], v [B, Tp, H, V] (K / key_blocks and V powers of two >= 16); g (the raw
  log-decay, not its cumsum), beta [B, H, Tp] float32; mask [Bm, Tm, Hm, r, r] (broadcast
  against [B, Tp, H, r, r]); key_blocks = r in {1, 2, 4, 8}; chunk = BT in {16, 32, 64} tokens
  with N = BT * r <= 256 rows. `precision` is for float32 dots (backend.dot): the merge of the
  inverse's blocks always, everything when the inputs are float32. Grouped value heads
  (docs/varlen.md#grouped-value-heads): k may have H / group key heads for the H heads of v, g
  and beta (value head h reads key head h // group; k is not repeated); the outputs have H.

  Returns gamma [B, H, Tp] float32 (chunk-local cumsum of g), w [B, H, Tp*r, K] and
  u [B, H, Tp*r, V] in k's dtype, and with save_ai=True also Ai = (I + A)^-1 [B, H, Tp*r, N] in
  k's dtype (the backward's residual).

  inverse: how the 16 x 16 diagonal blocks are inverted: "auto" (AUTO_INVERSE: by the
  precision), "substitution" (forward substitution, one row per step) or by repeated squaring
  ("squaring-x3", "squaring-tf32": six products at TF32 x 3 or TF32 precision;
  pallas_kernels/common/tril.py).
  launch: warps and pipeline stages (pallas_kernels/common/options.py).
  form: "blocks" (every block product unrolled), "loop" (the row blocks in a `fori_loop`, X one
  [N, N] tile: a Triton module of one row block's size) or "auto" ("loop" from LOOP_ROWS rows).

  table: None, or packed sequences read in place (docs/varlen.md#the-pallas-kernels, B = 1):
  int32 [2, NT] (`varlen.chunk_tokens`), each chunk's first token in the packed row and its number
  of tokens. k, v, g and beta are then the packed row (T any length, [1, H, T] for g and beta)
  and the outputs are in the chunk-aligned layout of Tp = C * NT tokens; a per-token mask is
  [1, Tp, Hm, r, r] in that layout (read per chunk as without a table).
  """
  in_place = table is not None
  _check(k, v, g, beta, mask, key_blocks, chunk, in_place)
  if inverse not in INVERSES:
    raise ValueError(f"inverse must be one of {INVERSES}, got {inverse!r}")
  if inverse == "auto":
    inverse = AUTO_INVERSE[precision]
  if form not in FORMS:
    raise ValueError(f"form must be one of {FORMS}, got {form!r}")
  bsz, t_len, key_heads, dim_k = k.shape
  heads, dim_v = v.shape[2:]
  r = key_blocks
  n = chunk * r
  per_token_mask = mask.shape[1] > 1
  tokens = t_len  # the tokens of k, v, g and beta (the packed row's when in place)
  if in_place:
    t_len = chunk * table.shape[-1]  # the chunk-aligned layout's
    if table.ndim != 2 or table.shape[0] != 2 or bsz != 1:
      raise ValueError(
        f"table must be int32 [2, NT] (varlen.chunk_tokens) with B = 1, got {table.shape} with "
        f"B = {bsz}"
      )
    if per_token_mask and mask.shape[1] != t_len:
      raise ValueError(
        f"a per-token mask must be [1, Tp, Hm, r, r] in the chunk-aligned layout, Tp = C * NT = "
        f"{t_len}, got {mask.shape}"
      )
  out_specs = [specs.scalars(chunk), specs.rows(n, dim_k), specs.rows(n, dim_v)]
  out_shape = [
    jax.ShapeDtypeStruct((bsz, heads, t_len), f32),
    jax.ShapeDtypeStruct((bsz, heads, t_len * r, dim_k), k.dtype),
    jax.ShapeDtypeStruct((bsz, heads, t_len * r, dim_v), k.dtype),
  ]
  if save_ai:
    out_specs.append(specs.rows(n, n))
    out_shape.append(jax.ShapeDtypeStruct((bsz, heads, t_len * r, n), k.dtype))
  looped = form == "loop" or (form == "auto" and n >= LOOP_ROWS)
  num_warps = launch.num_warps
  if looped:  # X ([N, N] float32) is carried across the loop: at most 64 registers a thread
    num_warps = max(num_warps, min(8, n * n // (32 * 64)))
  kernel = functools.partial(
    _loop_kernel if looped else _blocks_kernel,
    r=r,
    per_token_mask=per_token_mask,
    precision=precision,
    inverse=inverse,
  )
  group = heads // key_heads
  in_specs = [
    specs.tokens(chunk, dim_k, group=group),
    specs.tokens(chunk, dim_v),
    specs.scalars(chunk),
    specs.scalars(chunk),
    specs.mask(mask.shape, chunk),
  ]
  args = (k, v, g.astype(f32), beta.astype(f32), mask)
  if in_place:  # whole-row token refs (the grid's chunk index is unused by their index maps)
    kernel = _in_place(kernel, chunk)
    in_specs[:4] = [
      specs.seq_tokens(tokens, dim_k, group=group),
      specs.seq_tokens(tokens, dim_v),
      specs.seq_scalars(tokens),
      specs.seq_scalars(tokens),
    ]
    in_specs.append(specs.whole(table.shape))
    args = (*args, table.astype(jnp.int32))
  return tuple(
    backend.pallas_call(
      kernel,
      grid=(t_len // chunk, bsz, heads),
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      num_warps=num_warps,
      num_stages=launch.num_stages,
      name="gdp_chunk_fwd",
    )(*args)
  )
