"""Packed variable-length sequences (`cu_seqlens`, docs/varlen.md): the chunk-aligned layout,
packed "reference" and "xla" equal to the reference run separately (outputs, final states and the
gradient of every input; separate: each sequence in its own row of a batch) and against the
float64 recurrence (each sequence on its own), one compilation for new boundaries, non-finite
inputs kept inside their sequence, the jnp backward of the packed chunked form, "pallas" (in the
interpreter) equal to the packed reference and its state walks with the per-chunk table through
the Triton lowering, the argument checks, and the Flax layer's packed call.

The other side of a comparison is the reference (the operator's recurrence: of its forms the
cheapest to compile), which test_implementations.py holds "xla" and "pallas" to."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gdp_jax import gated_delta_product
from gdp_jax.layers import GatedDeltaProduct, HouseholderDeltaProduct
from gdp_jax.ops.gated_delta_product import varlen, xla, xla_backward
from gdp_jax.ops.validation import normalize_mask
from pallas_kernels.common.backend import interpret_mode
from tests.cases import (
  GRAD_TOLERANCE,
  assert_close,
  cotangents,
  make_inputs,
  np_gated_delta_rule,
  outputs_and_grads,
  tol,
)

# Lengths 1, 16 (= the chunk), others off the chunk grid (one over two chunks), an empty sequence.
LENGTHS = (5, 1, 0, 23, 16)
CHUNK = 16
ARRAYS = ("q", "k", "v", "g", "beta", "mask", "initial_state")


def cu_of(lengths):
  return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def packed_inputs(seed, lengths, H=2, HV=None, K=16, V=8, r=2, mask_kind="head"):
  """Operator inputs [1, T, ...] for the packed sequences and one initial state per sequence."""
  HV = H if HV is None else HV
  T, N = sum(lengths), len(lengths)
  inputs = make_inputs(seed, B=1, T=T, H=HV, K=K, V=V, r=r, mask_kind=mask_kind, with_state=False)
  inputs["q"], inputs["k"] = inputs["q"][:, :, :H], inputs["k"][:, :, :H]
  rng = np.random.default_rng(seed + 7)
  inputs["initial_state"] = jnp.asarray(0.5 * rng.standard_normal((N, HV, K, V)), jnp.float32)
  return inputs


def run_packed(implementation, inputs, cu, chunk=CHUNK):
  return gated_delta_product(
    **inputs,
    cu_seqlens=cu,
    output_final_state=True,
    chunk_size=chunk,
    implementation=implementation,
  )


def run_separate(implementation, inputs, cu, chunk=CHUNK):
  """The N sequences run apart: one row each (a batch of N rows, right-padded with identity
  tokens: k = v = beta = g = 0), from their own initial states. Returns the rows' real outputs
  put back in packed order [1, T, HV, V] and the final states [N, HV, K, V] (an empty row's final
  state is its initial state)."""
  n_seq = len(cu) - 1
  lengths = np.diff(cu)
  width = int(lengths.max())

  def rows(x):
    pieces = [x[:, cu[n] : cu[n + 1]] for n in range(n_seq)]
    padding = lambda p: [(0, 0), (0, width - p.shape[1])] + [(0, 0)] * (p.ndim - 2)
    return jnp.concatenate([jnp.pad(p, padding(p)) for p in pieces])

  batch = dict(inputs)
  for name in ("q", "k", "v", "g", "beta"):
    batch[name] = rows(inputs[name])
  if inputs.get("mask") is not None and inputs["mask"].ndim == 5:
    batch["mask"] = rows(inputs["mask"])
  o, final = gated_delta_product(
    **batch, output_final_state=True, chunk_size=chunk, implementation=implementation
  )
  o = jnp.concatenate([o[n : n + 1, : lengths[n]] for n in range(n_seq)], axis=1)
  return o, final


def grads_of(fn, inputs, seed=0):
  """The gradient of <o, do> + <final, dfinal> in every array input."""
  names = [n for n in ARRAYS if inputs.get(n) is not None]
  do, dfinal = cotangents(seed, inputs["v"].shape, inputs["initial_state"].shape)

  def loss(*arrays):
    o, final = fn({**inputs, **dict(zip(names, arrays))})
    return jnp.sum(o.astype(jnp.float32) * do) + jnp.sum(final * dfinal)

  grad = jax.jit(jax.grad(loss, argnums=tuple(range(len(names)))))
  return dict(zip(names, grad(*[inputs[n] for n in names])))


# ---- the layout -----------------------------------------------------------------------------


def test_layout_tables():
  cu = cu_of((5, 1, 0, 23))
  lay = varlen.layout(cu, 29, 16)
  assert lay.num_chunks == varlen.max_chunks(29, 4, 16) == 5 and lay.t_pad == 80
  expected = list(range(5)) + [16] + list(range(32, 55))
  np.testing.assert_array_equal(lay.positions, expected)
  np.testing.assert_array_equal(lay.token_seq, [0] * 5 + [1] + [3] * 23)
  np.testing.assert_array_equal(lay.chunk_seq, [0, 1, 3, 3, 3])
  np.testing.assert_array_equal(lay.chunk_first, [1, 1, 1, 0, 0])
  np.testing.assert_array_equal(lay.chunk_last, [1, 1, 0, 1, 0])
  np.testing.assert_array_equal(lay.chunk_valid, [1, 1, 1, 1, 0])
  np.testing.assert_array_equal(lay.last_chunk, [0, 1, -1, 3])
  np.testing.assert_array_equal(lay.empty, [0, 0, 1, 0])
  x = jnp.arange(1.0, 30.0)[None, :, None]
  packed = varlen.pack(x, lay)
  assert packed.shape == (1, 80, 1)
  assert float(jnp.sum(packed)) == float(jnp.sum(x))  # zeros elsewhere
  np.testing.assert_array_equal(varlen.unpack(packed, lay), x)
  np.testing.assert_array_equal(lay.sources[lay.positions], np.arange(29))
  assert bool(jnp.all(jnp.delete(lay.sources, lay.positions) >= 29))  # padding: out of range
  np.testing.assert_array_equal(
    varlen.sequence_chunks(lay), [[0, 1, 2, 2], [1, 1, 0, 2], [0, 5, 6, 6], [5, 6, 6, 29]]
  )


@pytest.mark.parametrize("reverse_only", [False, True])
def test_pack_and_unpack_gradients(reverse_only):
  """pack and unpack are gathers; their vjps are each other (reverse_only: a custom_vjp of
  gathers; otherwise JAX's transposes), and the plain ones also have a jvp."""
  lay = varlen.layout(cu_of((5, 1, 0, 23)), 29, 16)
  x = jax.random.normal(jax.random.key(0), (1, 29, 2))
  y = jax.random.normal(jax.random.key(1), (1, 80, 2))
  pack = lambda x: varlen.pack(x, lay, reverse_only=reverse_only)
  unpack = lambda y: varlen.unpack(y, lay, reverse_only=reverse_only)
  np.testing.assert_array_equal(jax.vjp(pack, x)[1](y)[0], varlen.unpack(y, lay))
  np.testing.assert_array_equal(jax.vjp(unpack, y)[1](x)[0], varlen.pack(x, lay))
  if not reverse_only:
    np.testing.assert_array_equal(jax.jvp(pack, (x,), (x,))[1], varlen.pack(x, lay))


def test_max_chunks_is_a_bound_and_attained():
  rng = np.random.default_rng(0)
  for _ in range(200):
    n, c = int(rng.integers(1, 6)), int(rng.choice([4, 16]))
    lengths = rng.integers(0, 20, n)
    t_len = int(lengths.sum())
    if t_len == 0:
      continue
    used = int(np.sum(-(-lengths // c)))
    assert used <= varlen.max_chunks(t_len, n, c)
  # N - 1 sequences of one token and one of 17 = 1 mod 16 tokens: every chunk is used
  lengths = (1, 1, 1, 17)
  lay = varlen.layout(cu_of(lengths), 20, 16)
  assert bool(jnp.all(lay.chunk_valid)) and lay.num_chunks == 5


def test_sanitize_repairs_invalid_offsets():
  np.testing.assert_array_equal(varlen.sanitize(jnp.array([0, 4, 2, 9]), 7), [0, 4, 4, 7])
  np.testing.assert_array_equal(varlen.sanitize(jnp.array([3, 5]), 7), [0, 7])


# ---- packed equals separate ---------------------------------------------------------------------

# (implementation, r, mask kind, H, HV)
CASES = [
  ("reference", 1, None, 2, 2),
  ("reference", 2, "token", 1, 2),
  ("xla", 2, "head", 2, 2),
  ("xla", 2, "token", 1, 2),
]


@pytest.mark.parametrize("implementation,r,mask_kind,H,HV", CASES)
def test_packed_equals_separate(implementation, r, mask_kind, H, HV):
  inputs = packed_inputs(1, LENGTHS, H=H, HV=HV, r=r, mask_kind=mask_kind)
  cu = cu_of(LENGTHS)
  # outputs and gradients: one program per side (tests/cases.py outputs_and_grads)
  packed = lambda **kw: run_packed(implementation, kw, cu)
  (o, final), grads = outputs_and_grads(packed, inputs)
  assert o.shape == inputs["v"].shape and final.shape == inputs["initial_state"].shape
  separate = lambda **kw: run_separate("reference", kw, cu)
  (o_sep, final_sep), grads_sep = outputs_and_grads(separate, inputs)
  assert_close(o, o_sep, tol(jnp.float32), "o")
  assert_close(final, final_sep, tol(jnp.float32), "final states")
  np.testing.assert_array_equal(final[2], inputs["initial_state"][2])  # the empty sequence
  assert set(grads) == {n for n in ARRAYS if inputs.get(n) is not None}
  for name, d in grads.items():
    assert d.shape == inputs[name].shape, name
    assert_close(d, grads_sep[name], tol(jnp.float32, GRAD_TOLERANCE), f"d{name}")


@pytest.mark.parametrize("implementation", ["reference", "xla"])
def test_packed_against_float64_recurrence(implementation):
  """r = 1 without a mask is the gated delta rule: each sequence against tests/cases.py's
  float64 recurrence, from its own initial state; a reset (g = -inf) inside one of them."""
  inputs = packed_inputs(2, LENGTHS, H=2, r=1, mask_kind=None)
  inputs["g"] = inputs["g"].at[0, 30].set(-jnp.inf)  # inside sequence 3 ([6, 29))
  cu = cu_of(LENGTHS)
  # jitted: one compile instead of one per operation
  o, final = jax.jit(lambda kw: run_packed(implementation, kw, cu))(inputs)
  K = inputs["q"].shape[-1]
  for n in range(len(LENGTHS)):
    a, e = cu[n], cu[n + 1]
    h0 = inputs["initial_state"][n : n + 1]
    if a == e:
      np.testing.assert_array_equal(final[n], h0[0])
      continue
    arrays = (inputs[name][:, a:e] for name in ("q", "k", "v", "g", "beta"))
    o_np, f_np = np_gated_delta_rule(*arrays, K**-0.5, h0)
    assert_close(o[:, a:e], o_np, tol(jnp.float32), f"o of sequence {n}")
    assert_close(final[n], f_np[0], tol(jnp.float32), f"final state of sequence {n}")


def test_one_compilation_for_new_boundaries():
  traces = []

  @jax.jit
  def packed(cu, inputs):
    traces.append(cu.shape)
    return run_packed("xla", inputs, cu)

  inputs = packed_inputs(3, LENGTHS, r=2, mask_kind="token")
  for lengths in (LENGTHS, (20, 0, 0, 10, 15)):
    cu = cu_of(lengths)
    o, final = packed(jnp.asarray(cu), inputs)
    o_sep, final_sep = jax.jit(lambda kw, cu=cu: run_separate("reference", kw, cu))(inputs)
    assert_close(o, o_sep, tol(jnp.float32), f"o for {lengths}")
    assert_close(final, final_sep, tol(jnp.float32), f"final for {lengths}")
  assert len(traces) == 1


@pytest.mark.parametrize("implementation", ["reference", "xla"])
def test_non_finite_input_stays_in_its_sequence(implementation):
  inputs = packed_inputs(4, LENGTHS, r=2, mask_kind="head")
  cu = cu_of(LENGTHS)
  run = jax.jit(lambda kw: run_packed(implementation, kw, cu))  # one compile for both calls
  o, final = run(inputs)
  bad = dict(inputs, v=inputs["v"].at[0, 2, 0].set(jnp.nan))  # sequence 0, head 0, token 2
  o_bad, final_bad = run(bad)
  assert bool(jnp.all(jnp.isnan(o_bad[0, 2:5, 0]))) and bool(jnp.all(jnp.isnan(final_bad[0, 0])))
  np.testing.assert_array_equal(o_bad[0, :2], o[0, :2])
  np.testing.assert_array_equal(o_bad[0, 5:], o[0, 5:])
  np.testing.assert_array_equal(o_bad[0, :, 1], o[0, :, 1])
  np.testing.assert_array_equal(final_bad[1:], final[1:])


def test_pallas_non_finite_input_stays_in_its_sequence():
  """ "pallas" (its guard, docs/precision.md#non-finite-inputs), one jitted function for clean
  and bad inputs: a nan inside sequence 3's second chunk spoils that sequence from its token on
  (outputs and final state) and nothing else, and the gradient of a loss on everything else is
  the clean one."""
  inputs = packed_inputs(4, LENGTHS, r=2, mask_kind="token")
  cu = cu_of(LENGTHS)
  bad_t, end = 26, 29  # sequence 3 holds tokens 6..28; the kernels' chunks are 16 tokens
  do, dfinal = cotangents(0, inputs["v"].shape, inputs["initial_state"].shape)
  keep_o = jnp.ones(do.shape[:3], bool).at[0, bad_t:end, 0].set(False)[..., None]
  keep_final = jnp.ones(dfinal.shape[:2], bool).at[3, 0].set(False)[..., None, None]

  def loss(kw):
    o, final = run_packed("pallas", kw, cu)
    kept = jnp.sum(jnp.where(keep_o, o * do, 0.0)) + jnp.sum(jnp.where(keep_final, final, 0.0))
    return kept, (o, final)

  step = jax.jit(jax.value_and_grad(loss, has_aux=True))
  (value, (o, final)), grads = step(inputs)
  bad = dict(inputs, k=inputs["k"].at[0, bad_t, 0, 3].set(jnp.nan))
  (value_bad, (o_bad, final_bad)), grads_bad = step(bad)
  assert bool(jnp.all(jnp.isnan(o_bad[0, bad_t:end, 0]))) and bool(
    jnp.all(jnp.isnan(final_bad[3, 0]))
  )
  np.testing.assert_array_equal(jnp.where(keep_o, o_bad, 0.0), jnp.where(keep_o, o, 0.0))
  np.testing.assert_array_equal(final_bad[:3], final[:3])
  np.testing.assert_array_equal(final_bad[3, 1], final[3, 1])
  assert_close(value_bad, value, 1e-6, "loss")
  for name, d in grads.items():
    if d is not None:
      assert_close(grads_bad[name], d, 1e-6, f"d{name}")


@pytest.mark.parametrize("mask_kind", ["head", "token"])
def test_jnp_backward_of_packed_form(mask_kind):
  """xla_backward.gated_delta_product_xla_varlen_bwd (the stage-by-stage backward the kernels
  follow) equals JAX's vjp of the packed chunked form, grouped value heads included."""
  inputs = packed_inputs(5, LENGTHS, H=1, HV=2, r=2, mask_kind=mask_kind)
  T = sum(LENGTHS)
  mask, _ = normalize_mask(inputs["mask"], 1, T, 2, 16)
  cu = jnp.asarray(cu_of(LENGTHS))
  args = tuple(inputs[n] for n in ("q", "k", "v", "g", "beta")) + (mask, inputs["initial_state"])
  forward = lambda *a: xla.gated_delta_product_xla_varlen(*a, 0.3, CHUNK, cu)
  o, final = jax.eval_shape(forward, *args)
  do, dfinal = cotangents(6, o.shape, final.shape)
  expected = jax.jit(lambda *a: jax.vjp(forward, *a)[1]((do, dfinal)))(*args)
  backward = xla_backward.gated_delta_product_xla_varlen_bwd
  got = jax.jit(lambda *a: backward(*a, 0.3, CHUNK, cu, do, dfinal))(*args)
  for name, d, e in zip(ARRAYS, got, expected):
    assert d.shape == e.shape, name
    assert_close(d, e, tol(jnp.float32, GRAD_TOLERANCE), f"d{name}")


def test_default_implementation_with_cu_seqlens(monkeypatch):
  """implementation=None with cu_seqlens runs what it picks without them: "pallas" where that is
  the default (the packed kernels, checked on a GPU by benchmarks/bench_varlen.py), else "xla"."""
  from gdp_jax.ops import registry

  # a supported GPU's default (the Pallas backend; on this CPU the interpreted Triton kernels)
  monkeypatch.setattr(registry, "pallas_supported", lambda device=None: True)
  inputs = packed_inputs(7, (3, 9), r=1, mask_kind=None)
  cu = cu_of((3, 9))
  calls = []
  original = registry.Registry.resolve
  monkeypatch.setattr(
    registry.Registry,
    "resolve",
    lambda self, *a, **kw: calls.append((self.function, impl := original(self, *a, **kw))) or impl,
  )
  # traced only (resolved while traced; the packed kernels run in
  # test_pallas_packed_equals_the_reference)
  o, final = jax.eval_shape(
    lambda inputs, cu: gated_delta_product(**inputs, cu_seqlens=cu, output_final_state=True),
    inputs,
    cu,
  )
  assert [(f, impl.name) for f, impl in calls] == [("gated_delta_product", "triton")]
  o_none, none = jax.eval_shape(
    lambda inputs, cu: gated_delta_product(**inputs, cu_seqlens=cu),
    {**inputs, "initial_state": None},
    cu,
  )
  assert none is None and o_none.shape == o.shape == inputs["v"].shape


# ---- the Pallas kernels' packed form --------------------------------------------------------

# (r, mask kind, H, HV, chunk_size, backward, lengths): the forward (chunk_fwd and
# chunk_state_output reading the packed row in place), the backward's recompute (chunk_h) and
# walk (bwd_dhu); BT = 16. LENGTHS
# leave two unused chunks at the end of the layout (NT = 7, 5 used); with an empty first and
# last sequence added, four (NT = 9).
PALLAS_CASES = [
  (2, "token", 1, 2, 16, "pallas", (0, *LENGTHS, 0)),
  (1, None, 2, 2, 64, "pallas", LENGTHS),
  (1, "head", 2, 2, 16, "xla", LENGTHS),
]


@pytest.mark.parametrize("r,mask_kind,H,HV,chunk,backward,lengths", PALLAS_CASES)
def test_pallas_packed_equals_the_reference(r, mask_kind, H, HV, chunk, backward, lengths):
  """implementation="pallas" with cu_seqlens (interpreted) equals the packed reference: outputs,
  final states and the gradient of every input (initial_state included, with a final-state
  cotangent), over lengths 0, 1, the chunk and off the chunk grid (the layout at the kernels'
  BT = 16 whatever chunk_size says)."""
  from pallas_kernels.common.options import DEFAULT

  inputs = packed_inputs(11, lengths, H=H, HV=HV, r=r, mask_kind=mask_kind)
  cu = cu_of(lengths)
  empty = [n for n, length in enumerate(lengths) if length == 0]
  extra = dict(options=DEFAULT.replace(precision="ieee"), backward=backward)
  pallas = lambda kw: gated_delta_product(
    **kw, **extra, cu_seqlens=cu, output_final_state=True, chunk_size=chunk, implementation="pallas"
  )
  o, final = jax.jit(pallas)(inputs)  # the forward without gradient: the fused kernels
  # the reference: outputs and gradients from one program (tests/cases.py outputs_and_grads)
  (o_ref, final_ref), grads_ref = outputs_and_grads(
    lambda **kw: run_packed("reference", kw, cu, chunk), inputs
  )
  assert o.shape == o_ref.shape and final.shape == final_ref.shape
  assert_close(o, o_ref, tol(jnp.float32), "o")
  assert_close(final, final_ref, tol(jnp.float32), "final states")
  for n in empty:
    np.testing.assert_array_equal(final[n], inputs["initial_state"][n])
  grads = grads_of(pallas, inputs)
  for name, d in grads.items():
    assert d.shape == inputs[name].shape, name
    assert_close(d, grads_ref[name], tol(jnp.float32, GRAD_TOLERANCE), f"d{name}")
  # an empty sequence's initial state: its gradient is its final state's cotangent
  _, dfinal = cotangents(0, inputs["v"].shape, inputs["initial_state"].shape)
  for n in empty:
    np.testing.assert_array_equal(grads["initial_state"][n], dfinal[n])


def test_pallas_state_walks_run_each_sequence_apart():
  """The state walks with the per-sequence table (interpreted) equal the unpacked walks over each
  sequence's chunks alone, from its own state: lengths (0, 27, 9, 0), chunk counts (0, 2, 1, 0)
  of NT = 6 (an empty first and last sequence, three unused chunks at the end). chunk_state_output
  reads q and k from the packed row in place and writes o there (the sequence of 27 tokens ends
  mid-chunk, before the one of 9); chunk_h and bwd_dhu walk the chunk-aligned copy. The unused
  chunks, filled with random values here, get what a walk from a zero state writes (h = dh = 0,
  v_new = u, dv_new = dv_local); an empty sequence's final state is its initial state, its
  d initial state its dfinal. The interpreter fills unwritten outputs with nan, so a skipped chunk
  fails; and with the table cut after the 27 tokens the 9 tokens' rows of o stay nan (no masked
  store wrote past its sequence)."""
  from pallas_kernels.triton.backward import bwd_dhu
  from pallas_kernels.triton.forward import chunk_h, chunk_state_output

  chunk, r, K, V = 16, 1, 16, 16
  lengths = (0, 27, 9, 0)
  lay = varlen.layout(cu_of(lengths), sum(lengths), chunk)
  table = varlen.sequence_chunks(lay)
  starts, counts = np.asarray(table[0]), np.asarray(table[1])
  n_seq, nt = len(lengths), lay.num_chunks
  T = nt * chunk
  keys = jax.random.split(jax.random.key(3), 9)
  normal = lambda i, shape: 0.5 * jax.random.normal(keys[i], shape, jnp.float32)
  q_row, k_row = normal(0, (1, lay.t_len, 1, K)), normal(1, (1, lay.t_len, 1, K))
  q, k = varlen.pack(q_row, lay), varlen.pack(k_row, lay)  # zero padding
  do = normal(2, (1, T, 1, V))
  w, u, dvl = normal(3, (1, 1, T * r, K)), normal(4, (1, 1, T * r, V)), normal(5, (1, 1, T, V))
  g = -jnp.abs(normal(6, (1, 1, nt, chunk)))
  gamma = jnp.cumsum(g, axis=-1).reshape(1, 1, T)
  h0, dfinal = normal(7, (n_seq, 1, K, V)), normal(8, (n_seq, 1, K, V))
  kw = dict(chunk=chunk, key_blocks=r, precision="ieee")
  walk = dict(scale=0.3, save_states=True, h_dtype=jnp.float32, table=table, in_place=True, **kw)
  o_row, final, h, v_new = chunk_state_output.chunk_state_output(
    q_row, k_row, w, u, gamma, h0, **walk
  )
  o = varlen.pack(o_row, lay)
  h2, v_new2, final2 = chunk_h.chunk_state(
    k, w, u, gamma, h0, h_dtype=jnp.float32, table=table, **kw
  )
  dh, dh0, dv_new = bwd_dhu.chunk_bwd_dhu(
    q, k, w, gamma, do, dvl, dfinal, scale=0.3, table=table, **kw
  )
  for x in (o_row, final, h, v_new, h2, v_new2, final2, dh, dh0, dv_new):
    assert bool(jnp.all(jnp.isfinite(x)))
  np.testing.assert_array_equal(h2, h)
  np.testing.assert_array_equal(v_new2, v_new)
  np.testing.assert_array_equal(final2, final)
  for n in range(n_seq):
    if counts[n] == 0:
      np.testing.assert_array_equal(final[n], h0[n])
      np.testing.assert_array_equal(dh0[n], dfinal[n])
      continue
    a, e = starts[n] * chunk, (starts[n] + counts[n]) * chunk
    cs = slice(starts[n], starts[n] + counts[n])
    tok = lambda x: x[:, a:e]
    rows = lambda x: x[:, :, a * r : e * r]
    h0n, dfn = h0[n : n + 1], dfinal[n : n + 1]
    o1, f1, h1, vn1 = chunk_state_output.chunk_state_output(
      tok(q),
      tok(k),
      rows(w),
      rows(u),
      gamma[..., a:e],
      h0n,
      scale=0.3,
      save_states=True,
      h_dtype=jnp.float32,
      **kw,
    )
    dh1, dh01, dvn1 = bwd_dhu.chunk_bwd_dhu(
      tok(q), tok(k), rows(w), gamma[..., a:e], tok(do), rows(dvl), dfn, scale=0.3, **kw
    )
    valid = (jnp.arange(a, e) < a + lengths[n])[None, :, None, None]  # o of padding: not kept
    for got, want, what in [
      (tok(o), jnp.where(valid, o1, 0.0), "o"),
      (final[n : n + 1], f1, "final"),
      (h[:, :, cs], h1, "h"),
      (rows(v_new), vn1, "v_new"),
      (dh[:, :, cs], dh1, "dh"),
      (dh0[n : n + 1], dh01, "dh0"),
      (rows(dv_new), dvn1, "dv_new"),
    ]:
      assert_close(got, want, 1e-5, f"{what} of sequence {n}")
  used = int(counts.sum()) * chunk  # the unused chunks: a step from a zero state
  np.testing.assert_array_equal(h[:, :, counts.sum() :], 0.0)
  np.testing.assert_array_equal(dh[:, :, counts.sum() :], 0.0)
  assert_close(v_new[:, :, used * r :], u[:, :, used * r :], 1e-6, "v_new of the unused chunks")
  assert_close(dv_new[:, :, used * r :], dvl[:, :, used * r :], 1e-6, "dv_new of the unused chunks")
  cut = dict(walk, table=table[:, :2], save_states=False)  # sequences 0 and 1 only
  o_cut, final_cut = chunk_state_output.chunk_state_output(q_row, k_row, w, u, gamma, h0[:2], **cut)
  if interpret_mode():  # compiled, unwritten rows hold whatever memory held
    assert bool(jnp.all(jnp.isnan(o_cut[:, 27:]))), "rows past the last sequence were written"
  np.testing.assert_array_equal(o_cut[:, :27], o_row[:, :27])
  np.testing.assert_array_equal(final_cut, final[:2])


@pytest.mark.parametrize("r,dtype", [(1, jnp.bfloat16), (2, jnp.float32)])
def test_pallas_state_walks_with_table_lower_to_triton(monkeypatch, r, dtype):
  """The state walks with the per-sequence table (chunk_state_output with and without its saved
  states, chunk_h, bwd_dhu: a grid over the sequences, loops with traced bounds, the unused
  chunks' step) through the Pallas Triton lowering for an H200; NT = 5 and N = 3 are not powers
  of two."""
  from pallas_kernels.triton.backward import bwd_dhu
  from pallas_kernels.triton.forward import chunk_h, chunk_state_output
  from tests.triton_lowering import lower_for_h200

  S = jax.ShapeDtypeStruct
  K, V, N, chunk = 128, 64, 3, 64 // r
  nt = 5
  T = nt * chunk
  tok = S((1, T, 1, K), dtype)
  rows_k, rows_v = S((1, 1, T * r, K), dtype), S((1, 1, T * r, V), dtype)
  gam, states = S((1, 1, T), jnp.float32), S((N, 1, K, V), jnp.float32)
  table, do = S((2, N), jnp.int32), S((1, T, 1, V), dtype)

  def walks(q, k, w, u, gamma, h0, table, do, dvl):
    common = dict(key_blocks=r, chunk=chunk, table=table)
    outs = [
      chunk_state_output.chunk_state_output(
        q, k, w, u, gamma, h0, scale=0.1, save_states=save, **common
      )
      for save in (False, True)
    ]
    outs.append(chunk_h.chunk_state(k, w, u, gamma, h0, **common))
    outs.append(bwd_dhu.chunk_bwd_dhu(q, k, w, gamma, do, dvl, h0, scale=0.1, **common))
    return outs

  dvl = S(rows_v.shape, jnp.float32)
  modules = lower_for_h200(
    monkeypatch, walks, tok, tok, rows_k, rows_v, gam, states, table, do, dvl
  )
  assert len(modules) == 4 and all("tt.func" in m for m in modules)


# ---- the kernels that read the packed row in place --------------------------------------------

# BT = 16: an empty first and last sequence, one token, a sequence ending mid-chunk (5) followed
# by another, one over a chunk (21) and one that ends the row mid-chunk (9); NT = 7, 5 used.
INPLACE_LENGTHS = (0, 1, 5, 21, 9, 0)


def test_chunk_fwd_in_place_equals_padded_copy():
  """chunk_fwd reading k, v, g and beta of the packed row in place with its per-chunk table
  (varlen.chunk_tokens; interpreted) gives exactly what it gives on the chunk-aligned copy:
  gamma, w, u and Ai, over empty sequences, one token, a sequence ending mid-chunk followed by
  another and the unused chunks, grouped value heads and a per-token mask. (chunk_state_output
  in place: test_pallas_state_walks_run_each_sequence_apart.)"""
  from pallas_kernels.triton.forward import chunk_fwd

  r, H, HV = 2, 1, 2

  K, V, T = 16 * r, 16, sum(INPLACE_LENGTHS)
  lay = varlen.layout(cu_of(INPLACE_LENGTHS), T, 16)
  keys = jax.random.split(jax.random.key(12), 5)
  row = dict(
    k=0.5 * jax.random.normal(keys[0], (1, T, H, K)),
    v=0.5 * jax.random.normal(keys[1], (1, T, HV, V)),
    g=-jnp.abs(jax.random.normal(keys[2], (1, T, HV))),
    beta=jax.random.uniform(keys[3], (1, T, HV)),
  )
  padded = {n: varlen.pack(x, lay) for n, x in row.items()}
  # per token, in the chunk-aligned layout for both
  mask = varlen.pack(jax.random.uniform(keys[4], (1, T, HV, r, r)), lay)
  hm = lambda x: jnp.moveaxis(x, 1, 2)  # [1, T, H] -> [1, H, T]
  fwd = dict(key_blocks=r, chunk=16, precision="ieee", save_ai=True)

  @jax.jit  # both calls in one program: one compile instead of one per operation
  def both(row, padded, mask, table):
    want = chunk_fwd.chunk_fwd(
      padded["k"], padded["v"], hm(padded["g"]), hm(padded["beta"]), mask, **fwd
    )
    got = chunk_fwd.chunk_fwd(
      row["k"], row["v"], hm(row["g"]), hm(row["beta"]), mask, table=table, **fwd
    )
    return got, want

  got, want = both(row, padded, mask, varlen.chunk_tokens(lay))
  for x, y, what in zip(got, want, ("gamma", "w", "u", "Ai")):
    np.testing.assert_array_equal(x, y, err_msg=what)


@pytest.mark.parametrize(
  "r,dtype,T,N,H,HV,per_token",
  [(1, jnp.bfloat16, 8 * 4096, 64, 16, 16, False), (2, jnp.float32, 200, 3, 1, 2, True)],
)
def test_fused_kernels_in_place_lower_to_triton(monkeypatch, r, dtype, T, N, H, HV, per_token):
  """chunk_fwd with its per-chunk table and chunk_state_output in place (masked loads of the
  packed row at traced offsets, masked stores of o) through the Pallas Triton lowering for an
  H200, as they ship (default precision and inverse): the benchmark's shape (bf16, 8 x 4096
  tokens in 64 sequences, H = 16, K = V = 128), and T = 200 (not a multiple of the chunk) with
  grouped heads and a per-token mask at r = 2."""
  from pallas_kernels.triton.forward import chunk_fwd, chunk_state_output
  from tests.triton_lowering import lower_for_h200

  S = jax.ShapeDtypeStruct
  K = V = 128
  chunk = 64 // r
  nt = varlen.max_chunks(T, N, chunk)
  tp = nt * chunk
  keys, vals, per_head = S((1, T, H, K), dtype), S((1, T, HV, V), dtype), S((1, HV, T), jnp.float32)
  mask = S((1, tp, HV, r, r) if per_token else (1, 1, 1, r, r), jnp.float32)
  rows_k, rows_v = S((1, HV, tp * r, K), dtype), S((1, HV, tp * r, V), dtype)
  gamma, h0 = S((1, HV, tp), jnp.float32), S((N, HV, K, V), jnp.float32)
  chunks, seqs = S((2, nt), jnp.int32), S((4, N), jnp.int32)

  def fused(q, k, v, g, beta, mask, chunks, w, u, gamma, h0, seqs):
    common = dict(key_blocks=r, chunk=chunk)
    outs = [
      chunk_fwd.chunk_fwd(k, v, g, beta, mask, save_ai=save, table=chunks, **common)
      for save in (False, True)
    ]
    for save in (False, True):
      outs.append(
        chunk_state_output.chunk_state_output(
          q, k, w, u, gamma, h0, scale=0.1, save_states=save, table=seqs, in_place=True, **common
        )
      )
    return outs

  avals = (keys, keys, vals, per_head, per_head, mask, chunks, rows_k, rows_v, gamma, h0, seqs)
  modules = lower_for_h200(monkeypatch, fused, *avals)
  assert len(modules) == 4 and all("tt.func" in m for m in modules)


def test_pallas_packed_forward_makes_no_copies():
  """The fused packed forward (a call without gradient) gathers no float array: q, k, v, g, beta
  and o stay in the packed row (the layout's tables are int gathers); the backward gathers them
  into the chunk-aligned layout (which shows the check can fail)."""
  from pallas_kernels.common.options import DEFAULT

  inputs = packed_inputs(3, (5, 11, 0, 20), H=2, r=1, mask_kind=None)
  cu = cu_of((5, 11, 0, 20))

  def float_gathers(grad):
    call = lambda kw: gated_delta_product(
      **kw, cu_seqlens=cu, chunk_size=16, implementation="pallas", options=DEFAULT
    )
    loss = lambda kw: call(kw)[0].astype(jnp.float32).sum()
    run = jax.grad(loss) if grad else call
    found = []

    def walk(jaxpr):
      for e in jaxpr.eqns:
        if e.primitive.name in ("gather", "scatter", "scatter-add"):
          if jnp.issubdtype(e.invars[0].aval.dtype, jnp.floating):
            found.append(e.invars[0].aval.shape)
        if e.primitive.name == "pallas_call":
          continue
        for p in e.params.values():
          for sub in p if isinstance(p, (tuple, list)) else (p,):
            if hasattr(sub, "eqns") or hasattr(sub, "jaxpr"):
              walk(getattr(sub, "jaxpr", sub))

    walk(jax.make_jaxpr(run)(inputs).jaxpr)
    return found

  assert float_gathers(False) == []
  assert len(float_gathers(True)) >= 6  # the backward: q, k, v, g, beta, do in


def test_in_place_kernels_reject_bad_tables():
  from pallas_kernels.triton.forward import chunk_fwd, chunk_state_output

  T, tp, K = 20, 48, 16
  k, w = jnp.zeros((1, T, 1, K)), jnp.zeros((1, 1, tp, K))
  gamma, h0 = jnp.zeros((1, 1, tp)), jnp.zeros((2, 1, K, K))
  walk = dict(key_blocks=1, chunk=16, scale=1.0)
  with pytest.raises(ValueError, match="in_place=True needs the per-sequence table"):
    chunk_state_output.chunk_state_output(k, k, w, w, gamma, h0, in_place=True, **walk)
  with pytest.raises(ValueError, match=r"table must be int32 \[4, N\]"):
    table = jnp.zeros((2, 2), jnp.int32)  # no token rows
    chunk_state_output.chunk_state_output(k, k, w, w, gamma, h0, table=table, in_place=True, **walk)
  scalars, mask = jnp.zeros((1, 1, T)), jnp.ones((1, 1, 1, 1, 1))
  with pytest.raises(ValueError, match=r"table must be int32 \[2, NT\]"):
    chunk_fwd.chunk_fwd(
      k, k, scalars, scalars, mask, key_blocks=1, chunk=16, table=jnp.zeros((4, 3), jnp.int32)
    )
  with pytest.raises(ValueError, match="per-token mask must be"):
    per_token = jnp.ones((1, T, 1, 1, 1))  # the packed row's, not the layout's
    chunk_fwd.chunk_fwd(
      k, k, scalars, scalars, per_token, key_blocks=1, chunk=16, table=jnp.zeros((2, 3), jnp.int32)
    )


def test_chunk_tokens_table():
  """The per-chunk table of the in-place kernels: each chunk's first token and token count."""
  lay = varlen.layout(cu_of(INPLACE_LENGTHS), sum(INPLACE_LENGTHS), 16)
  np.testing.assert_array_equal(
    varlen.chunk_tokens(lay), [[0, 1, 6, 22, 27, 36, 36], [1, 5, 16, 5, 9, 0, 0]]
  )
  np.testing.assert_array_equal(
    varlen.sequence_chunks(lay),
    [[0, 0, 1, 2, 4, 5], [0, 1, 1, 2, 1, 0], [0, 0, 1, 6, 27, 36], [0, 1, 6, 27, 36, 36]],
  )


# ---- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
  "change,error,words",
  [
    (dict(cu_seqlens=[0, 2, 9, 12]), ValueError, "cu_seqlens must end at T = 10"),
    (dict(cu_seqlens=[1, 2, 5, 10]), ValueError, "cu_seqlens must start at 0"),
    (dict(cu_seqlens=[0, 6, 5, 10]), ValueError, "cu_seqlens must be non-decreasing"),
    (dict(cu_seqlens=np.array([0.0, 2, 5, 10])), TypeError, "integer dtype"),
    (dict(cu_seqlens=np.zeros((2, 2), np.int32)), ValueError, "cu_seqlens must be [N + 1]"),
    (dict(cu_seqlens=np.zeros((1,), np.int32)), ValueError, "cu_seqlens must be [N + 1]"),
    (dict(cu_seqlens="0,10"), TypeError, "cu_seqlens must be an int32 array"),
    (
      dict(cu_seqlens=np.array([0, 2, 2**33, 10], np.int64)),
      ValueError,
      "cu_seqlens holds values outside int32",
    ),
    (
      dict(initial_state=jnp.zeros((1, 2, 16, 8))),
      ValueError,
      "initial_state has shape (1, 2, 16, 8), expected (3, 2, 16, 8)",
    ),
    (dict(implementation="cuda"), ValueError, "implementation must be one of"),
  ],
)
def test_bad_inputs_raise(change, error, words):
  inputs = packed_inputs(8, (2, 3, 5), r=2, mask_kind="head")
  kw = dict(inputs, cu_seqlens=cu_of((2, 3, 5)))
  kw.update(change)
  with pytest.raises(error) as info:
    gated_delta_product(**kw)
  assert words in str(info.value)


def test_batch_must_be_one():
  inputs = make_inputs(9, B=2, T=10, H=2, K=16, V=8, r=1, mask_kind=None, with_state=False)
  with pytest.raises(ValueError, match="with cu_seqlens the batch size must be 1"):
    gated_delta_product(**inputs, cu_seqlens=cu_of((4, 6)))


# ---- the layer ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
  "layer_class,kw",
  [
    # (the static mask's packed call: the operator's in test_packed_equals_separate, the
    # layer's packed documents in test_layers.py)
    (GatedDeltaProduct, dict(num_blocks=2, num_v_heads=4, mask_mode="token")),
    (HouseholderDeltaProduct, dict(num_householder=2)),
  ],
  ids=["grouped-token", "householder"],
)
def test_layer_packed_call_equals_separate_calls(layer_class, kw):
  """Outputs, the per-document caches of a packed prefill and the gradient in x equal those of
  the documents run apart (one row each, right-padded, with `lengths`): neither the short
  convolution nor the state crosses a document boundary. The layers run the operator's
  recurrence ("reference"): what is checked is the layer's packing, and its programs compile
  fastest."""
  D = 16
  layer = layer_class(
    D, 2, 8, expand_v=2, chunk_size=16, implementation="reference", rngs=nnx.Rngs(0), **kw
  )
  lengths = (5, 1, 0, 21)
  cu, width = cu_of(lengths), max(lengths)
  x = jax.random.normal(jax.random.key(1), (1, sum(lengths), D))
  w = jax.random.normal(jax.random.key(2), x.shape)

  def packed(x, cu):
    y, cache = layer(x, cu_seqlens=cu, return_cache=True)
    return jnp.sum(y * w), (y, cache)

  def apart(x):
    rows = jnp.concatenate(
      [jnp.pad(x[:, a:e], ((0, 0), (0, width - (e - a)), (0, 0))) for a, e in zip(cu, cu[1:])]
    )
    y, cache = layer(rows, jnp.asarray(lengths), return_cache=True)
    y = jnp.concatenate([y[n : n + 1, :length] for n, length in enumerate(lengths)], axis=1)
    return jnp.sum(y * w), (y, cache)

  (dx, (y, cache)) = jax.jit(jax.grad(packed, has_aux=True))(x, jnp.asarray(cu))
  (dx1, (y1, cache1)) = jax.jit(jax.grad(apart, has_aux=True))(x)
  assert cache.state.shape == cache1.state.shape and cache.conv.shape == cache1.conv.shape
  assert not np.any(cache.state[2]) and not np.any(cache.conv[2])  # the empty document
  assert_close(y, y1, 1e-5, "y")
  assert_close(cache.state, cache1.state, 1e-5, "states")
  assert_close(cache.conv, cache1.conv, 1e-6, "conv states")
  assert_close(dx, dx1, 1e-4, "dx")


def test_layer_cu_seqlens_bad_inputs():
  layer = GatedDeltaProduct(16, 2, 8, chunk_size=16, implementation="xla", rngs=nnx.Rngs(0))
  x = jnp.ones((2, 6, 16))
  with pytest.raises(ValueError, match="batch size must be 1"):
    layer(x, cu_seqlens=cu_of((2, 4)))
  with pytest.raises(ValueError, match="without lengths and segment_ids"):
    layer(x[:1], jnp.array([6]), cu_seqlens=cu_of((2, 4)))
  with pytest.raises(ValueError, match="cu_seqlens must end at T = 6"):
    layer(x[:1], cu_seqlens=cu_of((2, 3)))


def test_piece_table_cuts_at_boundaries():
  """The in-place pieces (gdp_jax/ops/gated_delta_product/pieces.py, docs/mosaic_gpu.md
  #packed-sequences-in-place): ten sequences of 40 tokens in chunks of 32 (NC = 13), cut about
  every 3 chunks. Boundaries (chunks where a sequence starts) 1, 2, 3, 5, 6, 7, 8, 10, 11; cuts
  at the boundary nearest 3, 6, 9, 12 (the later on a tie): 3, 6, 10, 11; the rows longest
  piece first (stable)."""
  from gdp_jax.ops.gated_delta_product import pieces

  table, bounds = pieces.piece_table(jnp.asarray(cu_of((40,) * 10)), 400, 32, 3)
  past = 14
  assert bounds.tolist() == [1, 2, 3, 5, 6, 7, 8, 10, 11, 12, past, past]
  # first chunk, count, flags (1: forward silent first, 2: reverse silent first), bounds before
  # the first chunk, the last bound at or before the last chunk
  assert table[:, :5].tolist() == [
    [6, 5, 3, 4, 7],
    [0, 4, 2, 0, 2],
    [3, 4, 3, 2, 4],
    [10, 2, 3, 7, 8],
    [11, 2, 1, 8, 9],
  ]
  # every chunk walked by exactly one piece that writes it, forward and reverse
  first, count, flags = (np.asarray(table[:, i]) for i in range(3))
  for silent_flag, silent_step in ((1, lambda f, c: f), (2, lambda f, c: f + c - 1)):
    written = np.zeros(13, int)
    for f, c, fl in zip(first, count, flags):
      for chunk in range(f, f + c):
        written[chunk] += not (fl & silent_flag and chunk == silent_step(f, c))
    assert written.tolist() == [1] * 13


def test_split_table_cuts_inside_long_sequences():
  """Without gradient a row whose boundary cuts leave a piece longer than SPLIT_WHEN_LONGER
  times the pieces' length is cut every `per_piece` chunks (docs/mosaic_gpu.md
  #long-sequences-in-pieces): lengths 10, 150, 7, 30 in chunks of 32 (NC = 7), pieces of 2
  chunks. Sequence starts in chunks 0 and 5 (two); each piece after the first carries its
  transition through the first chunk where a sequence starts, or to its end (the span)."""
  from gdp_jax.ops.gated_delta_product import pieces

  cu = jnp.asarray(cu_of((10, 150, 7, 30)))
  boundary, _ = pieces.piece_table(cu, 224, 32, 2)
  assert int(jnp.max(boundary[:, 1])) > pieces.SPLIT_WHEN_LONGER * 2  # the long piece: 6 chunks
  table, bounds = pieces.split_table(cu, 224, 32, 2)
  assert bounds.tolist() == [0, 5, 6, 8, 8, 8, 8, 8]
  # first chunk, count, flags (none silent), bounds before the first chunk, the last bound at
  # or before the last chunk, the span
  assert table[:, :6].tolist() == [
    [0, 2, 0, 0, 0, 0],
    [2, 2, 0, 1, 0, 2],
    [4, 2, 0, 1, 1, 2],
    [6, 1, 0, 2, 2, 1],
  ]


def test_entering_states_scan_the_pieces():
  """The state entering piece p + 1 is E_p + A_p S_p (`pieces.entering_states`), checked against
  the products written out for three pieces."""
  from gdp_jax.ops.gated_delta_product import pieces

  key = jax.random.split(jax.random.PRNGKey(3), 2)
  walked = jax.random.normal(key[0], (3, 2, 4, 5))
  transition = jax.random.normal(key[1], (3, 2, 4, 4))
  got = pieces.entering_states(jnp.concatenate([walked, transition], -1), 5)
  mm = lambda a, b: jnp.einsum("hkl,hlv->hkv", a, b, precision="highest")
  s1 = walked[0] + mm(transition[0], jnp.zeros((2, 4, 5)))
  s2 = walked[1] + mm(transition[1], s1)
  np.testing.assert_allclose(got, jnp.stack([jnp.zeros_like(s1), s1, s2]), rtol=1e-5, atol=1e-5)
