"""Non-finite values (docs/precision.md#non-finite-inputs): a reset g = -inf gives the
reference's result in every implementation, forward and gradients, and a nan or inf at token t
leaves everything before t unchanged (outputs, and the gradients of a loss on them).

"pallas" gets there with a guard around its kernels (gdp_jax/ops/gated_delta_product/triton.py): the
kernels run once, on cleaned inputs, and selects mark the outputs a bad token spoils; the tests
here run it eagerly and under jax.jit.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdp_jax import gated_delta_product
from gdp_jax.ops.gated_delta_product.api import REGISTRY
from tests.cases import (
  GRAD_TOLERANCE,
  assert_close,
  general_backends,
  loss_and_grads,
  make_inputs,
  outputs_and_grads,
  tol,
)

IMPLS = general_backends("gated_delta_product")
T, CHUNK, BAD_T = 40, 16, 28  # token 28: second chunk, lower half of its chunk matrix
# Exact up to float32 rounding: the bad and the clean runs share every value before BAD_T.
SAME = 1e-6


def _operator(implementation):
  return functools.partial(
    gated_delta_product, output_final_state=True, chunk_size=CHUNK, implementation=implementation
  )


# "xla" and "reference" as one jitted program per implementation, shared by every case of the
# same shapes (run eagerly, each operation would compile on its own).
_jitted_operator = functools.cache(lambda implementation: jax.jit(_operator(implementation)))


def run(implementation, **inputs):
  """The operator with its final state; "pallas" eagerly (the guard's Python choice)."""
  if REGISTRY.is_pallas(implementation):
    return _operator(implementation)(**inputs)
  return _jitted_operator(implementation)(**inputs)


# ---- g = -inf: a reset ---------------------------------------------------------------------------


def reset_inputs():
  inputs = make_inputs(40, B=2, T=T, H=2, K=32, V=16, r=2, mask_kind="head")
  g = np.array(inputs["g"])
  g[0, 0, 0] = -np.inf  # the first token
  g[0, 20, 1] = -np.inf  # inside a chunk
  g[1, 31, 0] = -np.inf  # a chunk's last token
  g[1, 34, 1] = g[1, 38, 1] = -np.inf  # two in one chunk
  g[0, 10, 1] = -1e4  # finite, exp(g) = 0 in float32: also a reset
  inputs["g"] = jnp.asarray(g)
  return inputs


@pytest.mark.parametrize("implementation", [n for n in IMPLS if n != "reference"])
def test_reset_matches_reference(implementation):
  inputs = reset_inputs()
  # outputs and gradients from one program where JAX differentiates the implementation
  # (tests/cases.py outputs_and_grads); "pallas" (a custom_vjp) runs its plain forward apart
  (o_ref, f_ref), g_ref = outputs_and_grads(_operator("reference"), inputs)
  if REGISTRY.is_pallas(implementation):
    o, f = run(implementation, **inputs)
    got = loss_and_grads(functools.partial(run, implementation), inputs)
  else:
    (o, f), got = outputs_and_grads(_operator(implementation), inputs)
  assert_close(o, o_ref, tol(jnp.float32), "o")
  assert_close(f, f_ref, tol(jnp.float32), "final")
  for name in g_ref:
    assert_close(got[name], g_ref[name], GRAD_TOLERANCE[jnp.float32], f"d{name}")
  assert np.all(np.asarray(got["g"])[np.isinf(np.asarray(inputs["g"]))] == 0), "dg at a reset"


@pytest.mark.parametrize("implementation", IMPLS)
def test_reset_is_a_fresh_start(implementation):
  """Independent of the reference: after g_t = -inf the outputs are those of a run that starts
  at t from a zero state ("pallas" interpreted is slow: tests/conftest.py's SLOW)."""
  inputs = make_inputs(41, B=1, T=T, H=2, K=32, V=16, r=2, mask_kind="token")
  cut = 21
  inputs["g"] = inputs["g"].at[:, cut].set(-jnp.inf)
  o, f = run(implementation, **inputs)
  timed = ("q", "k", "v", "g", "beta", "mask")
  tail = {n: (x[:, cut:] if n in timed else x) for n, x in inputs.items()}
  tail["initial_state"] = None
  o_tail, f_tail = run(implementation, **tail)
  assert_close(o[:, cut:], o_tail, tol(jnp.float32), "o after the reset")
  assert_close(f, f_tail, tol(jnp.float32), "final")


# ---- nan and inf stay causal ---------------------------------------------------------------------

# (input, value): one bad entry at (batch 0, token BAD_T, head 1)
BAD = [
  ("k", np.nan),
  ("v", np.inf),
  ("q", np.nan),
  ("g", np.nan),
  ("g", np.inf),
  ("beta", np.nan),
  ("mask", np.nan),
]
# the interpreted kernels are slow: four cases
PALLAS_BAD = [("k", np.nan), ("v", np.inf), ("q", np.nan), ("g", np.nan)]
# the interpreted kernels are slow: the gradient cases of "pallas" are a bad key (it enters the
# state) and a bad query (it spoils its own token only, and the backward must see it cleaned
# although a call without gradient leaves it as it is); the guard's backward is one code path
# for every input (test_pallas_guard_under_jit runs it with a bad v under jit).
PALLAS_BAD_GRADIENTS = [("k", np.nan), ("q", np.nan)]


def spoil(inputs, name, value):
  x = np.array(inputs[name])
  index = (0, BAD_T, 1) + (0,) * (x.ndim - 3)
  x[index] = value
  return {**inputs, name: jnp.asarray(x)}


def _cases(pallas_bad=PALLAS_BAD):
  out = []
  for impl in IMPLS:
    for name, value in pallas_bad if REGISTRY.is_pallas(impl) else BAD:
      out.append(pytest.param(impl, name, value, id=f"{impl}-{name}-{value}"))
  return out


def clean_inputs():
  return make_inputs(42, B=2, T=T, H=2, K=32, V=16, r=2, mask_kind="token")


NAMES = ("q", "k", "v", "g", "beta", "mask", "initial_state")


def loss_on_prefix(implementation):
  """A loss on the outputs before the bad token, a function of NAMES."""
  do = jax.random.normal(jax.random.key(0), clean_inputs()["v"].shape)

  def loss(*arrays):
    o, _ = gated_delta_product(
      *arrays[:6], initial_state=arrays[6], chunk_size=CHUNK, implementation=implementation
    )
    return jnp.sum(o[:, :BAD_T] * do[:, :BAD_T])

  return loss


@functools.cache
def _grad(implementation):
  """jax.grad of the prefix loss: eager for "pallas" (the guard's Python choice), else jitted
  once per implementation."""
  grad = jax.grad(loss_on_prefix(implementation), argnums=tuple(range(len(NAMES))))
  return grad if REGISTRY.is_pallas(implementation) else jax.jit(grad)


def grads(implementation, inputs):
  return dict(zip(NAMES, _grad(implementation)(*[inputs[n] for n in NAMES])))


# The clean results, once per implementation (the interpreted Pallas kernels are slow).
clean_run = functools.cache(lambda implementation: run(implementation, **clean_inputs()))
clean_grads = functools.cache(lambda implementation: grads(implementation, clean_inputs()))


@pytest.mark.parametrize("implementation,name,value", _cases())
def test_nonfinite_forward_is_causal(implementation, name, value):
  o_clean, f_clean = clean_run(implementation)
  o, f = run(implementation, **spoil(clean_inputs(), name, value))
  assert_close(o[:, :BAD_T], o_clean[:, :BAD_T], SAME, "o before the bad token")
  # Other batch rows and heads never see it.
  assert_close(o[1], o_clean[1], SAME, "o of batch row 1")
  assert_close(o[:, :, 0], o_clean[:, :, 0], SAME, "o of head 0")
  assert_close(f[1], f_clean[1], SAME, "final state of batch row 1")
  assert not np.all(np.isfinite(np.asarray(o[0, BAD_T, 1]))), "the bad token's output"


@pytest.mark.parametrize("implementation,name,value", _cases(PALLAS_BAD_GRADIENTS))
def test_nonfinite_gradient_is_causal(implementation, name, value):
  """The gradient of a loss on the outputs before the bad token equals the clean one."""
  clean = clean_grads(implementation)
  got = grads(implementation, spoil(clean_inputs(), name, value))
  for n in clean:
    assert_close(got[n], clean[n], SAME, f"d{n}")


@pytest.mark.parametrize("implementation", IMPLS)
def test_nonfinite_key_spoils_its_value_heads_only(implementation):
  """Grouped value heads (2 key heads, 4 value heads): a nan in key head 1 at BAD_T spoils value
  heads 2 and 3 from BAD_T on and nothing else, under jax.jit."""
  inputs = make_inputs(7, B=1, T=32, H=4, K=16, V=16, r=1, mask_kind="head")
  for name in ("q", "k"):  # key heads 0, 0, 1, 1 for the value heads
    inputs[name] = inputs[name][:, :, ::2]
  call = jax.jit(
    lambda kk: gated_delta_product(
      **{**inputs, "k": kk},
      output_final_state=True,
      chunk_size=CHUNK,
      implementation=implementation,
    )[0]
  )
  o_clean = call(inputs["k"])
  bad_t = 20
  o = call(inputs["k"].at[0, bad_t, 1, 3].set(np.nan))
  assert_close(o[:, :bad_t], o_clean[:, :bad_t], SAME, "o before the bad token")
  assert_close(o[:, :, :2], o_clean[:, :, :2], SAME, "o of the other key head's value heads")
  assert np.all(np.isnan(np.asarray(o[0, bad_t:, 2:]))), "the spoiled value heads"


# ---- the Pallas guard under jax.jit --------------------------------------------------------------


def test_pallas_guard_under_jit():
  """One jitted function serves clean and bad inputs (the guard's selects): the value and the
  gradients of a loss before the bad token are the clean ones, and the clean ones are those of
  the eager call."""
  loss = loss_on_prefix("pallas")
  step = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(NAMES)))))
  inputs = clean_inputs()
  value, clean = step(*[inputs[n] for n in NAMES])
  bad = spoil(inputs, "v", np.nan)
  value_bad, got = step(*[bad[n] for n in NAMES])
  assert_close(value_bad, value, SAME, "loss")
  eager = clean_grads("pallas")
  for n, d, d_bad in zip(NAMES, clean, got):
    assert_close(d, eager[n], SAME, f"d{n} (jit, clean)")
    assert_close(d_bad, d, SAME, f"d{n} (jit, bad v)")


@pytest.mark.parametrize("varlen", [False, True])
def test_pallas_guard_is_selects_around_one_run_of_the_kernels(varlen):
  """In the jaxpr of a jitted gradient the guard adds no `lax.cond` and no kernel: the same
  Pallas kernels as without it, once each (tests/test_compile_counts.py counts them per entry
  point)."""
  from pallas_kernels.common.options import DEFAULT
  from tests.test_compile_counts import count_pallas_calls, sub_jaxprs

  inputs = clean_inputs()
  kw = dict(chunk_size=CHUNK, implementation="pallas", output_final_state=True)
  if varlen:
    inputs = {n: x[:1] if n != "initial_state" else x for n, x in inputs.items()}
    kw["cu_seqlens"] = jnp.array([0, 12, T], jnp.int32)

  def loss(inp, guard):
    options = DEFAULT.replace(nonfinite_guard=guard)
    o, final = gated_delta_product(**inp, **kw, options=options)
    return jnp.sum(o) + jnp.sum(final)

  def primitives(jaxpr):
    for e in jaxpr.eqns:
      yield e.primitive.name
      if e.primitive.name != "pallas_call":  # (the kernels may hold conds)
        for sub in sub_jaxprs(e.params):
          yield from primitives(sub)

  def trace(guard):
    return jax.make_jaxpr(jax.jit(jax.grad(functools.partial(loss, guard=guard))))(inputs).jaxpr

  guarded, plain = trace(True), trace(False)
  assert "cond" not in set(primitives(guarded))
  assert count_pallas_calls(guarded) == count_pallas_calls(plain) > 0


def test_bench_nonfinite_smoke(tmp_path):
  """benchmarks/bench_nonfinite.py --smoke (the forward only, interpreted): its JSON holds the
  guarded, unguarded and nan-in-k runs, the guarded output equal to the unguarded one."""
  import importlib.util
  import json
  import pathlib

  path = pathlib.Path(__file__).parents[1] / "benchmarks" / "bench_nonfinite.py"
  spec = importlib.util.spec_from_file_location("bench_nonfinite", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  out = tmp_path / "nonfinite.json"
  assert mod.main(["--smoke", "--modes", "fwd", "--out", str(out)]) == 0
  res = json.loads(out.read_text())
  assert {"date", "jax_version", "device", "command", "runs"} <= set(res)
  assert res["command"].startswith("python benchmarks/bench_nonfinite.py --smoke")
  cases = {run["case"]: run for run in res["runs"] if run["mode"] != "pieces"}
  assert set(cases) == {"unguarded", "guarded", "nan in k", "summary"}
  pieces = {run["case"]: run["ms"] for run in res["runs"] if run["mode"] == "pieces"}
  assert set(pieces) == {"clean (every input)", "clean (q kept)", "mark"}, pieces
  assert all(ms > 0 for ms in pieces.values())
  assert all(cases[c]["ms"] > 0 for c in ("unguarded", "guarded", "nan in k"))
  assert cases["summary"]["guarded_equals_unguarded"] and cases["summary"]["nan_marks_ok"]
