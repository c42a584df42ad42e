"""Shared memory per thread block of each Pallas kernel, estimated on the CPU from its tiles
(docs/implementations.md#supported-gpus).

A Triton kernel that needs more shared memory than the GPU grants one thread block does not
compile; the launch heuristic (`options.heuristic_options`) uses this estimate to shrink pipeline
stages and V tiles until every kernel fits the device. The estimate follows where Triton puts a
kernel's shared memory: pipelined loads that reach a dot (a ring of `num_stages - 1` buffers of
their tile, one more for Hopper's warpgroup MMA), dot operands staged through shared memory, and
layout-conversion scratch (the larger of it and the staged operands: the allocator reuses the
bytes). Tiles count in the dots' operand dtype (twice for float32 at "tf32x3"), per kernel in
`_TILES` (docs/kernels.md). It is a model, not Triton's allocator: `estimate_bytes` adds a safety
margin (`MARGIN` times the tiles plus `SLACK` bytes), checked never below Triton's own figures
for sm_90 and sm_80 (tests/test_shared_memory.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp

# Safety margin over the tile count (see the module docstring).
MARGIN = 1.1
SLACK = 4 * 1024
BLOCK = 16  # rows of the inverse's diagonal blocks (chunk_fwd)
F32 = 4

# The Pallas kernels the operator launches (the KernelOptions field of each) and the inference
# kernels (options.DecodeOptions, options.StepOptions).
FORWARD = ("chunk_fwd", "chunk_state_output")
BACKWARD = ("wy", "chunk_h", "bwd_dv_local", "bwd_dhu", "bwd_dqkwg", "bwd_wy")
OPERATOR_KERNELS = FORWARD + BACKWARD
INFERENCE_KERNELS = ("gqa_decode", "recurrent_step")
KERNELS = OPERATOR_KERNELS + INFERENCE_KERNELS


@dataclasses.dataclass(frozen=True)
class Problem:
  """What the tiles depend on, as the kernels see it (feature dimensions already padded).

  r: key blocks; dim_k = r * (K / r padded to a power of two >= 16); dim_v: V padded likewise;
  chunk: tokens per chunk (BT); dtype: the input dtype (q, k, v); precision: float32 dots'
  precision. For gqa_decode: dim_k is the head dimension D, chunk the query heads per cache head
  (G), dtype the cache's dtype.
  """

  r: int
  dim_k: int
  dim_v: int
  chunk: int
  dtype: Any
  precision: str = "tf32"

  @property
  def e(self) -> int:
    """Bytes per element of a dot operand."""
    size = jnp.dtype(self.dtype).itemsize
    return 2 * size if size == 4 and self.precision == "tf32x3" else size


@dataclasses.dataclass(frozen=True)
class Tiles:
  """A kernel's shared memory in three parts (bytes; see the module docstring).

  pipelined: loads of the loop body that feed dots; `direct` those the tensor cores read from
  shared memory (one more buffer with warpgroup MMA, which needs dots of 64 or more `rows` and a
  multiple of 4 warps). staged: the operand tiles alive at the worst point. scratch: the largest
  conversion scratch (overlaid with the staged tiles).
  """

  direct: int = 0
  pipelined: int = 0
  staged: int = 0
  scratch: int = 0
  rows: int = 0
  staged_sync: int | None = None  # staged without warpgroup MMA (None: as `staged`)

  def bytes(self, num_stages: int, num_warps: int = 4, wgmma: bool = True) -> int:
    buffers = max(num_stages - 1, 0)
    ring = buffers * (self.direct + self.pipelined)
    if buffers and wgmma and num_warps % 4 == 0 and self.rows >= 64:
      ring += self.direct
    staged = self.staged if wgmma or self.staged_sync is None else self.staged_sync
    return ring + max(staged, self.scratch)


def _chunk_fwd(p: Problem, bv: int) -> Tiles:
  k, v, e = p.dim_k, p.dim_v, p.e
  # 16 x 16 blocks: Kw_i Kb_j^T, X_ij W~_j, X_ij U~_j, and the float32 merge products.
  staged = max(
    2 * BLOCK * k * e, BLOCK * BLOCK * e + BLOCK * max(k, v) * e, 2 * BLOCK * BLOCK * F32
  )
  return Tiles(staged=staged, scratch=BLOCK * max(k, v) * F32)


def _chunk_state_output(p: Problem, bv: int) -> Tiles:
  bt, k, r, e = p.chunk, p.dim_k, p.r, p.e
  return Tiles(
    rows=bt,
    direct=2 * bt * k * e,  # q, k: [BT, K] each
    pipelined=bt * r * k * e + bt * r * bv * e + bt * F32,  # w, u, gamma
    # the state's r blocks [dk, BV] (two dots each), v_new's r blocks [BT, BV] (two dots each),
    # and one [BT, dk] decayed key block or [BT, BT] score tile
    staged=k * bv * e + r * bt * bv * e + bt * max(k // r, bt) * e,
    scratch=bt * bv * F32,
  )


def _chunk_h(p: Problem, bv: int) -> Tiles:
  bt, k, r, e = p.chunk, p.dim_k, p.r, p.e
  return Tiles(
    rows=bt,
    direct=bt * r * k * e,  # w
    pipelined=bt * k * e + bt * r * bv * e + bt * F32,  # k, u, gamma
    staged=k * bv * e + r * bt * bv * e + bt * (k // r) * e,
    scratch=bt * bv * F32,
  )


def _wy(p: Problem, bv: int) -> Tiles:
  n, wide = p.chunk * p.r, max(p.dim_k, p.dim_v)
  return Tiles(staged=n * n * p.e + n * wide * p.e, scratch=n * wide * F32)  # Ai, then W~ / U~


def _bwd_dv_local(p: Problem, bv: int) -> Tiles:
  bt, dk, e = p.chunk, p.dim_k // p.r, p.e
  # do [BT, V] stays across the key blocks; q_a k_a^T, then P_a^T do
  staged = bt * p.dim_v * e + max(2 * bt * dk * e, bt * bt * e)
  return Tiles(staged=staged, scratch=bt * p.dim_v * F32)


def _bwd_dhu(p: Problem, bv: int) -> Tiles:
  bt, k, r, e = p.chunk, p.dim_k, p.r, p.e
  return Tiles(
    rows=bt,
    direct=bt * r * k * e,  # w
    # k, q, do, dv_local (float32), gamma
    pipelined=2 * bt * k * e + bt * bv * e + bt * r * bv * F32 + bt * F32,
    # dS's r blocks, dv_new's r blocks, do, one scaled q or k block, a float32 dv_new block
    staged=k * bv * e + r * bt * bv * e + bt * bv * e + bt * (k // r) * e + bt * bv * F32,
    scratch=bt * bv * F32,
  )


def _bwd_dqkwg(p: Problem, bv: int, bk: int) -> Tiles:
  bt, n, e = p.chunk, p.chunk * p.r, p.e
  # one program per BK key columns; the V loop loads do, v_new_a [BT, BV], h, dh [BK, BV] and
  # dv_new [N, BV] (pipelined, and staged again for the dots: float32 operands are), then
  # dS_a [BT, BT], q, k [BT, BK] for the closing dots; plus a [BT] vector's barriers
  loop = (2 * bt * bv + 2 * bk * bv + n * bv) * e
  return Tiles(
    rows=bt,
    pipelined=loop + bt * F32,
    staged=max(loop, (bt * bt + 2 * bt * bk) * e),
    scratch=max(bt, n) * max(bk, bt) * F32,
  )


def _bwd_wy(p: Problem, bv: int, bk: int) -> Tiles:
  n, e = p.chunk * p.r, p.e
  # Ai [N, N] stays, with one [N, N] operand (X, Ai^T X or beta G) and the pieces of one step:
  # du, U~ [N, BV], or dw, Kw (or W~), Kb [N, BK] (no loop with a dot: nothing pipelined)
  staged = 2 * n * n * e + max(2 * n * bv, 3 * n * bk) * e
  return Tiles(staged=staged, scratch=n * max(bk, bv) * F32)


def _gqa_decode(p: Problem, block_s: int) -> Tiles:
  # problem: dim_k = D, chunk = G (query heads per cache head), dtype = the cache's dtype
  gp, dp = max(16, _pow2(p.chunk)), max(16, _pow2(p.dim_k))
  cache = jnp.dtype(p.dtype).itemsize
  if cache == 2:  # split-bf16 products: q and the weights as bf16 high and low halves
    staged = 2 * gp * dp * 2 + 2 * gp * block_s * 2
  else:  # float32 dots on the cache tiles converted to float32
    staged = gp * dp * F32 + gp * block_s * F32 + 2 * block_s * dp * F32
  return Tiles(pipelined=2 * block_s * dp * cache, staged=staged, scratch=gp * dp * F32)


def _recurrent_step(p: Problem, bv: int) -> Tiles:
  # no dot: column reductions of the [K, BV] state tile only
  kp = max(16, _pow2(p.dim_k))
  return Tiles(scratch=kp * bv * F32)


def _pow2(x: int) -> int:
  return 1 << max(int(x) - 1, 0).bit_length()


_TILES: dict[str, Callable[..., Tiles]] = {
  "chunk_fwd": _chunk_fwd,
  "chunk_state_output": _chunk_state_output,
  "wy": _wy,
  "chunk_h": _chunk_h,
  "bwd_dv_local": _bwd_dv_local,
  "bwd_dhu": _bwd_dhu,
  "bwd_dqkwg": _bwd_dqkwg,
  "bwd_wy": _bwd_wy,
  "gqa_decode": _gqa_decode,
  "recurrent_step": _recurrent_step,
}


# Kernels that walk K in pieces (Launch.block_k; None: a whole key block of K / r columns).
SPLIT_K = ("bwd_dqkwg", "bwd_wy")


def tiles(
  kernel: str,
  problem: Problem,
  *,
  block: int | None = None,
  block_k: int | None = None,
) -> Tiles:
  """The tile count of `kernel` (bytes, before the margin). `block`: its V tile (block_v; the
  decode kernel's block_s), None for the whole V; `block_k`: its K piece (SPLIT_K kernels)."""
  if kernel not in _TILES:
    raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
  if problem.r < 1 or problem.dim_k % problem.r:
    raise ValueError(f"r = {problem.r} must be >= 1 and divide dim_k = {problem.dim_k}")
  bv = problem.dim_v if block is None else min(block, problem.dim_v)
  if kernel == "gqa_decode":
    bv = 64 if block is None else block
  if kernel in SPLIT_K:
    dk = problem.dim_k // problem.r
    bk = dk if block_k is None else min(block_k, dk)
    return _TILES[kernel](problem, bv, bk)
  return _TILES[kernel](problem, bv)


def estimate_bytes(
  kernel: str,
  problem: Problem,
  *,
  num_stages: int,
  num_warps: int = 4,
  block: int | None = None,
  block_k: int | None = None,
  wgmma: bool = True,
) -> int:
  """Estimated shared memory per thread block of one kernel launch, safety margin included.

  wgmma: the device has Hopper's warpgroup MMA (compute capability 9.0; unknown devices count as
  having it, the larger figure).
  """
  t = tiles(kernel, problem, block=block, block_k=block_k)
  return int(MARGIN * t.bytes(num_stages, num_warps, wgmma)) + SLACK


def has_wgmma(device) -> bool:
  """Whether a DeviceInfo's GPU has warpgroup MMA (Hopper); True when unknown (conservative)."""
  capability = getattr(device, "compute_capability", None)
  return capability is None or tuple(capability)[:1] == (9,)


def shared_memory_bytes(
  kernel: str,
  options,
  *,
  r: int,
  dim_k: int,
  dim_v: int,
  chunk: int,
  dtype,
  device=None,
) -> int:
  """Estimated shared memory per block of `kernel` launched with `options` (bytes).

  options: a KernelOptions for the operator's kernels (its field named `kernel` gives the launch,
  its `precision` the float32 dots); a DecodeOptions for "gqa_decode" (dim_k = head dimension,
  chunk = query heads per cache head, dtype = the cache's dtype); a StepOptions for
  "recurrent_step". dim_k, dim_v: as the kernels see them (padded, see `Problem`).
  device: a DeviceInfo (decides the Hopper extra buffer); None counts it.
  """
  precision = getattr(options, "precision", "tf32")
  problem = Problem(r=r, dim_k=dim_k, dim_v=dim_v, chunk=chunk, dtype=dtype, precision=precision)
  wgmma = has_wgmma(device)
  if kernel in ("gqa_decode", "recurrent_step"):  # one launch: the options themselves
    block = options.block_s if kernel == "gqa_decode" else options.block_v
    return estimate_bytes(
      kernel,
      problem,
      num_stages=options.num_stages,
      num_warps=options.num_warps,
      block=block,
      wgmma=wgmma,
    )
  if kernel not in OPERATOR_KERNELS:
    raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
  launch = getattr(options, kernel)
  return estimate_bytes(
    kernel,
    problem,
    num_stages=launch.num_stages,
    num_warps=launch.num_warps,
    block=launch.block_v,
    block_k=launch.block_k,
    wgmma=wgmma,
  )


def operator_report(options, *, r, dim_k, dim_v, chunk, dtype, device=None) -> dict[str, int]:
  """Estimated bytes of every kernel the operator launches with `options` (forward and backward),
  by kernel name."""
  return {
    name: shared_memory_bytes(
      name, options, r=r, dim_k=dim_k, dim_v=dim_v, chunk=chunk, dtype=dtype, device=device
    )
    for name in OPERATOR_KERNELS
  }
