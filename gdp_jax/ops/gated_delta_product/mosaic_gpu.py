"""`implementation="mosaic_gpu"`: the Mosaic GPU kernels for Hopper, forward and backward, as one
operator with its own `jax.custom_vjp` (pallas_kernels/mosaic_gpu/, docs/mosaic_gpu.md).

Forward: `pallas_kernels.mosaic_gpu.forward.forward`: the chunks' gate-free inverses, then the
state walk, which for a differentiated call stores its per-chunk states and new values. The
backward is the reverse walk (backward_walk.py) and the chunk-parallel gradients
(chunk_grads.py), summed per token here.
They take q, k, v in bfloat16 or float16, K and V in 64 and 128, r in 1, 2, 4, on compute
capability 9.0 (`serves`, `unsupported`); other calls go to the next implementation of the
registry (api.py). Packed sequences (cu_seqlens) without initial states are read in place, the
row walked in pieces (pieces.py, docs/mosaic_gpu.md#packed-sequences-in-place); with initial
states gathered into the chunk-aligned layout and walked one program per sequence
(docs/mosaic_gpu.md#packed-sequences). Off a GPU the kernels run
in jax's Mosaic GPU interpreter (docs/mosaic_gpu.md#testing-without-a-gpu).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar, NamedTuple

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp

from gdp_jax.ops.autodiff import raise_if_differentiated, raise_if_forward_mode
from gdp_jax.ops.gated_delta_product import nonfinite, pieces, varlen, xla_backward
from gdp_jax.ops.gated_delta_product.base import (
  GatedDeltaProductImplementation,
  Problem,
  packed_states,
)
from gdp_jax.ops.heads import sum_key_heads
from gdp_jax.ops.once import jitted_kernels
from pallas_kernels.common.backend import interpret_mode
from pallas_kernels.common.device import HOPPER
from pallas_kernels.common.options import KernelOptions
from pallas_kernels.mosaic_gpu import backward_walk, chunk_grads
from pallas_kernels.mosaic_gpu import forward as mosaic_forward
from pallas_kernels.mosaic_gpu.common import (
  BACKWARD_R,
  SUPPORTED_DIMS,
  SUPPORTED_DTYPES,
  chunk_tokens,
)

SUPPORTED_KEY_BLOCKS = BACKWARD_R  # the forward takes r = 8 too
# r of the guard inside the kernels' loads without gradient (docs/mosaic_gpu.md
# #the-guard-in-the-loads); other r clean copies first, as a differentiated call does.
LOAD_GUARD_KEY_BLOCKS: tuple[int, ...] = (1,)
COMPUTE_CAPABILITY = HOPPER  # what the compiled kernels target (wgmma, TMA)
NO_HIGHER_DERIVATIVES = (
  "gated_delta_product with implementation='mosaic_gpu' supports reverse-mode first derivatives "
  "only (jax.grad, jax.vjp, jax.value_and_grad: its backward is a custom_vjp of Pallas "
  "kernels); forward mode (jax.jvp, jax.jacfwd, jax.linearize) and second or higher "
  "derivatives need implementation='xla' (or 'reference'), which JAX differentiates directly"
)


def _kernel_mask(mask, batch, t_len, heads):
  """The normalised mask [Bm, Tm, Hm, r, r] as forward.py reads it: [r, r] when shared,
  [H, r, r] per head, else [B, T, H, r, r]."""
  bm, tm, hm, r, _ = mask.shape
  if bm == 1 and tm == 1:
    return mask[0, 0, 0] if hm == 1 else mask[0, 0]
  return jnp.broadcast_to(mask, (batch, t_len, heads, r, r))


class _Packing(NamedTuple):
  """Packed sequences at the kernels' chunk: the chunk-aligned layout and the walks' table."""

  layout: varlen.Layout
  table: jax.Array  # [N, 4] per sequence: first chunk, chunk count (`varlen.sequence_chunks`)


class _Pieces(NamedTuple):
  """Packed sequences read in place: the walks' table of pieces and bounds
  (`pieces.piece_table`) and the non-finite guard's marks of o (or None: no guard)."""

  table: jax.Array  # [P, 8]
  bounds: jax.Array  # [S]
  marks_o: jax.Array | None  # [1, T, H] bool
  # without gradient: the row cut inside sequences (`pieces.split_table`) and whether to take it
  split_table: jax.Array | None = None  # [P', 8]
  split: jax.Array | None = None  # bool


class _Static(NamedTuple):
  scale: float
  guard: bool  # the non-finite guard (docs/precision.md#non-finite-inputs)
  interpret: bool
  guard_in_loads: bool = True  # without gradient, the guard inside the kernels' loads
  every_chunks: int | None = None  # block states: the state after every this many chunks
  piece_chunks: int | None = None  # packed rows in place: the pieces' length (chunks)


def _params(static):
  return plgpu.InterpretGPUParams() if static.interpret else None


def _forward(q, k, v, g, beta, mask, h0, packing, static, save, guard_marks=None):
  """(o, final, stored): the forward kernels; with `save` (a differentiated call) `stored` is
  what the backward reads (the chunks' inverses, per-chunk states and new values); with block
  states (`static.every_chunks`) those."""
  to_layout, to_row, table = (lambda x: x), (lambda x: x), None
  in_place = isinstance(packing, _Pieces)
  if in_place:
    table = packing.table
  elif packing is not None:
    to_layout = functools.partial(varlen.pack, lay=packing.layout)
    to_row = functools.partial(varlen.unpack, lay=packing.layout)
    q, k, v, g, beta = map(to_layout, (q, k, v, g, beta))
    mask = mask if mask.shape[1] == 1 else to_layout(mask)
    table = packing.table
  batch, t_len, heads = v.shape[:3]
  o, final, *stored = mosaic_forward.forward(
    q,
    k,
    v,
    g,
    beta,
    _kernel_mask(mask, batch, t_len, heads),
    scale=static.scale,
    initial_state=h0,
    output_final_state=True,
    return_inverse=save,
    store_states=save,
    seq_table=table,
    pieces=packing.bounds if in_place else None,
    guard_marks=guard_marks,
    state_every_chunks=static.every_chunks,
    interpret=_params(static),
  )
  return to_row(o), final, tuple(stored)


def _backward(q, k, v, g, beta, mask, h0, packing, stored, static, do, dfinal):
  """The gradients of every input from the forward's stored walk (docs/mosaic_gpu.md
  #the-backward): the reverse walk, the chunk-parallel gradients, their per-token sums."""
  t0, states_t, vnew_t = stored
  to_row, table, token_mask = (lambda x: x), None, mask
  in_place = isinstance(packing, _Pieces)
  if in_place:
    table = packing.table
  elif packing is not None:
    pack = functools.partial(varlen.pack, lay=packing.layout)
    to_row = functools.partial(varlen.unpack, lay=packing.layout)
    q, k, v, g, beta, do = map(pack, (q, k, v, g, beta, do))
    token_mask = mask if mask.shape[1] == 1 else pack(mask)
    table = packing.table
  batch, t_len, heads = v.shape[:3]
  key_heads = q.shape[2]
  r = mask.shape[-1]
  c = chunk_tokens(r)
  nc = t_len // c
  kernel_mask = _kernel_mask(token_mask, batch, t_len, heads)
  ops = mosaic_forward.prepare(q, k, v, g, beta, kernel_mask, static.scale)
  params = _params(static)
  walk_args = (ops.gamma, ops.gamma_rows, ops.beta_rows, ops.mask_rows, ops.scale)
  dh_t, dvnew_t, dh0_t = backward_walk.state_grad_walk(
    ops.q,
    ops.k,
    do,
    t0,
    *walk_args,
    jnp.swapaxes(dfinal.astype(jnp.float32), 2, 3),
    block_v=mosaic_forward.BLOCK_V,
    seq_table=table,
    pieces=packing.bounds if in_place else None,
    interpret=params,
  )
  dq, dk, dv, vec = chunk_grads.chunk_grads(
    ops.q, ops.k, ops.v, do, t0, states_t, vnew_t, dh_t, dvnew_t, *walk_args, interpret=params
  )
  # the per-row vectors to tokens: row (a, t) of chunk n is entry [n, a, t]
  per_row = lambda i: vec[:, :, :, i].reshape(batch, heads, nc, r, c)
  dgamma = jnp.sum(per_row(0) + per_row(1), axis=3) + vec[:, :, :, 4, :c]
  dgamma = dgamma.at[..., -1].add(vec[:, :, :, 5, 0])
  dg = jnp.flip(jnp.cumsum(jnp.flip(dgamma, -1), axis=-1), -1)  # gamma is a cumsum of g
  dbeta = jnp.sum(per_row(2) + per_row(3), axis=3)
  time_major = lambda x: jnp.moveaxis(x.reshape(batch, heads, t_len), 1, 2)  # -> [B, T, H]
  # dM_t[a, d] at row (a, t): vector 6 + d
  dm = jnp.stack([per_row(chunk_grads.VECTOR_ROWS + d) for d in range(r)], axis=-1)
  dm = jnp.moveaxis(dm, 3, 4).reshape(batch, heads, t_len, r, r)  # [B, H, T, a, d]
  dm = jnp.moveaxis(to_row(jnp.moveaxis(dm, 1, 2)), 1, 2)
  dmask = xla_backward.reduce_dmask(dm, mask.shape)
  if key_heads != heads:
    dq, dk = (sum_key_heads(x.astype(jnp.float32), key_heads) for x in (dq, dk))
  return (
    to_row(dq),
    to_row(dk),
    to_row(dv),
    to_row(time_major(dg)),
    to_row(time_major(dbeta)),
    dmask,
    jnp.swapaxes(dh0_t, 2, 3),
  )


def _clean(q, k, v, g, beta, mask, packing, with_state=False):
  """The non-finite guard's cleaned inputs and marks (nonfinite.py), per sequence when packed;
  `with_state`: also the marks of the states after each token (block states)."""
  if packing is None:
    return nonfinite.clean(q, k, v, g, beta, mask, local=True, with_state=with_state)
  cu = packing.layout.cu_seqlens
  return varlen.clean(q, k, v, g, beta, mask, cu, with_state=with_state, local=True)


# One lowering of each kernel per distinct call (a model's layers: docs/train_lm.md#compile-time)
_forward_once = jitted_kernels(_forward, static_argnums=(8, 9))
_backward_once = jitted_kernels(_backward, static_argnums=(9,))


def _marks(k, v, g, beta, mask, with_state=False):
  """The guard in the kernels' loads (a call without gradient on unpacked rows,
  docs/mosaic_gpu.md#the-guard-in-the-loads): the marks and the cleaned g, beta and mask (small);
  k and v stay as they are, the kernels clean them as they land; q's marks are left to the
  kernel (a non-finite output)."""
  no_q = jnp.zeros(k.shape[:3] + (1,), k.dtype)
  (_, _, _, g, beta, mask), marks = nonfinite.clean(
    no_q, k, v, g, beta, mask, local=True, with_state=with_state
  )
  return (g, beta, mask), marks


def _guarded_forward(q, k, v, g, beta, mask, h0, packing, static, with_state=False):
  """A call without gradient, the non-finite guard around it: (o, final, the forward's stored
  outputs (block states with `static.every_chunks`), the guard's marks or None)."""
  if static.guard and static.guard_in_loads and packing is None:
    # a bad q spoils only its own token's output, which the kernel writes as nan (non-finite)
    (g, beta, mask), marks = _marks(k, v, g, beta, mask, with_state)
    o, final, stored = _forward_once(
      q, k, v, g, beta, mask, h0, packing, static, False, guard_marks=marks.o
    )
    return o, nonfinite.mark_final(final, marks), stored, marks
  marks = None
  if static.guard:  # packed rows and r > 1: on cleaned copies
    (_, k, v, g, beta, mask), marks = _clean(q, k, v, g, beta, mask, packing, with_state)
  o, final, stored = _forward_once(q, k, v, g, beta, mask, h0, packing, static, False)
  if marks is not None:
    o, final = nonfinite.mark(o, final, marks)
  return o, final, stored, marks


@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def _operator(q, k, v, g, beta, mask, h0, packing, static):
  return _guarded_forward(q, k, v, g, beta, mask, h0, packing, static)[:2]


def _with_block_states(q, k, v, g, beta, mask, h0, static):
  """A call without gradient on unpacked rows that also returns the walk's block states:
  (o, final, states [B, H, NC // e, K, V] float32, the guard's marks or None); the marks say
  which states a bad token spoiled (block_states.py marks them)."""
  o, final, (states,), marks = _guarded_forward(
    q, k, v, g, beta, mask, h0, None, static, with_state=True
  )
  return o, final, states, marks


def _operator_fwd(q, k, v, g, beta, mask, h0, packing, static):
  # Differentiated, the guard keeps cleaned copies (the backward's kernels read them): with the
  # cleaning inside all four kernels the training step measured slower on an H200
  # (docs/mosaic_gpu.md#the-guard-in-the-loads).
  marks = None
  if static.guard:
    (q, k, v, g, beta, mask), marks = _clean(q, k, v, g, beta, mask, packing)
  forward = raise_if_differentiated(
    lambda *a: _forward_once(*a, packing, static, True), NO_HIGHER_DERIVATIVES
  )
  o, final, stored = forward(q, k, v, g, beta, mask, h0)
  if marks is not None:
    o, final = nonfinite.mark(o, final, marks)
  return (o, final), (q, k, v, g, beta, mask, h0, packing, stored, marks)


def _operator_bwd(static, residuals, cotangents):
  *inputs, packing, stored, marks = residuals
  do, dfinal = cotangents
  if marks is not None:  # a marked output's cotangent never reaches the kernels
    do, dfinal = nonfinite.mark_cotangents(do, dfinal, marks)
  backward = raise_if_differentiated(
    lambda *a: _backward_once(*a, packing, stored, static, do, dfinal), NO_HIGHER_DERIVATIVES
  )
  grads = backward(*inputs)
  return (*(d.astype(x.dtype) for d, x in zip(grads, inputs)), None)


_operator.defvjp(_operator_fwd, _operator_bwd)


def _in_place(q, k, v, g, beta, mask, cu_seqlens, static):
  """Packed sequences without initial states, the row read in place (pieces.py): each sequence
  start a reset, the walks over pieces of the row (`_pieces_operator`), the final states carried
  from the pieces' states (differentiated by JAX); the guard's marks per sequence, q's left out
  as on unpacked rows (`_marks`: a kernel cleaning in its loads writes a bad q's own output as
  nan; the differentiated call marks bad q itself, `_pieces_operator_fwd`)."""
  t_len = q.shape[1]
  c = chunk_tokens(mask.shape[-1])
  cu = varlen.sanitize(cu_seqlens, t_len)
  marks = None
  if static.guard:
    no_q = jnp.zeros(k.shape[:3] + (1,), k.dtype)
    (_, _, _, g, beta, mask), marks = varlen.clean(no_q, k, v, g, beta, mask, cu, local=True)
  g = pieces.starts_as_resets(g, cu)
  marks_o = None if marks is None else marks.o
  padded = -(-t_len // c) * c  # identity tokens to whole chunks (the stored states need them)
  if padded != t_len:
    pad = lambda x: jnp.pad(x, [(0, 0), (0, padded - t_len)] + [(0, 0)] * (x.ndim - 2))
    q, k, v, g, beta = map(pad, (q, k, v, g, beta))
    mask = mask if mask.shape[1] == 1 else pad(mask)
    marks_o = None if marks_o is None else pad(marks_o)
  value_tiles = -(-v.shape[-1] // mosaic_forward.BLOCK_V)
  per_piece = pieces.piece_length(padded // c, v.shape[2] * value_tiles)
  row = pieces.row_bounds(cu, padded, c)
  table, bounds = pieces.piece_table(cu, padded, c, per_piece, row)
  split_table, _ = pieces.split_table(cu, padded, c, per_piece, row)
  split = jnp.max(table[:, 1]) > pieces.SPLIT_WHEN_LONGER * per_piece
  walk = _Pieces(table, bounds, marks_o, split_table, split)
  static = static._replace(piece_chunks=per_piece)
  o, slot_states = _pieces_operator(q, k, v, g, beta, mask, walk, static)
  final = pieces.final_states(slot_states, bounds, k, v, g, beta, mask, cu, c)
  o = o[:, :t_len]
  if marks is not None:
    final = nonfinite.mark_final(final, marks)
  return o, final


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _pieces_operator(q, k, v, g, beta, mask, walk, static):
  """(o, the states entering the bounds): the kernels over the pieces; with the guard's marks
  (`walk.marks_o`) o is nan where marked, without gradient from the guard inside the kernels'
  loads where r allows it (LOAD_GUARD_KEY_BLOCKS)."""
  if walk.marks_o is not None and static.guard_in_loads:
    return _walk_pieces(q, k, v, g, beta, mask, walk, static, walk.marks_o)
  return _pieces_operator_fwd(q, k, v, g, beta, mask, walk, static, save=False)[0]


def _walk_pieces(q, k, v, g, beta, mask, walk, static, guard_marks=None):
  """(o, the slots' states) without gradient: the walks over the pieces cut at sequence
  boundaries, or where a sequence is longer than the pieces allow (`walk.split`) over pieces cut
  inside it (`_split_once`)."""

  def at_boundaries(*args):
    return _forward_once(*args, None, walk, static, False, guard_marks=guard_marks)[:2]

  def inside(*args):
    return _split_once(*args, walk, static, guard_marks)

  return jax.lax.cond(walk.split, inside, at_boundaries, q, k, v, g, beta, mask)


def _split_forward(q, k, v, g, beta, mask, walk, static, guard_marks):
  """(o, the slots' states) over `walk.split_table`'s pieces (`pieces.split_forward`)."""
  kernel_mask = _kernel_mask(mask, *v.shape[:3])
  return pieces.split_forward(
    q, k, v, g, beta, kernel_mask, walk.split_table, walk.bounds, scale=static.scale,
    per_piece=static.piece_chunks, guard_marks=guard_marks, interpret=_params(static),
  )  # fmt: skip


_split_once = jitted_kernels(_split_forward, static_argnums=(7,))


def _pieces_operator_fwd(q, k, v, g, beta, mask, walk, static, save=True):
  if walk.marks_o is not None:  # the kernels read cleaned copies; a bad q marks its own token
    bad_q = nonfinite.bad_rows(q, *walk.marks_o.shape, local=True)
    walk = walk._replace(marks_o=walk.marks_o | bad_q)
    q, k, v = map(nonfinite.zero_nonfinite, (q, k, v))
  if save:
    forward = raise_if_differentiated(
      lambda *a: _forward_once(*a, None, walk, static, save), NO_HIGHER_DERIVATIVES
    )
    o, states, stored = forward(q, k, v, g, beta, mask)
  else:
    (o, states), stored = _walk_pieces(q, k, v, g, beta, mask, walk, static), ()
  if walk.marks_o is not None:
    o = jnp.where(walk.marks_o[..., None], jnp.array(jnp.nan, o.dtype), o)
  return (o, states), (q, k, v, g, beta, mask, walk, stored)


def _pieces_operator_bwd(static, residuals, cotangents):
  *inputs, walk, stored = residuals
  do, dstates = cotangents
  if walk.marks_o is not None:  # a marked output's cotangent never reaches the kernels
    do = jnp.where(walk.marks_o[..., None], jnp.zeros((), do.dtype), do)
  backward = raise_if_differentiated(
    lambda *a: _backward_once(*a, None, walk, stored, static, do, dstates), NO_HIGHER_DERIVATIVES
  )
  grads = backward(*inputs)
  return (*(d.astype(x.dtype) for d, x in zip(grads, inputs)), None)


_pieces_operator.defvjp(_pieces_operator_fwd, _pieces_operator_bwd)


@dataclasses.dataclass(frozen=True)
class MosaicGpuGatedDeltaProduct(GatedDeltaProductImplementation):
  """The Mosaic GPU kernels (Hopper), forward and backward (the module docstring).

  options: only `options.nonfinite_guard` applies (the kernels have no launch table yet).
  precision: accepted for the registry's common config; the kernels take half-precision inputs
    with float32 accumulation only.
  nonfinite_guard: None keeps the options' (on by default, docs/precision.md#non-finite-inputs).
  backward: "pallas" (the Mosaic backward) or "xla" (the jnp backward behind the Mosaic forward:
    a debugging switch).
  interpret: None follows pallas_kernels/common/backend.py (the Mosaic GPU interpreter off a
    GPU); False compiles the kernels for the GPU, True interprets them.
  """

  name: ClassVar[str] = "mosaic_gpu"
  summary: ClassVar[str] = (
    "Pallas Mosaic GPU kernels for Hopper, forward and backward (interpreted off a GPU)"
  )
  platforms: ClassVar[tuple[str, ...]] = ("gpu",)
  pallas: ClassVar[bool] = True
  device_rule: ClassVar[str] = "the kernels compile for compute capability 9.0 (H100, H200)"

  options: KernelOptions | None = None
  precision: str | None = None
  nonfinite_guard: bool | None = None
  backward: str = "pallas"
  interpret: bool | None = None

  def serves(self, capability):
    return capability == COMPUTE_CAPABILITY

  def unsupported(self, problem: Problem, *, named: bool) -> str | None:
    use = 'use implementation="triton" (or "pallas", which picks it for these inputs)'
    if jnp.dtype(problem.dtype) not in SUPPORTED_DTYPES:
      return (
        f'q, k, v: dtype {jnp.dtype(problem.dtype).name}; implementation="mosaic_gpu" takes '
        f"bfloat16 or float16 only; {use} (or cast the inputs)"
      )
    if problem.key_blocks not in SUPPORTED_KEY_BLOCKS:
      return (
        f'mask: r = {problem.key_blocks} key blocks; implementation="mosaic_gpu" takes r in '
        f"{SUPPORTED_KEY_BLOCKS}; {use}"
      )
    for name, dim in (("q, k: K", problem.key_dim), ("v: V", problem.value_dim)):
      if dim not in SUPPORTED_DIMS:
        return f'{name} = {dim}; implementation="mosaic_gpu" takes {SUPPORTED_DIMS}; {use}'
    if problem.state_every is not None:
      c = chunk_tokens(problem.key_blocks)
      if problem.packed or problem.state_every % c:
        return (
          f"state_every={problem.state_every}: the mosaic_gpu kernels write block states on "
          f"unpacked rows, every multiple of their chunk ({c} tokens at r = "
          f"{problem.key_blocks}); {use}"
        )
    return None

  def time_multiple(self, chunk_size, key_blocks):
    return chunk_tokens(key_blocks)  # the kernels' chunk, whatever chunk_size asks

  def _static(self, scale) -> _Static:
    guard = self.nonfinite_guard
    if guard is None:
      guard = True if self.options is None else self.options.nonfinite_guard
    interpret = self.interpret if self.interpret is not None else interpret_mode()
    return _Static(float(scale), bool(guard), bool(interpret))

  def __call__(self, q, k, v, g, beta, mask, initial_state, scale, chunk_size):
    return self._run(q, k, v, g, beta, mask, initial_state, scale, chunk_size, None)

  def varlen(self, q, k, v, g, beta, mask, initial_state, scale, chunk_size, cu_seqlens):
    return self._run(q, k, v, g, beta, mask, initial_state, scale, chunk_size, cu_seqlens)

  def block_states(self, q, k, v, g, beta, mask, initial_state, scale, every):
    """(o, final, states [B, H, T // every, K, V] float32, the guard's marks or None) without
    gradient, unpacked rows, T a multiple of the chunk and `every` of it (block_states.py)."""
    static = self._static(scale)._replace(
      guard_in_loads=mask.shape[-1] in LOAD_GUARD_KEY_BLOCKS,
      every_chunks=every // chunk_tokens(mask.shape[-1]),
    )
    return _with_block_states(q, k, v, g, beta, mask.astype(jnp.float32), initial_state, static)

  def _run(self, q, k, v, g, beta, mask, initial_state, scale, chunk_size, cu_seqlens):
    args = (q, k, v, g, beta, mask, initial_state)
    raise_if_forward_mode((args, scale), NO_HIGHER_DERIVATIVES)
    mask = mask.astype(jnp.float32)
    r = mask.shape[-1]
    static = self._static(scale)._replace(guard_in_loads=r in LOAD_GUARD_KEY_BLOCKS)
    in_place = cu_seqlens is not None and initial_state is None and self.backward == "pallas"
    if in_place and pieces.num_slots(cu_seqlens.shape[0] - 1) <= pieces.MAX_SLOTS:
      return _in_place(q, k, v, g, beta, mask, cu_seqlens, static)
    if cu_seqlens is not None:
      initial_state = packed_states(initial_state, q, v, cu_seqlens)
    if self.backward == "xla":
      forward = self.replace(backward="pallas")
      args = (q, k, v, g, beta, mask, initial_state)
      return xla_backward.with_xla_backward(forward, *args, cu_seqlens, scale, chunk_size)
    packing = None
    if cu_seqlens is not None:
      lay = varlen.layout(cu_seqlens, q.shape[1], chunk_tokens(mask.shape[-1]))
      packing = _Packing(lay, varlen.sequence_chunks(lay).T)
    return _operator(q, k, v, g, beta, mask, initial_state, packing, static)
