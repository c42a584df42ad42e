"""The verify step (`gated_delta_product_verify`, docs/inference.md#verifying-draft-tokens):
Tq tokens in one call equal Tq single steps, and `select_state` rolls back to any length."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdp_jax import gated_delta_product_step, gated_delta_product_verify, select_state
from tests.cases import make_inputs

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


def test_compact_verify_rebuilds_every_length():
  inp = _inputs()
  inp["g"] = inp["g"].at[1, 2, :].set(-jnp.inf)  # a reset in row 1: the state before is dropped

  def run(inp):
    o, record = gated_delta_product_verify(**inp, compact=True)
    ref_o, states = gated_delta_product_verify(**inp, implementation="xla")
    rebuilt = [select_state(record, jnp.full((3,), n, jnp.int32)) for n in range(TQ + 1)]
    return o, ref_o, states, rebuilt

  o, ref_o, states, rebuilt = jax.jit(run)(inp)
  np.testing.assert_allclose(o, ref_o, rtol=2e-5, atol=2e-5)
  np.testing.assert_allclose(rebuilt[0], inp["initial_state"], rtol=0, atol=0)
  for n in range(1, TQ + 1):
    np.testing.assert_allclose(rebuilt[n], states[:, n - 1], rtol=2e-5, atol=2e-5, err_msg=str(n))
  with pytest.raises(ValueError, match="compact=True"):
    jax.eval_shape(
      lambda inp: gated_delta_product_verify(**inp, compact=True, implementation="triton"), inp
    )
