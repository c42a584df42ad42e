"""`gated_delta_product(..., state_every=N)`: the states after every N tokens equal the
reference's final states of the truncated prefixes (docs/operator.md#block-boundary-states)."""

from __future__ import annotations

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdp_jax import gated_delta_product
from gdp_jax.ops.gated_delta_product.api import REGISTRY
from gdp_jax.ops.gated_delta_product.base import Problem
from gdp_jax.varlen import block_offsets
from tests.cases import make_inputs

EVERY, CHUNK = 16, 16
ARRAYS = ("q", "k", "v", "g", "beta", "mask")


def _inputs(B, T, seed=0):
  # grouped value heads (H = 2 key heads, 4 value heads), r = 2 with a per-token mask
  inp = make_inputs(seed, B=B, T=T, H=4, K=32, V=16, r=2, mask_kind="token")
  inp["q"], inp["k"] = inp["q"][:, :, :2], inp["k"][:, :, :2]
  return inp


def _prefix_finals(inp, ends, starts=None, states=None):
  """The reference's final state of tokens [start, end) of row 0 (start 0 without `starts`) from
  the initial state `states[i]` (the row's own without): one program for all prefixes."""

  def run(inp):
    out = []
    for i, end in enumerate(ends):
      start = 0 if starts is None else starts[i]
      cut = {n: inp[n][:, start:end] for n in ARRAYS}
      h0 = inp["initial_state"] if states is None else inp["initial_state"][states[i]][None]
      _, final = gated_delta_product(
        **cut, initial_state=h0, output_final_state=True, implementation="reference"
      )
      out.append(final)
    return out

  return jax.jit(run)(inp)


@pytest.mark.parametrize("implementation", ["reference", "xla", "triton"])
def test_states_are_the_prefixes_final_states(implementation):
  T = 40  # a ragged end: 2 blocks of 16, 8 tokens more
  inp = _inputs(2, T)
  call = lambda inp: gated_delta_product(
    **inp,
    chunk_size=CHUNK,
    state_every=EVERY,
    output_final_state=True,
    implementation=implementation,
  )
  o, final, states = jax.jit(call)(inp)
  assert states.shape == (2, T // EVERY, 4, 32, 16) and states.dtype == jnp.float32
  ref_o, ref_final = jax.jit(
    lambda inp: gated_delta_product(**inp, output_final_state=True, implementation="reference")
  )(inp)
  np.testing.assert_allclose(o, ref_o, rtol=2e-5, atol=2e-5)
  np.testing.assert_allclose(final, ref_final, rtol=2e-5, atol=2e-5)
  prefixes = _prefix_finals(inp, [EVERY * (j + 1) for j in range(T // EVERY)])
  for j, ref in enumerate(prefixes):
    np.testing.assert_allclose(states[:, j], ref, rtol=2e-5, atol=2e-5, err_msg=f"block {j}")


@pytest.mark.parametrize("implementation", ["reference", "xla", "triton"])
def test_packed_states_count_from_each_sequence_start(implementation):
  # lengths 5 (no block), 32 (2 blocks, the last at its end), 0, 43 (2 blocks): 4 of T // 16 = 5
  cu = np.array([0, 5, 37, 37, 80], np.int32)
  inp = _inputs(1, 80, seed=1)
  inp["initial_state"] = make_inputs(2, B=4, T=1, H=4, K=32, V=16)["initial_state"]
  call = lambda inp, cu: gated_delta_product(
    **inp, chunk_size=CHUNK, state_every=EVERY, cu_seqlens=cu, implementation=implementation
  )
  _, none, states = jax.jit(call)(inp, jnp.asarray(cu))
  assert none is None and states.shape == (1, 80 // EVERY, 4, 32, 16)
  offsets = np.asarray(block_offsets(cu, EVERY))
  np.testing.assert_array_equal(offsets, [0, 0, 2, 2, 4])
  starts, ends, seqs = [], [], []
  for n in range(4):
    for j in range(offsets[n + 1] - offsets[n]):
      starts.append(int(cu[n]))
      ends.append(int(cu[n]) + EVERY * (j + 1))
      seqs.append(n)
  prefixes = _prefix_finals(inp, ends, starts, seqs)
  for i, ref in enumerate(prefixes):
    np.testing.assert_allclose(states[0, i], ref[0], rtol=2e-5, atol=2e-5, err_msg=f"row {i}")
  np.testing.assert_array_equal(states[0, 4:], 0.0)


def test_xla_differentiates_the_states_and_triton_says_it_does_not():
  inp = _inputs(1, 32)
  arrays = {n: inp[n] for n in ("k", "v", "beta")}
  cot = jnp.asarray(np.random.default_rng(3).standard_normal((1, 2, 4, 32, 16)), jnp.float32)

  def loss(arrays, implementation):
    out = gated_delta_product(
      **{**inp, **arrays}, chunk_size=CHUNK, state_every=EVERY, implementation=implementation
    )
    return jnp.sum(out[2] * cot)

  grads = jax.jit(lambda a: [jax.grad(loss)(a, i) for i in ("reference", "xla")])(arrays)
  for n in arrays:
    np.testing.assert_allclose(grads[1][n], grads[0][n], rtol=1e-4, atol=1e-5, err_msg=n)
  with pytest.raises(NotImplementedError, match="state_every"):
    jax.eval_shape(jax.grad(lambda a: loss(a, "triton")), arrays)


@pytest.mark.parametrize(
  "every, error", [(24, ValueError), (0, ValueError), (-16, ValueError), (True, TypeError)]
)
def test_state_every_must_be_a_positive_multiple_of_the_chunk(every, error):
  inp = _inputs(1, 32)
  with pytest.raises(error, match="state_every"):
    jax.eval_shape(lambda inp: gated_delta_product(**inp, chunk_size=CHUNK, state_every=every), inp)


def test_block_states_route_on_hopper():
  # the Mosaic kernels take block states on plain rows every multiple of their chunk (64 tokens
  # at r = 1, 32 at r = 2); other block states go on to the Triton kernels, and named, it says why
  h200 = SimpleNamespace(platform="gpu", compute_capability="9.0", device_kind="NVIDIA H200")
  plain = Problem(jnp.bfloat16, 128, 128, 1, False)
  states = plain._replace(state_every=256)
  for implementation in (None, "pallas", "mosaic_gpu"):
    assert REGISTRY.resolve(implementation, h200, states).name == "mosaic_gpu"
  for other in (states._replace(state_every=32), states._replace(packed=True)):
    assert REGISTRY.resolve(None, h200, other).name == "triton"
  assert REGISTRY.resolve("mosaic_gpu", h200, states._replace(key_blocks=2, state_every=32))
  for bad in (states._replace(state_every=32), states._replace(packed=True)):
    with pytest.raises(ValueError, match="block states on unpacked rows, every multiple"):
      REGISTRY.resolve("mosaic_gpu", h200, bad)


def test_a_bad_token_spoils_the_states_from_its_block_on():
  inp = _inputs(1, 48)
  inp["k"] = inp["k"].at[0, 20, 1].set(jnp.nan)  # key head 1: value heads 2 and 3, token 20
  call = lambda inp: [
    gated_delta_product(**inp, chunk_size=CHUNK, state_every=EVERY, implementation=i)[2]
    for i in ("xla", "triton")
  ]
  clean = _prefix_finals(inp, [EVERY])[0]
  for states in jax.jit(call)(inp):
    np.testing.assert_allclose(states[:, 0], clean, rtol=2e-5, atol=2e-5)  # before token 20
    assert np.isnan(states[0, 1:, 2:]).all() and np.isfinite(states[0, 1:, :2]).all()


@pytest.mark.parametrize("form", ["blocks", "loop"])
def test_walk_writing_block_states_lowers_for_h200(monkeypatch, form):
  """chunk_state_output(save_every=...) through the Pallas Triton lowering for an H200: the
  masked store of the state after every `save_every` chunks, in both forms of the walk."""
  from pallas_kernels.triton.forward import chunk_state_output
  from tests.test_fused_forward import _kernel_avals
  from tests.triton_lowering import lower_for_h200

  _, avals = _kernel_avals(2, 32, 128, 128, jnp.bfloat16, False, T=256)
  kw = dict(key_blocks=2, chunk=32, scale=0.1, save_every=2, form=form)
  modules = lower_for_h200(
    monkeypatch, lambda *a: chunk_state_output.chunk_state_output(*a, **kw), *avals
  )
  assert len(modules) == 1 and "tt.func" in modules[0]
  out = jax.eval_shape(lambda *a: chunk_state_output.chunk_state_output(*a, **kw), *avals)
  assert out[2].shape == (1, 2, 4, 128, 128) and out[2].dtype == jnp.float32


@pytest.mark.parametrize("form", ["blocks", "loop"])
def test_walk_writes_the_state_after_every_few_chunks(form):
  """save_every=2 over 4 chunks: rows 0 and 1 are the states save_states keeps at the start of
  chunk 2 and the final state (any w, u: the walk is defined for them)."""
  from pallas_kernels.triton.forward import chunk_state_output

  rng = np.random.default_rng(0)
  arrays = [
    rng.standard_normal(shape).astype(np.float32) * 0.2
    for shape in ((1, 64, 2, 32), (1, 64, 2, 32), (1, 2, 128, 32), (1, 2, 128, 16))
  ]
  gamma = -np.tile(np.cumsum(np.full(16, 0.05)), 4)[None, None].repeat(2, 1).astype(np.float32)
  h0 = rng.standard_normal((1, 2, 32, 16)).astype(np.float32)
  kw = dict(key_blocks=2, chunk=16, scale=0.1, precision="ieee", form=form)

  def run(*a):
    _, final, h, _ = chunk_state_output.chunk_state_output(
      *a, save_states=True, h_dtype=jnp.float32, **kw
    )
    _, final2, states = chunk_state_output.chunk_state_output(*a, save_every=2, **kw)
    return final, h, final2, states

  final, h, final2, states = jax.jit(run)(*arrays, gamma, h0)
  assert states.shape == (1, 2, 2, 32, 16)
  np.testing.assert_array_equal(final2, final)
  np.testing.assert_allclose(states[:, :, 0], h[:, :, 2], rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(states[:, :, 1], final, rtol=1e-6, atol=1e-6)
