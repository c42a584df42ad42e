"""The verify step (`gated_delta_product_verify`, docs/inference.md#verifying-draft-tokens):
Tq tokens in one call equal Tq single steps, and `select_state` rolls back to any length."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdp_jax import gated_delta_product_step, gated_delta_product_verify, select_state
from pallas_kernels.triton.inference import recurrent_verify
from tests.cases import make_inputs
from tests.triton_lowering import lower_for_h200

TQ = 5


def _inputs():
  # B = 3, 2 key heads for 4 value heads, r = 2 with a per-token mask, an initial state
  inp = make_inputs(0, B=3, T=TQ, H=4, K=32, V=16, r=2, mask_kind="token")
  inp["q"], inp["k"] = inp["q"][:, :, :2], inp["k"][:, :, :2]
  return inp


@pytest.mark.parametrize("implementation", ["xla", "triton"])
def test_verify_equals_single_steps_and_rolls_back(implementation):
  inp = _inputs()
  lengths = jnp.array([0, 3, TQ], jnp.int32)

  def run(inp, lengths):
    o, states = gated_delta_product_verify(**inp, implementation=implementation)
    state, steps_o, steps_state = inp["initial_state"], [], []
    for t in range(TQ):
      token = {n: inp[n][:, t] for n in ("q", "k", "v", "g", "beta", "mask")}
      o_t, state = gated_delta_product_step(**token, state=state, implementation=implementation)
      steps_o.append(o_t)
      steps_state.append(state)
    rolled = select_state(states, lengths, inp["initial_state"])
    return o, states, jnp.stack(steps_o, 1), jnp.stack(steps_state, 1), rolled

  o, states, steps_o, steps_state, rolled = jax.jit(run)(inp, lengths)  # traced lengths
  assert o.shape == (3, TQ, 4, 16) and states.shape == (3, TQ, 4, 32, 16)
  np.testing.assert_allclose(o, steps_o, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(states, steps_state, rtol=1e-6, atol=1e-6)
  before = np.asarray(inp["initial_state"])
  for b, n in enumerate(np.asarray(lengths)):
    want = before[b] if n == 0 else np.asarray(steps_state)[b, n - 1]
    np.testing.assert_allclose(rolled[b], want, rtol=1e-6, atol=1e-6, err_msg=f"length {n}")


def test_verify_and_select_state_reject_bad_arguments():
  inp = make_inputs(0, B=2, T=17, H=2, K=16, V=16, r=1, mask_kind=None)
  with pytest.raises(ValueError, match="at most 16"):
    jax.eval_shape(lambda inp: gated_delta_product_verify(**inp), inp)
  states = jnp.zeros((2, 4, 2, 16, 16))
  with pytest.raises(ValueError, match=r"in \[1, 4\].*0 needs initial_state"):
    select_state(states, jnp.array([0, 2]))
  with pytest.raises(ValueError, match=r"in \[0, 4\]"):
    select_state(states, jnp.array([1, 5]), jnp.zeros((2, 2, 16, 16)))
  with pytest.raises(ValueError, match="accepted_lengths"):
    select_state(states, jnp.array([1.0, 2.0]))


@pytest.mark.parametrize("implementation", [None, "triton"])
def test_compact_verify_rebuilds_every_length(implementation):
  # None: the one-chunk jnp form; "triton": the tokens one by one in one kernel
  inp = _inputs()
  inp["g"] = inp["g"].at[1, 2, :].set(-jnp.inf)  # a reset in row 1: the state before is dropped

  def run(inp):
    o, record = gated_delta_product_verify(**inp, compact=True, implementation=implementation)
    ref_o, states = gated_delta_product_verify(**inp, implementation="xla")
    rebuilt = [select_state(record, jnp.full((3,), n, jnp.int32)) for n in range(TQ + 1)]
    return o, ref_o, states, rebuilt

  o, ref_o, states, rebuilt = jax.jit(run)(inp)
  np.testing.assert_allclose(o, ref_o, rtol=2e-5, atol=2e-5)
  np.testing.assert_allclose(rebuilt[0], inp["initial_state"], rtol=0, atol=0)
  for n in range(1, TQ + 1):
    np.testing.assert_allclose(rebuilt[n], states[:, n - 1], rtol=2e-5, atol=2e-5, err_msg=str(n))


@pytest.mark.parametrize(
  "B,H,Tq,K,V,r,mask_shape,dtype",
  [
    (64, 16, 4, 128, 128, 1, (1, 1, 1, 1, 1), jnp.bfloat16),  # the benchmark shape
    (8, 4, 3, 128, 64, 2, (8, 4, 3, 2, 2), jnp.float32),  # a mask per token
    (2, 2, 5, 24, 40, 3, (1, 2, 1, 3, 3), jnp.float32),  # K and V padded and masked
  ],
)
def test_verify_kernel_lowers_to_triton(monkeypatch, B, H, Tq, K, V, r, mask_shape, dtype):
  spec = jax.ShapeDtypeStruct
  modules = lower_for_h200(
    monkeypatch,
    lambda *a: recurrent_verify.recurrent_verify(*a, scale=0.1),
    spec((B, H, Tq, K), dtype),
    spec((B, H, Tq, K), dtype),
    spec((B, H, Tq, V), dtype),
    spec((B, H, Tq), jnp.float32),
    spec((B, H, Tq), jnp.float32),
    spec(mask_shape, jnp.float32),
    spec((B, H, K, V), jnp.float32),
    clear=(recurrent_verify.recurrent_verify,),
  )
  assert "tt.reduce" in modules[0] and "tt.dot" not in modules[0]
  assert modules[0].count("tt.store") >= Tq * (1 + r)  # each token's o and values, no state
