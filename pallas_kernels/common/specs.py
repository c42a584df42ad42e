"""BlockSpecs shared by the kernels. Chunk-parallel kernels have the grid (chunk t, batch b,
head h).

Layouts (see gdp_jax/ops/gated_delta_product/xla.py): q, k [B, Tp, H, K]; v [B, Tp, H, V]; per-token
scalars [B, H, Tp]; mask [Bm, Tm, Hm, r, r] broadcast against [B, Tp, H, r, r]; chunk matrices [B,
H, Tp*r, N].

Grouped value heads (docs/varlen.md#grouped-value-heads): a kernel whose grid runs over the HV
value heads reads q and k [B, Tp, HV / group, K] at key head h // group (`group` of the token
specs), so q and k are never repeated in memory.
"""

from __future__ import annotations

from jax.experimental import pallas as pl


def _key_head(group):
  """The head of an array with HV / group heads that value head h reads."""
  return (lambda h: h) if group == 1 else (lambda h: h // group)


def tokens(bt, dim, *, group=1):
  """A [BT, D] tile of a [B, Tp, H, D] array; with group > 1, of [B, Tp, H / group, D] at head
  h // group (key heads shared by `group` value heads)."""
  head = _key_head(group)
  return pl.BlockSpec((None, bt, None, dim), lambda t, b, h: (b, t, head(h), 0))


def scalars(bt):
  """A [BT] row of a [B, H, Tp] array."""
  return pl.BlockSpec((None, None, bt), lambda t, b, h: (b, h, t))


def rows(n, dim):
  """An [N, D] tile (one chunk) of a [B, H, Tp*r, D] array."""
  return pl.BlockSpec((None, None, n, dim), lambda t, b, h: (b, h, t, 0))


def mask(mask_shape, bt):
  """A [X, r, r] tile of a [Bm, Tm, Hm, r, r] mask: X = BT per token, else 1 (broadcast)."""
  bm, tm, hm, r, _ = mask_shape
  x = bt if tm > 1 else 1
  return pl.BlockSpec(
    (None, x, None, r, r),
    lambda t, b, h: (b if bm > 1 else 0, t if tm > 1 else 0, h if hm > 1 else 0, 0, 0),
  )


# The sequential kernels (chunk_h.py, bwd_dhu.py) walk the whole sequence in one program; their
# grid is (V block iv, batch b, head h) and their blocks span all Tp tokens.


def seq_tokens(t_len, dim, *, v_block=False, group=1):
  """All [Tp, D] tokens of a [B, Tp, H, D] array (D split in blocks of `dim` if v_block); with
  group > 1 of a [B, Tp, H / group, D] array at head h // group, as `tokens`."""
  head = _key_head(group)
  if v_block:
    return pl.BlockSpec((None, t_len, None, dim), lambda iv, b, h: (b, 0, head(h), iv))
  return pl.BlockSpec((None, t_len, None, dim), lambda iv, b, h: (b, 0, head(h), 0))


def seq_rows(t_len, r, dim, *, v_block=False):
  """All [Tp, r, D] rows of a [B, H, Tp, r, D] array (D in blocks of `dim` if v_block)."""
  if v_block:
    return pl.BlockSpec((None, None, t_len, r, dim), lambda iv, b, h: (b, h, 0, 0, iv))
  return pl.BlockSpec((None, None, t_len, r, dim), lambda iv, b, h: (b, h, 0, 0, 0))


def seq_scalars(t_len):
  """All [Tp] per-token scalars of a [B, H, Tp] array."""
  return pl.BlockSpec((None, None, t_len), lambda iv, b, h: (b, h, 0))


def state(dim_k, bv):
  """A [K, BV] block of a [B, H, K, V] state."""
  return pl.BlockSpec((None, None, dim_k, bv), lambda iv, b, h: (b, h, 0, iv))


def whole(shape):
  """The whole array in every program (a small table read at a loop index)."""
  return pl.BlockSpec(tuple(shape), lambda iv, b, h: (0,) * len(shape))


def chunk_states(nt, dim_k, bv):
  """[NT, K, BV] of a [B, H, NT, K, V] array of per-chunk states."""
  return pl.BlockSpec((None, None, nt, dim_k, bv), lambda iv, b, h: (b, h, 0, 0, iv))


def check_key_blocks(mask, key_blocks):
  """The mask's r x r must match the key blocks a kernel was asked to use."""
  if mask.shape[-1] != key_blocks or mask.shape[-2] != key_blocks:
    raise ValueError(
      f"mask has shape {mask.shape}; expected [..., {key_blocks}, {key_blocks}] "
      f"for key_blocks = {key_blocks}"
    )
