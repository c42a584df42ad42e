"""Compile once per call site (docs/performance.md#compile-time).

- The Pallas operator: each kernel appears once in the jaxpr of a jitted forward and of a jitted
  forward + backward, with the non-finite guard on (its default) as without it; the guard adds
  selects, not a second copy of the kernels (docs/precision.md#non-finite-inputs).
- `generate`: the prefill and the decode loop are traced once per shape bucket (`pad_to`): a
  second call with other prompt lengths in the same bucket traces and compiles nothing.

Tracing only (`jax.make_jaxpr`) for the kernel counts: nothing runs, so it is quick on a CPU.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdp_jax import gated_delta_product
from pallas_kernels.common.options import DEFAULT
from tests.cases import make_inputs

T, CHUNK = 64, 64
# The Pallas kernels of one call: the forward's two (chunk_fwd, chunk_state_output), and with
# the backward seven more (wy, chunk_h, bwd_dv_local, bwd_dhu, bwd_dqkwg, bwd_wy and the reverse
# chunk-local cumsum of dg).
FORWARD_KERNELS = 2
FORWARD_BACKWARD_KERNELS = 2 + 7


def sub_jaxprs(params):
  """The jaxprs among an equation's parameters (cond branches, pjit, custom_vjp, scan, ...)."""
  for p in params.values():
    for item in p if isinstance(p, (tuple, list)) else (p,):
      if isinstance(item, jax.extend.core.ClosedJaxpr):
        yield item.jaxpr
      elif isinstance(item, jax.extend.core.Jaxpr):
        yield item


def count_pallas_calls(jaxpr):
  """pallas_call equations in a jaxpr and every jaxpr nested in it (not inside the kernels)."""
  n = 0
  for e in jaxpr.eqns:
    if e.primitive.name == "pallas_call":
      n += 1
      continue
    n += sum(count_pallas_calls(j) for j in sub_jaxprs(e.params))
  return n


def operator_inputs(r, varlen=False):
  inputs = make_inputs(3, B=2, T=T, H=2, K=32, V=16, r=r, mask_kind="token")
  kw = dict(chunk_size=CHUNK, implementation="pallas", output_final_state=True)
  if varlen:
    inputs = {n: x[:1] if n != "initial_state" else x for n, x in inputs.items()}
    kw["cu_seqlens"] = jnp.array([0, 20, T], jnp.int32)
  return inputs, kw


def kernels_in(r, guard, grad, varlen=False):
  inputs, kw = operator_inputs(r, varlen)
  options = DEFAULT.replace(nonfinite_guard=guard)

  def forward(inp):
    o, final = gated_delta_product(**inp, **kw, options=options)
    return jnp.sum(o.astype(jnp.float32)) + jnp.sum(final)

  fn = jax.jit(jax.grad(forward) if grad else forward)
  return count_pallas_calls(jax.make_jaxpr(fn)(inputs).jaxpr)


@pytest.mark.parametrize("r", [1, 2])
@pytest.mark.parametrize("guard", [True, False], ids=["guarded", "unguarded"])
def test_each_kernel_once_in_the_forward(r, guard):
  assert kernels_in(r, guard, grad=False) == FORWARD_KERNELS


@pytest.mark.parametrize("varlen", [False, True], ids=["plain", "packed"])
@pytest.mark.parametrize("guard", [True, False], ids=["guarded", "unguarded"])
def test_each_kernel_once_in_forward_and_backward(guard, varlen):
  assert kernels_in(2, guard, grad=True, varlen=varlen) == FORWARD_BACKWARD_KERNELS


def test_layers_of_one_shape_share_one_lowering_of_each_kernel(monkeypatch):
  """Two operator calls of one shape (a model's layers), forward and backward, lowered for an
  H200: each of the nine kernels goes through the Triton lowering once (jitted_kernels), not
  once per call (docs/train_lm.md#compile-time)."""
  from tests.triton_lowering import lower_for_h200

  inputs, kw = operator_inputs(2)
  avals = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), inputs)

  def two_layers(inp):
    def loss(inp):
      o, _ = gated_delta_product(**inp, **kw)
      o2, final = gated_delta_product(**dict(inp, v=o.astype(inp["v"].dtype)), **kw)
      return jnp.sum(o2.astype(jnp.float32)) + jnp.sum(final)

    return jax.grad(loss)(inp)

  modules = lower_for_h200(monkeypatch, two_layers, avals)
  assert len(modules) == FORWARD_BACKWARD_KERNELS, len(modules)


def test_the_counter_sees_kernels_in_nested_jaxprs():
  """The count reaches into cond branches and nested jits (where a second copy would hide)."""
  inputs, kw = operator_inputs(1)
  options = DEFAULT.replace(nonfinite_guard=False)
  run = jax.jit(lambda inp: gated_delta_product(**inp, **kw, options=options)[0])

  def two_copies(inp, flag):
    return jax.lax.cond(flag, run, lambda x: run(x) * 2, inp)

  jaxpr = jax.make_jaxpr(two_copies)(inputs, True).jaxpr
  assert count_pallas_calls(jaxpr) == 2 * FORWARD_KERNELS


# ---- generate: one trace per shape bucket --------------------------------------------------


@pytest.fixture(scope="module")
def small_model():
  from flax import nnx

  from gdp_jax.models import HybridConfig, HybridLM

  config = HybridConfig(
    vocab_size=32, hidden_size=32, layer_pattern="DA", num_heads=2, head_dim=16, mlp_ratio=1
  )
  return HybridLM(config, rngs=nnx.Rngs(0))


def _cache_sizes():
  from gdp_jax import models

  return models._prefill._cache_size(), models._decode._cache_size()


@contextlib.contextmanager
def _counting_traces(cls, **methods):
  """Within: {count name: traces} of the methods of `cls` named by the keywords (method name ->
  count name); a count grows while jax traces a call (a Python side effect)."""
  traces = dict.fromkeys(methods.values(), 0)
  originals = {name: getattr(cls, name) for name in methods}

  def counting(name, method):
    @functools.wraps(method)
    def wrapper(*args, **kwargs):
      traces[methods[name]] += 1
      return method(*args, **kwargs)

    return wrapper

  try:
    for name, method in originals.items():
      setattr(cls, name, counting(name, method))
    yield traces
  finally:
    for name, method in originals.items():
      setattr(cls, name, method)


def test_generate_traces_once_per_bucket(small_model):
  """prefill="chunked": one trace of the prefill and of the decode loop per bucket."""
  from gdp_jax import models

  models._prefill.clear_cache()
  models._decode.clear_cache()
  gen = functools.partial(models.generate, small_model, pad_to=16, prefill="chunked")
  with _counting_traces(type(small_model), prefill="prefill", step="decode") as traces:
    first = gen([[1, 2, 3], [4, 5, 6, 7, 8]], 4)
    assert traces == {"prefill": 1, "decode": 1}, traces
    sizes = _cache_sizes()
    assert sizes == (1, 1), sizes
    # Other prompt lengths (and contents) and other numbers of new tokens in the same buckets
    # (T <= 16, max_new_tokens <= 16): nothing new.
    second = gen([[9], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]], 4)
    gen(np.array([[7, 7, 7, 7, 7, 7]]).repeat(2, 0), 4)
    longer = gen([[9], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]], 9)
    assert traces == {"prefill": 1, "decode": 1}, traces
    assert _cache_sizes() == sizes
    assert longer.shape == (2, 9)
    np.testing.assert_array_equal(longer[:, :4], second)  # greedy: the same first tokens
    # A prompt longer than the bucket is a new shape: one more prefill and decode trace.
    gen([list(range(1, 18)), [1]], 4)
    assert traces == {"prefill": 2, "decode": 2}, traces
  assert first.shape == second.shape == (2, 4)


def test_generate_prefill_by_steps_is_one_program(small_model):
  """prefill="steps" (what "auto" takes for prompts of at most STEP_PREFILL_TOKENS): the prompts
  go through the decode step inside the decode loop, one program traced once per bucket with no
  prefill trace, and the greedy tokens equal the chunked prefill's; paged caches too; a bad mode
  is a ValueError."""
  from gdp_jax import models

  prompts = [[9], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [2, 7]]
  chunked = models.generate(small_model, prompts, 6, pad_to=16, prefill="chunked")
  program = models._jitted_prompt_decode(models._options_key(models.DECODE_COMPILER_OPTIONS))
  program.clear_cache()
  with _counting_traces(type(small_model), prefill="prefill", step="step") as traces:
    steps = models.generate(small_model, prompts, 6, pad_to=16)
    assert traces == {"prefill": 0, "step": 1}, traces
    models.generate(small_model, [[1, 2, 3], [4], [5, 6]], 3, pad_to=16)  # the same bucket
    assert traces == {"prefill": 0, "step": 1}, traces
    assert program._cache_size() == 1
  np.testing.assert_array_equal(steps, chunked)
  paged = models.generate(small_model, prompts, 6, pad_to=16, prefill="steps", page_size=16)
  np.testing.assert_array_equal(paged, chunked)
  # a prompt past STEP_PREFILL_TOKENS: "auto" takes the chunked prefill
  long = [[1] * (models.STEP_PREFILL_TOKENS + 1), [1]]
  assert models.generate_call(small_model, long, 2, pad_to=16).prefill is not None
  with pytest.raises(ValueError, match="prefill must be one of"):
    models.generate(small_model, prompts, 2, prefill="chunks")


def test_generate_compiler_options(small_model):
  """generate's XLA options (docs/performance.md#compile-time): the default programs compile the
  decode loop with DECODE_COMPILER_OPTIONS; other options are other programs, with the same
  tokens; a malformed pair is a TypeError naming the argument."""
  from gdp_jax import models

  prompts = [[1, 2, 3], [4, 5]]
  gen = functools.partial(models.generate_call, small_model, prefill="chunked")
  assert gen(prompts, 3).decode is models._decode
  default = models.generate(small_model, prompts, 3, pad_to=16)
  call = gen(prompts, 3, pad_to=16, compiler_options=({}, {}))
  assert call.prefill is models._prefill  # the same options: the same jitted prefill
  assert call.decode is not models._decode
  np.testing.assert_array_equal(call.run(), default)
  with pytest.raises(TypeError, match="compiler_options must be None or a pair"):
    models.generate(small_model, prompts, 3, compiler_options={"xla_gpu_autotune_level": 0})
