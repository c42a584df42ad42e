"""The Triton kernels' key-block loop form (`chunk_h`, `chunk_state_output`, `bwd_dhu` with the
state as one [K, BV] tile and the row blocks in a loop, `bwd_wy` with its K pieces in a loop;
`pallas_kernels/common/options.py` `key_block_loop`, docs/performance.md#compile-time): the
operator with every such kernel looped against the reference, plain and packed (the walks per
sequence, `chunk_state_output` reading the packed row in place), every gradient; and the r = 8
modules it is for, lowered for an H200."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdp_jax import gated_delta_product
from pallas_kernels.common import options
from pallas_kernels.triton.backward import bwd_dhu, bwd_wy
from pallas_kernels.triton.forward import chunk_h, chunk_state_output
from tests.cases import GRAD_TOLERANCE, TOLERANCE, assert_close, make_inputs, outputs_and_grads

F32 = jnp.float32


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
def test_operator_with_the_loop_form_matches_the_reference(monkeypatch, packed):
  # every r loops (the default loops from r = 8 only, which is costly to interpret here)
  monkeypatch.setattr(options, "LOOP_KEY_BLOCKS", 1)
  x = make_inputs(0, B=1, T=70, H=2, K=32, V=32, r=2, mask_kind="token", dtype=F32)
  cu = None
  if packed:  # an empty sequence, one of 5 tokens, one over a chunk, one ending the row
    cu = jnp.asarray(np.cumsum([0, 5, 0, 40, 25]), jnp.int32)
    x["initial_state"] = 0.3 * jax.random.normal(jax.random.PRNGKey(1), (4, 2, 32, 32), F32)

  def run(implementation, **kw):
    return gated_delta_product(
      **kw,
      cu_seqlens=cu,
      output_final_state=True,
      implementation=implementation,
      precision="highest",
    )

  (o, final), grads = outputs_and_grads(functools.partial(run, "triton"), x)
  # the operator's recurrence: of its forms the cheapest to compile
  (o_ref, final_ref), grads_ref = outputs_and_grads(functools.partial(run, "reference"), x)
  assert_close(o, o_ref, TOLERANCE[F32], "o")
  assert_close(final, final_ref, TOLERANCE[F32], "final state")
  for name, ref in grads_ref.items():
    assert_close(grads[name], ref, GRAD_TOLERANCE[F32], f"d{name}")


def test_r8_kernels_lower_to_small_modules(monkeypatch):
  # r = 8, 16-token chunks: unrolled, chunk_h, chunk_state_output and bwd_dhu lowered to 5,500 -
  # 6,300 lines with 72 - 96 dots each and bwd_wy to 4,200 with 52; the loop form to one row
  # block's (one K piece's) products
  from tests.triton_lowering import lower_for_h200

  r, chunk, t_len, dim = 8, 16, 64, 128
  S = jax.ShapeDtypeStruct
  tokens, rows_k = S((1, t_len, 2, dim), jnp.bfloat16), S((1, 2, t_len * r, dim), jnp.bfloat16)
  gamma, state = S((1, 2, t_len), F32), S((1, 2, dim, dim), F32)
  mask, ai = S((1, 1, 1, r, r), F32), S((1, 2, t_len * r, chunk * r), jnp.bfloat16)
  common = dict(key_blocks=r, chunk=chunk)

  def kernels(q, k, w, u, gamma, h0, do, mask, ai):
    return (
      chunk_h.chunk_state(k, w, u, gamma, h0, **common),
      chunk_state_output.chunk_state_output(q, k, w, u, gamma, h0, scale=0.1, **common),
      bwd_dhu.chunk_bwd_dhu(q, k, w, gamma, do, u, h0, scale=0.1, **common),
      bwd_wy.wy_bwd(k, do, gamma, mask, gamma, ai, w, u, **common),  # (gamma as beta)
    )

  avals = (tokens, tokens, rows_k, rows_k, gamma, state, tokens, mask, ai)
  modules = lower_for_h200(monkeypatch, kernels, *avals)
  assert len(modules) == 4
  for module, (lines, dots) in zip(modules, [(1000, 6)] * 3 + [(1500, 12)]):
    size = (len(module.splitlines()), module.count("tt.dot "))
    assert size[0] < lines and size[1] <= dots, size


def test_a_bad_form_is_a_value_error():
  with pytest.raises(ValueError, match="form must be one of"):
    options.key_block_loop("unrolled", 8)
  assert options.key_block_loop("auto", 8) and not options.key_block_loop("auto", 4)
  assert options.key_block_loop("loop", 1) and not options.key_block_loop("blocks", 8)
