"""`implementation="mosaic_gpu"` of `gated_delta_product` (gdp_jax/ops/gated_delta_product/
mosaic_gpu.py) on a CPU: its place in the registry, the clear errors for inputs it
cannot take, the lowering for cuda at the benchmark shape through the public function, and its
forward and gradients in the Mosaic GPU interpreter against the reference (the operator's
recurrence: the cheapest program to compile; "xla" agrees with it in tests/test_implementations.py).

The interpreted case runs in a subprocess with NPROC=8, as in tests/test_mosaic_gpu.py (the
interpreter's warpgroup threads and XLA's CPU pool share one pool sized by the core count).
"""

from __future__ import annotations

import functools
import json
import math
import re
import sys
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdp_jax import gated_delta_product
from gdp_jax.ops.gated_delta_product.api import REGISTRY
from gdp_jax.ops.gated_delta_product.mosaic_gpu import MosaicGpuGatedDeltaProduct
from gdp_jax.ops.gqa_decode.api import PAGED_REGISTRY
from gdp_jax.ops.gqa_decode.api import REGISTRY as DECODE_REGISTRY
from gdp_jax.ops.step.api import REGISTRY as STEP_REGISTRY
from tests.cases import run_interpreted_subprocess

F32 = jnp.float32
H200 = SimpleNamespace(platform="gpu", compute_capability="9.0", device_kind="NVIDIA H200")
A100 = SimpleNamespace(platform="gpu", compute_capability="8.0", device_kind="NVIDIA A100")


def test_registered_for_the_operator_and_preferred_on_hopper():
  impl = REGISTRY.get("mosaic_gpu")
  assert isinstance(impl, MosaicGpuGatedDeltaProduct) and impl.pallas
  assert REGISTRY.names()[0] == "mosaic_gpu"
  for other in (STEP_REGISTRY, DECODE_REGISTRY, PAGED_REGISTRY):
    assert "mosaic_gpu" not in other.names()
  # "pallas" and None pick it on Hopper for the calls it takes (tests/test_registry.py: the
  # others go on to triton); named, it is obeyed and strict
  for requested in ("pallas", None):
    assert REGISTRY.resolve(requested, H200).name == "mosaic_gpu"
    assert REGISTRY.resolve(requested, A100).name == "triton"


def _inputs(
  seed=0, batch=1, t_len=20, heads=2, key_dim=64, value_dim=32, dtype=jnp.bfloat16, key_heads=None
):
  """Operator inputs; `key_heads` below `heads`: grouped value heads."""
  ks = jax.random.split(jax.random.PRNGKey(seed), 6)
  key_heads = heads if key_heads is None else key_heads

  def unit(x):
    return x / jnp.linalg.norm(x, axis=-1, keepdims=True)

  return dict(
    q=unit(jax.random.normal(ks[0], (batch, t_len, key_heads, key_dim))).astype(dtype),
    k=unit(jax.random.normal(ks[1], (batch, t_len, key_heads, key_dim))).astype(dtype),
    v=jax.random.normal(ks[2], (batch, t_len, heads, value_dim)).astype(dtype),
    g=-0.3 * jax.random.uniform(ks[3], (batch, t_len, heads)),
    beta=jax.random.uniform(ks[4], (batch, t_len, heads)),
    mask=jax.random.uniform(ks[5], (heads, 2, 2)),
    initial_state=0.1 * jax.random.normal(ks[5], (batch, heads, key_dim, value_dim)),
  )


@pytest.mark.parametrize(
  "change,words",
  [
    (dict(dtype=F32), r"q, k, v: dtype float32.*bfloat16 or float16.*\"triton\""),
    (dict(key_dim=32), r"q, k: K = 32.*\(64, 128\).*\"triton\""),
    (dict(r=3), r"mask: r = 3 key blocks.*\"triton\""),
    (dict(value_dim=256), r"v: V = 256.*\(64, 128\).*\"triton\""),
    # packed sequences run (docs/mosaic_gpu.md#packed-sequences): refused as unpacked ones are
    (dict(cu_seqlens=True, dtype=F32), r"q, k, v: dtype float32.*\"triton\""),
  ],
)
def test_inputs_it_cannot_take_are_clear_errors(change, words):
  r3, packed = (change.pop(x, False) for x in ("r", "cu_seqlens"))
  x = _inputs(**change)
  kw = {}
  if r3:
    dim = 66  # a multiple of 3
    for n in ("q", "k"):
      x[n] = jnp.pad(x[n], [(0, 0)] * 3 + [(0, 2)])
    x["mask"] = jnp.ones((3, 3))
    x["initial_state"] = jnp.zeros((1, 2, dim, 32))
  if packed:
    kw["cu_seqlens"] = jnp.array([0, 7, 20], jnp.int32)
    x["initial_state"] = jnp.concatenate([x["initial_state"]] * 2, axis=0)
  with pytest.raises(ValueError, match=words):
    gated_delta_product(**x, **kw, implementation="mosaic_gpu")


@pytest.mark.parametrize("r,dim", [(1, 128), (2, 128), (4, 128), (2, 64)])
def test_lowers_for_cuda_at_benchmark_shape(monkeypatch, r, dim):
  # the public function with implementation="mosaic_gpu", its kernels lowered for the GPU (not
  # the interpreter) from this CPU: without gradient the forward's two kernels and nothing
  # else; a training step
  # runs the same two kernels and the backward's two, lowered once for its two layers
  monkeypatch.setattr(REGISTRY, "_table", dict(REGISTRY._table))
  REGISTRY.register(REGISTRY.get("mosaic_gpu").replace(interpret=False))
  batch, t_len, heads = 8, 4096, 16
  spec = jax.ShapeDtypeStruct
  act, gate = spec((batch, t_len, heads, dim), jnp.bfloat16), spec((batch, t_len, heads), F32)

  def run(q, k, v, g, beta, mask):
    return gated_delta_product(
      q, k, v, g, beta, mask, output_final_state=True, implementation="mosaic_gpu"
    )

  def value_and_grad(*args):
    def loss(q, k, v, *rest):  # two layers of one shape: their kernels lowered once
      o, final = run(q, k, v, *rest)
      return sum(jnp.sum(x.astype(F32)) for x in (*run(q, k, o, *rest), final))

    return jax.value_and_grad(loss, range(len(args)))(*args)

  mask = spec((heads, r, r), F32)
  # the forward alone at one shape (the forward kernels at every r: test_mosaic_gpu.py's
  # lowering tests); the training step at each
  for function in (run, value_and_grad) if (r, dim) == (2, 128) else (value_and_grad,):
    lowered = jax.jit(function).trace(act, act, act, gate, gate, mask)
    lines = lowered.lower(lowering_platforms=("cuda",)).as_text().splitlines()
    mosaic = [line for line in lines if "custom_call" in line and "mosaic_gpu" in line]
    triton = [line for line in lines if "custom_call" in line and "triton" in line]
    # a training step: chunk_inverse, the walk, the reverse walk, the chunk-parallel gradients
    assert len(mosaic) == (2 if function is run else 4), (function.__name__, len(mosaic))
    assert function is value_and_grad or not triton, triton


@pytest.mark.parametrize("r", [1, 2])
def test_block_states_lower_for_cuda(monkeypatch, r):
  # state_every at the benchmark shape: the forward's two kernels, the walk writing the block
  # states, and nothing else (no Triton kernel); the guard in the loads at r = 1
  monkeypatch.setattr(REGISTRY, "_table", dict(REGISTRY._table))
  REGISTRY.register(REGISTRY.get("mosaic_gpu").replace(interpret=False))
  batch, t_len, heads, dim = 8, 4096, 16, 128
  spec = jax.ShapeDtypeStruct
  act, gate = spec((batch, t_len, heads, dim), jnp.bfloat16), spec((batch, t_len, heads), F32)

  def run(q, k, v, g, beta):
    mask = jnp.tril(jnp.ones((r, r)))
    return gated_delta_product(
      q, k, v, g, beta, mask, state_every=256, chunk_size=64 // r, implementation="mosaic_gpu"
    )

  traced = jax.jit(run).trace(act, act, act, gate, gate)
  assert traced.out_info[2].shape == (batch, t_len // 256, heads, dim, dim)
  lines = traced.lower(lowering_platforms=("cuda",)).as_text().splitlines()
  mosaic = [line for line in lines if "custom_call" in line and "mosaic_gpu" in line]
  assert len(mosaic) == 2, len(mosaic)
  assert not any("custom_call" in line and "triton" in line for line in lines)
  # fewer tokens than one block: no block state, an empty array
  short = spec((batch, 40, heads, dim), jnp.bfloat16), spec((batch, 40, heads), F32)
  traced = jax.jit(run).trace(short[0], short[0], short[0], short[1], short[1])
  assert traced.out_info[2].shape == (batch, 0, heads, dim, dim)
  traced.lower(lowering_platforms=("cuda",))


def _result_size(line):
  """The number of elements of the result of one line of StableHLO text."""
  dims = re.search(r"-> tensor<([0-9x]+)x[a-z]+[0-9]*>", line).group(1)
  return math.prod(int(d) for d in dims.split("x"))


def test_packed_forward_lowers_for_cuda(monkeypatch):
  # packed sequences (64 of them in one row of 32k tokens, no initial states: the row read in
  # place, docs/mosaic_gpu.md#packed-sequences-in-place): without gradient the Mosaic forward's
  # two kernels in each branch of the conditional (pieces cut at boundaries, or inside a long
  # sequence with the transitions' walk, its states V + K = 256 columns wide:
  # docs/mosaic_gpu.md#long-sequences-in-pieces); differentiated, the forward's two and the
  # backward's two (the reverse walk also one program per piece), no gather of the row and no
  # Triton kernel
  monkeypatch.setattr(REGISTRY, "_table", dict(REGISTRY._table))
  REGISTRY.register(REGISTRY.get("mosaic_gpu").replace(interpret=False))
  t_len, heads, dim, num_seqs, r = 32768, 16, 128, 64, 2
  spec = jax.ShapeDtypeStruct
  act, gate = spec((1, t_len, heads, dim), jnp.bfloat16), spec((1, t_len, heads), F32)
  cu = spec((num_seqs + 1,), jnp.int32)

  def run(q, k, v, g, beta, cu):
    return gated_delta_product(
      q, k, v, g, beta, jnp.ones((heads, r, r)), cu_seqlens=cu, output_final_state=True,
      implementation="mosaic_gpu",
    )  # fmt: skip

  def value_and_grad(q, k, v, g, beta, cu):
    def loss(q, k, v, g, beta):
      return sum(jnp.sum(x.astype(F32)) for x in run(q, k, v, g, beta, cu))

    return jax.value_and_grad(loss, range(5))(q, k, v, g, beta)

  for function in (run, value_and_grad):
    traced = jax.jit(function).trace(act, act, act, gate, gate, cu)
    lines = traced.lower(lowering_platforms=("cuda",)).as_text().splitlines()
    mosaic = [line for line in lines if "custom_call" in line and "mosaic_gpu" in line]
    assert len(mosaic) == 4, (function.__name__, len(mosaic))
    split = [line for line in mosaic if f"x{heads}x256x{dim}xf32>" in line]
    assert len(split) == (1 if function is run else 0), (function.__name__, split)
    # the row is never gathered into another layout (only the final states' few chunks are)
    gathered = [_result_size(line) for line in lines if "stablehlo.gather" in line]
    assert gathered and max(gathered) < t_len * heads * dim, gathered
  # (off a GPU the Triton kernels lower interpreted, as plain HLO: their names would be in the
  # jaxpr)
  jaxpr = str(traced.jaxpr)
  assert not any(name in jaxpr for name in ("gdp_chunk_fwd", "gdp_chunk_h", "gdp_bwd_")), jaxpr


# ---------------------------------------------------------------------------------------------
# Forward and gradients in the Mosaic GPU interpreter (subprocess with NPROC=8).


def _rel_rms(got, want):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.sqrt(np.mean((got - want) ** 2) / np.mean(want**2)))


def _run_interpreted():
  """Forward and gradients of "mosaic_gpu" against the reference at a tiny shape, four value heads
  sharing two key heads (grouped value heads), V = 64 (whole value tiles: the backward's reverse
  walk runs on the forward walk's stored states); returns measures."""
  from gdp_jax.ops.gated_delta_product import mosaic_gpu as mosaic_impl
  from pallas_kernels.mosaic_gpu import backward_walk

  walks = []
  reverse_walk = backward_walk.state_grad_walk

  def counted(*args, **kwargs):
    walks.append(args[2].shape)
    return reverse_walk(*args, **kwargs)

  backward_walk.state_grad_walk = counted
  x = _inputs(3, t_len=40, heads=4, key_heads=2, value_dim=64)
  names = tuple(x)

  def loss(implementation, *arrays):
    o, final = gated_delta_product(
      **dict(zip(names, arrays)),
      scale=0.3,
      output_final_state=True,
      chunk_size=32,  # r = 2: the Mosaic kernels' chunk, so the gradients use their inverses
      implementation=implementation,
    )
    return jnp.sum(o.astype(F32) * jnp.cos(o.astype(F32))) + jnp.sum(final**2), (o, final)

  out = {}
  grads = {}
  steps = {}
  for impl in ("mosaic_gpu", "reference"):
    # jitted: one program instead of one per eager operation
    steps[impl] = jax.jit(jax.value_and_grad(functools.partial(loss, impl), range(7), has_aux=True))
    (_, (o, final)), d = steps[impl](*x.values())
    grads[impl] = dict(zip(names, d))
    out[impl] = (o, final)
  (o, final), (o_ref, final_ref) = out["mosaic_gpu"], out["reference"]
  row = dict(
    reverse_walks=len(walks),
    o=_rel_rms(o.astype(F32), o_ref.astype(F32)),
    final=_rel_rms(final, final_ref),
    shape_ok=o.shape == x["v"].shape and o.dtype == x["q"].dtype and final.dtype == F32,
  )
  for name in names:
    row["d" + name] = _rel_rms(
      grads["mosaic_gpu"][name].astype(F32), grads["reference"][name].astype(F32)
    )
  # the non-finite guard: a nan in v at token 9 spoils nothing before it (without the guard the
  # chunk's products carry it to every token of its chunk)
  bad = dict(x, v=x["v"].at[:, 9, 1].set(jnp.nan))
  o_bad = jax.jit(lambda *a: loss("mosaic_gpu", *a)[1][0])(*bad.values()).astype(F32)
  row["nan_before"] = bool(jnp.isnan(o_bad[:, :9]).any())
  row["nan_after"] = bool(jnp.isnan(o_bad[:, 9:, 1]).all())
  row["o_before_bad"] = _rel_rms(o_bad[:, :9], o_ref.astype(F32)[:, :9])
  # the guard, differentiated: an inf in q (token 12), nans in k (token 9, key head 1) and -inf
  # in v (token 30, head 2); outputs nan at the same places as the reference's, and every
  # gradient of a finite input as the reference's (whose gradient of a non-finite entry is 0)
  bad = dict(x)
  bad["q"] = x["q"].at[:, 12, 0, 3].set(jnp.inf)
  bad["k"] = x["k"].at[:, 9, 1, :2].set(jnp.nan)
  bad["v"] = x["v"].at[:, 30, 2].set(-jnp.inf)
  runs = {impl: steps[impl](*bad.values()) for impl in steps}
  (_, (o_m, final_m)), d_m = runs["mosaic_gpu"]
  (_, (o_x, final_x)), d_x = runs["reference"]
  row["bad_nan_equal"] = bool(
    jnp.array_equal(jnp.isnan(o_m), jnp.isnan(o_x))
    and jnp.array_equal(jnp.isnan(final_m), jnp.isnan(final_x))
    and jnp.isnan(o_x).any()
    and not jnp.isnan(o_x[:, :9]).any()
  )
  # without gradient, the guard on cleaned copies (r = 2's default) and inside the kernels'
  # loads (LOAD_GUARD_KEY_BLOCKS): the same nan places and values
  fine = ~jnp.isnan(o_x)
  for label, in_loads in (("fwd", mosaic_impl.LOAD_GUARD_KEY_BLOCKS), ("loads", (2,))):
    mosaic_impl.LOAD_GUARD_KEY_BLOCKS = in_loads  # read when a call is traced
    o_f, final_f = jax.jit(lambda *a: loss("mosaic_gpu", *a)[1])(*bad.values())
    row[f"bad_{label}_nan_equal"] = bool(
      jnp.array_equal(jnp.isnan(o_f), jnp.isnan(o_x))
      and jnp.array_equal(jnp.isnan(final_f), jnp.isnan(final_x))
    )
    row[f"bad_{label}_o"] = _rel_rms(
      jnp.where(fine, o_f, 0).astype(F32), jnp.where(fine, o_x, 0).astype(F32)
    )
  for name, xm, dm, dx in zip(names, bad.values(), d_m, d_x):
    keep = jnp.isfinite(xm)
    dm, dx = (jnp.where(keep, d, 0).astype(F32) for d in (dm, dx))
    row["bad_finite_d" + name] = bool(jnp.isfinite(dm).all())
    row["bad_d" + name] = _rel_rms(dm, dx)
  # what a wrong mask orientation scores: the comparison can fail
  wrong = dict(x, mask=jnp.swapaxes(x["mask"], -1, -2))
  o_wrong = jax.jit(lambda *a: loss("reference", *a)[1][0])(*wrong.values())
  row["o_wrong"] = _rel_rms(o.astype(F32), o_wrong.astype(F32))
  row.update(_packed_interpreted())
  row["reverse_walks_with_packed"] = len(walks)
  row.update(_block_states_interpreted(mosaic_impl))
  return row


def _block_states_interpreted(mosaic_impl):
  """Block states (state_every = 64 at r = 2: every two of the kernels' 32-token chunks, T = 130
  padded to 160) against the reference's, with a nan in v at token 100 (head 1): the state
  after token 127 of head 1 and its outputs from token 100 on are nan, nothing else; the guard
  on cleaned copies (r = 2's default) and in the kernels' loads."""
  x = _inputs(11, t_len=130, heads=2, key_heads=1, value_dim=64)
  x["v"] = x["v"].at[0, 100, 1].set(jnp.nan)
  call = lambda impl: gated_delta_product(
    **x, scale=0.3, chunk_size=32, state_every=64, output_final_state=True, implementation=impl
  )
  o_ref, _, states_ref = jax.jit(lambda: call("reference"))()
  row = {}
  for label, in_loads in (("copies", ()), ("loads", (2,))):
    mosaic_impl.LOAD_GUARD_KEY_BLOCKS = in_loads
    o, _, states = jax.jit(lambda: call("mosaic_gpu"))()
    bad = np.zeros(states.shape, bool)
    bad[0, 1, 1] = True  # row 1 (after token 127), head 1
    states, want = np.asarray(states), np.asarray(states_ref)
    row[f"blocks_{label}_shape"] = states.shape == want.shape == (1, 2, 2, 64, 64)
    row[f"blocks_{label}_nan"] = bool(
      np.array_equal(np.isnan(states), bad) and np.array_equal(np.isnan(want), bad)
    )
    row[f"blocks_{label}"] = _rel_rms(states[~bad], want[~bad])
    fine = ~np.isnan(np.asarray(o_ref.astype(F32)))
    row[f"blocks_{label}_o"] = _rel_rms(
      np.asarray(o.astype(F32))[fine], np.asarray(o_ref.astype(F32))[fine]
    )
  return row


def _packed_functions(cu):
  """(call, loss) for packed sequences `cu`: `gated_delta_product`'s (o, final) of an
  implementation and inputs, and a loss of both."""

  def call(implementation, kw):
    return gated_delta_product(
      **kw, scale=0.3, cu_seqlens=cu, output_final_state=True, implementation=implementation
    )

  def loss(implementation, kw):
    o, final = call(implementation, kw)
    return jnp.sum(o.astype(F32) * jnp.cos(o.astype(F32))) + jnp.sum(final**2)

  return call, loss


def _packed_interpreted():
  """Packed sequences (the walks one program per sequence) against the reference: lengths 5, 0,
  40, 1, 30 at r = 2 (chunks of 32 tokens; an empty sequence, one of one token, one of two
  chunks), a per-token mask, an initial state per sequence; without gradient with a nan in one
  sequence, which spoils that sequence from its token on and nothing else; every gradient
  without it."""
  lengths = (5, 0, 40, 1, 30)
  cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
  x = _inputs(8, t_len=sum(lengths), heads=2, key_heads=2, value_dim=64)
  x["mask"] = jax.random.uniform(jax.random.PRNGKey(9), (1, sum(lengths), 2, 2, 2))
  x["initial_state"] = 0.3 * jax.random.normal(jax.random.PRNGKey(10), (5, 2, 64, 64))
  clean = dict(x)
  x["v"] = x["v"].at[0, 20, 1].set(jnp.nan)  # token 20: sequence 2 (tokens 5 to 44), head 1
  call, loss = _packed_functions(cu)

  implementations = ("mosaic_gpu", "reference")
  grads = {i: jax.jit(jax.grad(functools.partial(loss, i)))(clean) for i in implementations}
  run = lambda implementation: jax.jit(functools.partial(call, implementation))(x)
  (o, final), (o_ref, final_ref) = run("mosaic_gpu"), run("reference")
  fine = np.ones(o.shape[1:3], bool)
  fine[20:45, 1] = False
  o, o_ref = np.asarray(o[0].astype(F32)), np.asarray(o_ref[0].astype(F32))
  kept = np.array([0, 1, 3, 4])  # the sequences without the nan
  return dict(
    packed_o=_rel_rms(o[fine], o_ref[fine]),
    packed_nan=bool(np.isnan(o[20:45, 1]).all() and not np.isnan(o[fine]).any()),
    packed_final=_rel_rms(final[kept], final_ref[kept]),
    packed_empty_keeps_its_state=bool(jnp.array_equal(final[1], x["initial_state"][1])),
    **{
      f"packed_d{name}": _rel_rms(grads["mosaic_gpu"][name].astype(F32), ref.astype(F32))
      for name, ref in grads["reference"].items()
    },
  )


def _run_in_place_interpreted():
  """`_packed_in_place_interpreted` in a subprocess of its own (the slow tier), with the count
  of reverse walks its gradients ran (one: the pieces' walk)."""
  from pallas_kernels.mosaic_gpu import backward_walk

  walks = []
  reverse_walk = backward_walk.state_grad_walk

  def counted(*args, **kwargs):
    walks.append(kwargs.get("pieces") is not None)
    return reverse_walk(*args, **kwargs)

  backward_walk.state_grad_walk = counted
  row = _packed_in_place_interpreted()
  row["reverse_walks_over_pieces"] = walks
  row.update(_householder_in_place_interpreted())
  row.update(_long_sequence_in_pieces_interpreted())
  return row


def _long_sequence_in_pieces_interpreted():
  """A long sequence cut into pieces without gradient (docs/mosaic_gpu.md
  #long-sequences-in-pieces): lengths 10, 150, 7, 30 at r = 2 (chunks of 32), pieces of two
  chunks, so the boundary cuts would leave one piece of six chunks and the row is cut inside the
  long sequence (tests/test_varlen.py checks the tables); a per-token mask, two value heads on
  one key head. Clean, and with a nan in v at token 100 (head 1; the long sequence runs 10 to
  159) and an inf in q at token 170, against the reference."""
  from gdp_jax.ops.gated_delta_product import pieces
  from pallas_kernels.mosaic_gpu import forward

  walks = []  # the forward walks traced: with transitions or without
  walk = forward.state_walk_ws

  def counted(*args, **kwargs):
    walks.append(bool(kwargs.get("transitions")))
    return walk(*args, **kwargs)

  lengths = (10, 150, 7, 30)
  cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
  t_len = sum(lengths)
  x = _inputs(21, t_len=t_len, heads=2, key_heads=1, value_dim=64)
  del x["initial_state"]
  x["mask"] = jax.random.uniform(jax.random.PRNGKey(22), (1, t_len, 2, 2, 2))
  bad = dict(x, v=x["v"].at[0, 100, 1].set(jnp.nan), q=x["q"].at[0, 170, 0, 3].set(jnp.inf))
  call, _ = _packed_functions(cu)
  default = pieces.chunks_per_piece
  pieces.chunks_per_piece = lambda *a: 2
  forward.state_walk_ws = counted
  try:
    jitted = {i: jax.jit(functools.partial(call, i)) for i in ("mosaic_gpu", "reference")}
    traced = str(jax.make_jaxpr(functools.partial(call, "mosaic_gpu"))(x))
    results = {
      (i, label): jitted[i](kw) for i in jitted for label, kw in (("clean", x), ("bad", bad))
    }
  finally:
    pieces.chunks_per_piece = default
    forward.state_walk_ws = walk
  row = dict(long_cond="cond[" in traced and sorted(set(walks)) == [False, True])
  for label in ("clean", "bad"):
    (o, final), (o_ref, final_ref) = results["mosaic_gpu", label], results["reference", label]
    o, o_ref = np.asarray(o[0].astype(F32)), np.asarray(o_ref[0].astype(F32))
    final, final_ref = np.asarray(final), np.asarray(final_ref)
    fine, final_fine = np.isfinite(o_ref).all(-1), np.isfinite(final_ref).all(axis=(2, 3))
    row[f"long_{label}_nan_same"] = bool(
      np.array_equal(np.isfinite(o).all(-1), fine)
      and np.array_equal(np.isfinite(final).all(axis=(2, 3)), final_fine)
      and (label == "clean") == bool(fine.all())
    )
    row[f"long_{label}_o"] = _rel_rms(o[fine], o_ref[fine])
    row[f"long_{label}_final"] = _rel_rms(final[final_fine], final_ref[final_fine])
  return row


def _householder_in_place_interpreted():
  """The Householder form (n_h = 4, chunks of 16 tokens) with packed sequences read in place
  without gradient, in pieces of one chunk: lengths 3, 0, 37, 1, 13, 16, 9, 32 (starts inside
  chunks, an empty sequence, one of one token, one ending at a chunk's end); a nan in one
  sub-step of v (sequence 2) and an inf in q (sequence 5), against the reference."""
  from gdp_jax import householder_delta_product
  from gdp_jax.ops.gated_delta_product import pieces
  from tests.test_householder import hh_inputs

  n_h, lengths = 4, (3, 0, 37, 1, 13, 16, 9, 32)
  cu = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
  x = hh_inputs(95, n_h, B=1, T=sum(lengths), K=64, V=64, with_state=False, dtype=jnp.bfloat16)
  x["v"] = x["v"].at[0, n_h * 10 + 1, 1].set(jnp.nan)
  x["q"] = x["q"].at[0, 56, 0, 3].set(jnp.inf)

  def call(implementation, kw):
    return householder_delta_product(
      **kw, num_householder=n_h, cu_seqlens=cu, output_final_state=True, scale=0.3,
      implementation=implementation, chunk_size=64,
    )  # fmt: skip

  default = pieces.chunks_per_piece
  pieces.chunks_per_piece = lambda *a: 1
  try:
    traced = str(jax.make_jaxpr(functools.partial(call, "mosaic_gpu"))(x))
    (o, final), (o_ref, final_ref) = (jax.jit(functools.partial(call, i))(x) for i in
                                      ("mosaic_gpu", "reference"))  # fmt: skip
  finally:
    pieces.chunks_per_piece = default
  o, o_ref = np.asarray(o[0].astype(F32)), np.asarray(o_ref[0].astype(F32))
  bad, bad_ref = ~np.isfinite(o).all(-1), ~np.isfinite(o_ref).all(-1)
  fine = ~bad_ref
  final, final_ref = np.asarray(final), np.asarray(final_ref)
  final_bad = ~np.isfinite(final).all(axis=(2, 3))
  return dict(
    householder_walk=f"gdp_state_walk_ws_r{n_h}" in traced and "gdp_state_walk_ws_r1" not in traced,
    householder_bad_same=bool(np.array_equal(bad, bad_ref) and bad_ref.sum() > 1),
    householder_final_bad_same=bool(
      np.array_equal(final_bad, ~np.isfinite(final_ref).all(axis=(2, 3))) and final_bad.any()
    ),
    householder_o=_rel_rms(o[fine], o_ref[fine]),
    householder_final=_rel_rms(final[~final_bad], final_ref[~final_bad]),
  )


def _packed_in_place_interpreted():
  """Packed sequences without initial states, the row read in place and walked in pieces
  (docs/mosaic_gpu.md#packed-sequences-in-place), against the reference: lengths 5, 0, 27, 1,
  31, 32, 20, 20, 10 at r = 2 (chunks of 32 tokens: several sequences start in one chunk, two
  end at a chunk's end, an empty one, one of one token), two value heads on one key head, a
  per-token mask, pieces of about two chunks: chunks [0, 2], [2, 4] and [4, 4] (bounds inside a
  piece, the last piece a single silent chunk); every gradient with the final states in the
  loss; without gradient a nan in v at token 40 (sequence 4, tokens 33 to 63), head 1, which
  spoils that sequence from its token on and nothing else, and an inf in q at token 70, which
  spoils its own outputs only."""
  from gdp_jax.ops.gated_delta_product import pieces

  default = pieces.chunks_per_piece
  pieces.chunks_per_piece = lambda *a: 2
  try:
    return _packed_in_place_case()
  finally:
    pieces.chunks_per_piece = default


def _packed_in_place_case():
  """`_packed_in_place_interpreted` with the pieces set."""
  lengths = (5, 0, 27, 1, 31, 32, 20, 20, 10)
  cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
  x = _inputs(12, t_len=sum(lengths), heads=2, key_heads=1, value_dim=64)
  del x["initial_state"]
  x["mask"] = jax.random.uniform(jax.random.PRNGKey(13), (1, sum(lengths), 2, 2, 2))
  call, loss = _packed_functions(cu)

  implementations = ("mosaic_gpu", "reference")
  grads = {i: jax.jit(jax.grad(functools.partial(loss, i)))(x) for i in implementations}
  row = {
    f"in_place_d{name}": _rel_rms(grads["mosaic_gpu"][name].astype(F32), ref.astype(F32))
    for name, ref in grads["reference"].items()
  }
  jitted = {i: jax.jit(functools.partial(call, i)) for i in implementations}  # traced once each
  run = lambda implementation, kw: jitted[implementation](kw)
  (o, final), (o_ref, final_ref) = run("mosaic_gpu", x), run("reference", x)
  row["in_place_o"] = _rel_rms(o.astype(F32), o_ref.astype(F32))
  row["in_place_final"] = _rel_rms(final, final_ref)
  row["in_place_empty_zero"] = bool(jnp.all(final[1] == 0))
  bad = dict(x, v=x["v"].at[0, 40, 1].set(jnp.nan), q=x["q"].at[0, 70, 0, 3].set(jnp.inf))
  (o, final), (o_ref, _) = run("mosaic_gpu", bad), run("reference", bad)
  spoiled = np.zeros(o.shape[1:3], bool)
  spoiled[40:64, 1] = True
  spoiled[70, :] = True  # a bad q: its own token's outputs (both value heads of its key head)
  o, o_ref = np.asarray(o[0].astype(F32)), np.asarray(o_ref[0].astype(F32))
  final_bad = np.zeros(final.shape[:2], bool)
  final_bad[4, 1] = True
  row["in_place_nan"] = bool(
    np.array_equal(np.isnan(o).any(-1), spoiled)
    and np.isnan(o[spoiled]).all()
    and np.array_equal(np.isnan(np.asarray(final)).any(axis=(2, 3)), final_bad)
  )
  row["in_place_bad_o"] = _rel_rms(o[~spoiled], o_ref[~spoiled])
  return row


@pytest.fixture(scope="module")
def interpreted():
  return run_interpreted_subprocess(__file__, timeout=300)


@pytest.fixture(scope="module")
def interpreted_in_place():
  return run_interpreted_subprocess(__file__, timeout=300, flag="--interpreted-in-place")


def test_forward_interpreted_matches_the_reference(interpreted):
  row = interpreted
  assert row["shape_ok"], row
  assert row["o"] < 1e-2 and row["final"] < 1e-2, row
  assert row["o_wrong"] > 2e-2, row


def test_packed_forward_interpreted_matches_the_reference(interpreted):
  row = interpreted
  assert row["packed_o"] < 1e-2 and row["packed_final"] < 1e-2, row
  assert row["packed_nan"] and row["packed_empty_keeps_its_state"], row


def test_packed_gradients_interpreted_match_the_reference(interpreted):
  # the Mosaic backward on packed sequences: the reverse walk one program per sequence, the
  # chunk-parallel gradients over the chunk-aligned layout, every gradient back to the packed row
  row = interpreted
  assert row["reverse_walks_with_packed"] == 2, row
  for name in ("q", "k", "v", "g", "beta", "mask", "initial_state"):
    assert row["packed_d" + name] < 3e-2, (name, row)


def test_packed_in_place_interpreted_matches_the_reference(interpreted_in_place):
  # without initial states the packed row is read in place and walked in pieces
  # (docs/mosaic_gpu.md#packed-sequences-in-place): outputs, final states (from the pieces'
  # states) and every gradient through them, and a nan spoiling its own sequence only
  row = interpreted_in_place
  assert row["reverse_walks_over_pieces"] == [True], row
  assert row["in_place_o"] < 1e-2 and row["in_place_final"] < 1e-2, row
  assert row["in_place_empty_zero"] and row["in_place_nan"], row
  assert row["in_place_bad_o"] < 1e-2, row
  for name in ("q", "k", "v", "g", "beta", "mask"):
    assert row["in_place_d" + name] < 3e-2, (name, row)


def test_householder_packed_in_place_interpreted_matches_the_reference(interpreted_in_place):
  # the Householder form's forward reads packed rows in place too: the walk of n_h rows per
  # token over pieces (not the r = 1 operator over the sub-steps), a bad sub-step or q spoiling
  # what the reference spoils
  row = interpreted_in_place
  assert row["householder_walk"], row
  assert row["householder_bad_same"] and row["householder_final_bad_same"], row
  assert row["householder_o"] < 1e-2 and row["householder_final"] < 1e-2, row


def test_long_sequence_in_pieces_interpreted_matches_the_reference(interpreted_in_place):
  # without gradient a long sequence is cut into pieces walked beside their transitions, the
  # states entering them scanned and the outputs corrected (docs/mosaic_gpu.md
  # #long-sequences-in-pieces): a conditional between that walk and the boundary cuts' walk
  row = interpreted_in_place
  assert row["long_cond"], row
  for label in ("clean", "bad"):
    assert row[f"long_{label}_nan_same"], (label, row)
    assert row[f"long_{label}_o"] < 1e-2 and row[f"long_{label}_final"] < 1e-2, (label, row)


def test_a_nan_spoils_nothing_before_it(interpreted):
  row = interpreted
  assert not row["nan_before"] and row["nan_after"], row
  assert row["o_before_bad"] < 1e-2, row


def test_nonfinite_inputs_match_the_reference(interpreted):
  # the non-finite guard with and without gradient (docs/mosaic_gpu.md#the-guard-in-the-loads):
  # the same nan outputs and gradients as the reference's
  row = interpreted
  assert row["bad_nan_equal"], row
  for label in ("fwd", "loads"):  # cleaned copies, the guard in the kernels' loads
    assert row[f"bad_{label}_nan_equal"] and row[f"bad_{label}_o"] < 1e-2, (label, row)
  for name in ("q", "k", "v", "g", "beta", "mask", "initial_state"):
    assert row["bad_finite_d" + name] and row["bad_d" + name] < 3e-2, (name, row)


def test_block_states_interpreted_match_the_reference(interpreted):
  # the forward walk writing the state after every two chunks (docs/operator.md
  # #block-boundary-states), the guard on copies and in the loads
  row = interpreted
  for label in ("copies", "loads"):
    assert row[f"blocks_{label}_shape"] and row[f"blocks_{label}_nan"], (label, row)
    assert row[f"blocks_{label}"] < 1e-2 and row[f"blocks_{label}_o"] < 1e-2, (label, row)


def test_gradients_interpreted_match_the_reference(interpreted):
  # the Mosaic reverse walk and chunk-parallel gradients on the forward walk's stored states,
  # bf16 inputs
  row = interpreted
  assert row["reverse_walks"] == 1, row
  for name in ("q", "k", "v", "g", "beta", "mask", "initial_state"):
    assert row["d" + name] < 3e-2, (name, row)


if __name__ == "__main__" and "--interpreted-in-place" in sys.argv:
  print("RESULT " + json.dumps(_run_in_place_interpreted()))
if __name__ == "__main__" and "--interpreted" in sys.argv:
  print("RESULT " + json.dumps(_run_interpreted()))
