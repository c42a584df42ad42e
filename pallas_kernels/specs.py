"""BlockSpecs shared by the chunk-parallel kernels, whose grid is (chunk t, batch b, head h).

Layouts (see gdp_jax/xla.py): q, k [B, Tp, H, K]; v [B, Tp, H, V]; per-token scalars [B, H, Tp];
mask [Bm, Tm, Hm, r, r] broadcast against [B, Tp, H, r, r]; chunk matrices [B, H, Tp*r, N].
"""

from __future__ import annotations

from jax.experimental import pallas as pl


def tokens(bt, dim):
  """A [BT, D] tile of a [B, Tp, H, D] array."""
  return pl.BlockSpec((None, bt, None, dim), lambda t, b, h: (b, t, h, 0))


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
      lambda t, b, h: (b if bm > 1 else 0, t if tm > 1 else 0, h if hm > 1 else 0, 0, 0))
