"""Random operator inputs and the named shapes shared by the tests and the benchmarks.

`random_inputs` draws inputs in the regime a layer produces (docs/operator.md): L2-normalised q
and key blocks, beta in (0, 1), log-decays g <= 0, a real mask near the identity. `SHAPES` names
the (B, T, H, K, V) every suite and benchmark refers to.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

# (B, T, H, K, V)
SHAPES = {
  "tiny": (1, 64, 2, 32, 32),  # smoke runs (interpret mode)
  "cpu": (1, 512, 4, 64, 64),  # the bench's default without a GPU: seconds, not hours
  "h200": (8, 4096, 16, 128, 128),  # the GPU benchmark shape (docs/performance.md)
}
MASK_KINDS = (None, "shared", "head", "token")


def random_inputs(
  seed, B=2, T=40, H=3, K=32, V=16, r=2, mask_kind="head", dtype=jnp.float32, with_state=True
):
  """Random operator inputs in the regime the layer produces: L2-normalised q and k, beta in
  (0, 1), g <= 0 with realistic decays, and an arbitrary real mask.

  mask_kind: None (r = 1 only: no mask), "shared" [r, r], "head" [H, r, r] or "token"
  [B, T, H, r, r]. Returns the operator's keyword arguments (q, k, v, g, beta, mask,
  initial_state); q, k, v in `dtype`, the rest float32.
  """
  rng = np.random.default_rng(seed)

  def normal(*shape):
    return rng.standard_normal(shape).astype(np.float32)

  q = normal(B, T, H, K)
  k = normal(B, T, H, K)
  # Normalise each key block (the operator's natural regime; keeps (I + A) well conditioned).
  kb = k.reshape(B, T, H, r, K // r)
  k = (kb / np.linalg.norm(kb, axis=-1, keepdims=True)).reshape(B, T, H, K)
  q = q / np.linalg.norm(q, axis=-1, keepdims=True)
  v = normal(B, T, H, V)
  g = -np.abs(normal(B, T, H)) * 0.2 - 0.01
  beta = 1.0 / (1.0 + np.exp(-normal(B, T, H)))
  if mask_kind is None:
    mask = None
  elif mask_kind == "shared":
    mask = normal(r, r) * 0.5 + np.eye(r, dtype=np.float32)
  elif mask_kind == "head":
    mask = normal(H, r, r) * 0.5 + np.eye(r, dtype=np.float32)
  elif mask_kind == "token":
    mask = normal(B, T, H, r, r) * 0.5 + np.eye(r, dtype=np.float32)
  else:
    raise ValueError(f"mask_kind must be one of {MASK_KINDS}, got {mask_kind!r}")
  h0 = normal(B, H, K, V) * 0.5 if with_state else None
  cast = lambda x: None if x is None else jnp.asarray(x, dtype)
  return dict(
    q=cast(q),
    k=cast(k),
    v=cast(v),
    g=jnp.asarray(g),
    beta=jnp.asarray(beta),
    mask=None if mask is None else jnp.asarray(mask),
    initial_state=None if h0 is None else jnp.asarray(h0),
  )
