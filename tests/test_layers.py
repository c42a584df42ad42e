"""Flax layers: GatedDeltaProduct, HouseholderDeltaProduct and GroupedQueryAttention. Whole
sequence versus token by token (from an empty cache and after a ragged prefill), shapes and
dtypes, gradients to every parameter, the operator callables the delta layers are given, use
from flax.linen, and configuration errors."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from flax.nnx import bridge

import gdp_jax
from gdp_jax import gated_delta_product, gated_delta_product_step, layers
from gdp_jax.layers import (
  GatedDeltaProduct,
  GroupedQueryAttention,
  HouseholderDeltaProduct,
  block_mask,
)
from tests.cases import assert_close

D, H, K = 16, 2, 8


def gdp(**kw):
  args = dict(num_blocks=2, expand_v=2, chunk_size=16, implementation="xla")
  args.update(kw)
  return GatedDeltaProduct(D, H, K, rngs=nnx.Rngs(0), **args)


def householder(**kw):
  args = dict(expand_v=2, chunk_size=16, implementation="xla")
  args.update(kw)
  return HouseholderDeltaProduct(D, H, K, rngs=nnx.Rngs(0), **args)


def x_of(seed, B=2, T=7, dtype=jnp.float32):
  return jax.random.normal(jax.random.key(seed), (B, T, D), jnp.float32).astype(dtype)


def run_steps(layer, x, cache):
  step = jax.jit(lambda x_t, c: layer.step(x_t, c))  # one compilation per layer
  ys = []
  for t in range(x.shape[1]):
    y, cache = step(x[:, t], cache)
    ys.append(y)
  return jnp.stack(ys, axis=1), cache


# A jitted layer call: one compile per call instead of one per operation; the arguments are
# traced, the options static. Used where it compiles less than running eagerly: the eager
# operations of the delta layers, compiled once, serve the many configurations of this file.
@functools.partial(nnx.jit, static_argnames=("return_cache", "cache_size"))
def apply(layer, x, lengths=None, *, return_cache=False, cache_size=None):
  kw = {} if cache_size is None else dict(cache_size=cache_size)
  return layer(x, lengths, return_cache=return_cache, **kw)


jit_step_tokens = nnx.jit(lambda layer, x, cache: layer.step_tokens(x, cache))
jit_step = nnx.jit(lambda layer, x_t, cache: layer.step(x_t, cache))


def call(layer, *args, **kw):
  """The layer call: attention jitted, the delta layers eagerly (`apply`)."""
  return (
    apply(layer, *args, **kw) if isinstance(layer, GroupedQueryAttention) else layer(*args, **kw)
  )


def call_step_tokens(layer, x, cache):
  """layer.step_tokens, jitted for attention (as `call`)."""
  if isinstance(layer, GroupedQueryAttention):
    return jit_step_tokens(layer, x, cache)
  return layer.step_tokens(x, cache)


# ---- the block mask ---------------------------------------------------------------------------


def test_block_mask_properties():
  w = jax.random.normal(jax.random.key(0), (3, 4, 4))
  m = np.asarray(block_mask(w))
  np.testing.assert_allclose(m, np.swapaxes(m, -1, -2), atol=1e-6)
  np.testing.assert_allclose(np.diagonal(m, axis1=-2, axis2=-1), 1.0, atol=1e-4)  # eps 1e-6
  assert m.min() >= 0.0 and m.max() <= 1.0 + 1e-6
  assert np.all(np.linalg.eigvalsh(m) > -1e-5)  # a Gram matrix: PSD


# ---- GatedDeltaProduct --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gdp_shapes_and_dtypes(dtype):
  layer = gdp(dtype=dtype)
  x = x_of(0, dtype=dtype)
  # jitted: one compile per call instead of one per operation
  y, cache = nnx.jit(lambda m, x: m(x, return_cache=True))(layer, x)
  assert y.shape == x.shape and y.dtype == dtype
  assert cache.state.shape == (2, H, K, 2 * K) and cache.state.dtype == jnp.float32
  assert cache.conv.shape == (2, 3, 2 * H * K + H * 2 * K) and cache.conv.dtype == dtype
  y1, cache1 = nnx.jit(lambda m, x_t, c: m.step(x_t, c))(layer, x[:, 0], layer.init_cache(2))
  assert y1.shape == (2, D) and y1.dtype == dtype
  assert jax.tree.map(lambda a: (a.shape, a.dtype), cache1) == jax.tree.map(
    lambda a: (a.shape, a.dtype), cache
  )
  assert np.all(np.isfinite(np.asarray(y, np.float32)))


def test_gdp_default_dtype_follows_bf16_inputs():
  """dtype=None: bf16 activations reach the operator as bf16 (its fast kernels), not promoted to
  float32 by the float32 parameters, which stay float32."""
  seen = []
  real = functools.partial(gated_delta_product, chunk_size=16, implementation="xla")

  def spy(q, k, v, *a, **kw):
    seen.append((q.dtype, k.dtype, v.dtype))
    return real(q, k, v, *a, **kw)

  layer = gdp(operator_fn=spy)
  x = x_of(0, dtype=jnp.bfloat16)
  y = apply(layer, x)  # the spy runs when traced
  assert y.dtype == jnp.bfloat16
  assert seen == [(jnp.bfloat16,) * 3]
  assert {p.dtype for p in jax.tree.leaves(nnx.state(layer, nnx.Param))} == {jnp.dtype("float32")}
  # float32 activations keep float32 throughout.
  seen.clear()
  assert apply(layer, x.astype(jnp.float32)).dtype == jnp.float32
  assert seen == [(jnp.float32,) * 3]


@pytest.mark.parametrize(
  "mask_mode,use_short_conv,use_gate",
  [
    ("static", True, True),
    ("static", False, False),
    ("token", True, False),
    ("token", False, True),
    ("ones", True, True),
  ],
)
def test_gdp_sequence_matches_steps(mask_mode, use_short_conv, use_gate):
  layer = gdp(mask_mode=mask_mode, use_short_conv=use_short_conv, use_gate=use_gate)
  x = x_of(1)
  y, cache = layer(x, return_cache=True)
  y_steps, cache_steps = run_steps(layer, x, layer.init_cache(2))
  assert_close(y_steps, y, 2e-5, "outputs")
  assert_close(cache_steps.state, cache.state, 2e-5, "state")
  if use_short_conv:
    np.testing.assert_array_equal(cache_steps.conv, cache.conv)
  else:
    assert cache.conv is None and cache_steps.conv is None


@pytest.mark.parametrize(
  "kw",
  [
    dict(key_norm="full", allow_neg_eigval=True, num_blocks=4),
    dict(key_norm="full", mask_mode="ones", num_blocks=1),
  ],
)
def test_gdp_variants_match_steps(kw):
  layer = gdp(**kw)
  x = x_of(2, T=5)
  y_steps, _ = run_steps(layer, x, layer.init_cache(2))
  assert_close(y_steps, apply(layer, x), 2e-5, f"outputs {kw}")


def test_gdp_ragged_prefill_then_steps():
  """Right-padded prompts of lengths (3, 6): the prefill's cache continued token by token gives
  the whole-sequence outputs of each sequence; padding never touches the cache."""
  layer = gdp(mask_mode="token")
  T = 9
  x = x_of(3, T=T)
  lengths = jnp.array([3, 6], jnp.int32)
  garbage = 100.0 * x_of(4, T=T)  # padding content is ignored
  pad = jnp.arange(T)[None, :, None] >= lengths[:, None, None]
  _, cache = apply(layer, jnp.where(pad, garbage, x), lengths, return_cache=True)
  y_full = apply(layer, x)
  for b in range(2):
    n = int(lengths[b])
    row = jax.tree.map(lambda a: a[b : b + 1], cache)
    y_rest, _ = run_steps(layer, x[b : b + 1, n:], row)
    assert_close(y_rest, y_full[b : b + 1, n:], 2e-5, f"row {b} continued after {n} tokens")


def test_gdp_mask_ones_is_the_gated_delta_rule():
  """A static mask of all ones (W = ones) computes exactly what mask_mode="ones" computes (the
  r = 1 gated delta rule with unit keys): beta / rho(M) with rho = r undoes the r-fold key norm."""
  static, ones = gdp(mask_mode="static", num_blocks=4), gdp(mask_mode="ones", num_blocks=4)
  static.mask_weight[...] = jnp.ones_like(static.mask_weight[...])
  params = {k: v for k, v in nnx.state(static).items() if k != "mask_weight"}
  nnx.update(ones, nnx.State(params))
  x = x_of(11)
  assert_close(apply(static, x), apply(ones, x), 2e-5, "W = ones versus mask_mode='ones'")


@pytest.mark.parametrize("r", [2, 4])
def test_gdp_transition_eigenvalues_stay_in_range(r):
  """With block-normalised keys and beta / rho(M), the per-token transition
  I - beta/rho Kb M Kb^T has eigenvalues in [1 - beta, 1] for any mask of the layer's form."""
  layer = GatedDeltaProduct(
    D, H, 4 * r, num_blocks=r, mask_mode="token", allow_neg_eigval=True, rngs=nnx.Rngs(0)
  )
  rng = np.random.default_rng(r)
  w = jnp.asarray(rng.standard_normal((64, r, r)) * 2.0, jnp.float32)
  mask = block_mask(w)  # [64, r, r]
  scaled = layer._scale_beta(jnp.full((64,), 2.0), mask)  # beta = 2, the extreme
  kb = layer._qk_norm(jnp.asarray(rng.standard_normal((64, H * 4 * r)), jnp.float32))
  kb = np.asarray(kb)[:, 0].reshape(64, r, 4)  # head 0's key blocks
  for i in range(64):
    blocks = np.zeros((4 * r, r))
    for a in range(r):
      blocks[4 * a : 4 * a + 4, a] = kb[i, a]
    trans = np.eye(4 * r) - float(scaled[i]) * blocks @ np.asarray(mask[i]) @ blocks.T
    eig = np.linalg.eigvalsh(trans)
    assert eig.min() >= -1 - 1e-5 and eig.max() <= 1 + 1e-5, eig


@pytest.mark.parametrize("mask_mode", ["static", "token"])
def test_gdp_gradients_reach_every_parameter(mask_mode):
  layer = gdp(mask_mode=mask_mode)
  x = x_of(5)

  def loss(layer):
    return jnp.sum(jnp.sin(layer(x)))

  grads = nnx.jit(nnx.grad(loss))(layer)  # one compile instead of one per operation
  leaves = jax.tree_util.tree_leaves_with_path(nnx.state(grads, nnx.Param))
  names = {jax.tree_util.keystr(p) for p, _ in leaves}
  assert any("mask" in n for n in names) and any("conv" in n for n in names), names
  for path, g in leaves:
    assert np.all(np.isfinite(g)), jax.tree_util.keystr(path)
    assert np.any(np.asarray(g) != 0), f"zero gradient for {jax.tree_util.keystr(path)}"


def test_linen_bridge():
  """The nnx layer inside a flax.linen model through flax.nnx.bridge.to_linen (the layer over the
  operator's recurrence: the bridge is what is checked, and its programs compile fastest)."""

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.Dense(D)(x)
      x = x + bridge.to_linen(
        GatedDeltaProduct, D, H, K, num_blocks=2, implementation="reference", name="mixer"
      )(x)
      return nn.Dense(3)(x)

  net = Net()
  x = x_of(6)
  # jitted: one compile per call instead of one per operation
  variables = jax.jit(net.init)(jax.random.key(0), x)
  y = jax.jit(net.apply)(variables, x)
  assert y.shape == (2, 7, 3) and np.all(np.isfinite(y))
  assert "mixer" in variables["params"]
  grads = jax.jit(jax.grad(lambda v: jnp.sum(net.apply(v, x) ** 2)))(variables)
  mixer = jax.tree.leaves(grads["params"]["mixer"])
  assert mixer and all(np.any(np.asarray(g) != 0) for g in mixer)


@pytest.mark.parametrize(
  "kw,match",
  [
    (dict(num_blocks=3), "head_dim = 8 must be divisible by num_blocks = 3"),
    (dict(mask_mode="dynamic"), r"mask_mode must be one of \('static', 'token', 'ones'\)"),
    (dict(mask_mode="householder"), "its own layer now: gdp_jax.layers.HouseholderDeltaProduct"),
    (dict(key_norm="l1"), "key_norm must be one of"),
    (dict(expand_v=0.3), "expand_v"),
    (dict(num_blocks=0), "num_blocks must be a positive integer"),
    (dict(chunk_size=48), "chunk_size must be one of"),
    (dict(implementation="cuda"), "implementation must be"),
  ],
)
def test_gdp_bad_configuration(kw, match):
  with pytest.raises(ValueError, match=match):
    gdp(**kw)


def test_gdp_bad_inputs():
  layer = gdp()
  with pytest.raises(ValueError, match="hidden_size = 16"):
    layer(jnp.zeros((2, 5, 12)))
  with pytest.raises(ValueError, match=r"lengths has shape \(3,\)"):
    layer(jnp.zeros((2, 5, D)), jnp.array([1, 2, 3]))
  with pytest.raises(ValueError, match="one token per sequence"):
    layer.step(jnp.zeros((2, 5, D)), layer.init_cache(2))
  with pytest.raises(ValueError, match="num_heads must be a positive integer"):
    GatedDeltaProduct(D, 0, K, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("make", [gdp, lambda: attn()], ids=["gdp", "attention"])
def test_lengths_out_of_range(make):
  """Concrete lengths outside [0, T] are an error; traced ones are clipped to [0, T] (a length
  above T used to leave nan in the convolution cache, a negative one garbage)."""
  layer, T = make(), 5
  x = x_of(20, B=2, T=T)
  for bad in ([T + 3, 2], [-1, 2], np.array([2**31 + 5, 1], np.int64)):
    with pytest.raises(ValueError, match=r"lengths (must lie in \[0, T = 5\]|holds values)"):
      layer(x, jnp.asarray(bad) if isinstance(bad, list) else bad, return_cache=True)
  prefill = jax.jit(lambda x, n: layer(x, n, return_cache=True))
  y, cache = prefill(x, jnp.array([T + 3, -2]))
  y_ok, cache_ok = prefill(x, jnp.array([T, 0]))
  for got, want in zip(jax.tree.leaves(cache), jax.tree.leaves(cache_ok)):
    assert np.all(np.isfinite(np.asarray(got))), "non-finite cache"
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  y_next, _ = jit_step(layer, x[:, 0], cache)
  assert np.all(np.isfinite(np.asarray(y_next)))


@pytest.mark.parametrize("make", [gdp, lambda: attn()], ids=["gdp", "attention"])
def test_inputs_and_caches_are_checked(make):
  layer = make()
  x = x_of(21, B=2, T=3)
  with pytest.raises(TypeError, match="x must be an array .* got list"):
    layer(x.tolist())
  with pytest.raises(TypeError, match="x must be an array .* got list"):
    layer.step(x[:, 0].tolist(), None)
  with pytest.raises(TypeError, match="cache is None; start from layer.init_cache"):
    layer.step(x[:, 0], None)
  is_gdp = isinstance(layer, GatedDeltaProduct)
  other = attn().init_cache(2, 8) if is_gdp else gdp().init_cache(2)
  with pytest.raises(TypeError, match="cache must be a (GatedDeltaProductCache|KVCache)"):
    layer.step(x[:, 0], other)
  wrong_batch = layer.init_cache(3) if is_gdp else layer.init_cache(3, 8)
  with pytest.raises(ValueError, match=r"cache\.\w+ has shape \(3, .*another layer or batch"):
    layer.step(x[:, 0], wrong_batch)
  if is_gdp:  # a cache of a layer with other sizes
    with pytest.raises(ValueError, match=r"cache\.state has shape"):
      layer.step(x[:, 0], gdp(num_blocks=1, expand_v=1).init_cache(2))


@pytest.mark.parametrize("make", [gdp, lambda: attn()], ids=["gdp", "attention"])
def test_integer_x_is_a_type_error(make):
  """Token ids where activations are expected used to run as if they were activations."""
  layer = make()
  ids = jnp.ones((2, 3, D), jnp.int32)
  for call in (lambda: layer(ids), lambda: layer.step_tokens(ids, init(layer))):
    with pytest.raises(TypeError, match=r"x must be floating-point activations .* dtype int32"):
      call()
  with pytest.raises(TypeError, match=r"x must be floating-point .* dtype bool"):
    layer.step(jnp.zeros((2, D), bool), init(layer))
  assert apply(layer, ids.astype(jnp.bfloat16)).shape == (2, 3, D)  # any float dtype is fine


def init(layer):
  return layer.init_cache(2) if isinstance(layer, GatedDeltaProduct) else layer.init_cache(2, 8)


# ---- the operator callables ---------------------------------------------------------------------


def test_default_callables_are_the_operator_with_the_layer_config():
  layer = gdp(implementation="reference")
  assert layer.operator_fn.func is gated_delta_product
  assert layer.operator_fn.keywords == dict(chunk_size=16, implementation="reference")
  assert layer.step_fn.func is gated_delta_product_step
  assert layer.step_fn.keywords == dict(implementation="xla")  # "reference" has no step
  hh = householder(implementation="xla")
  assert hh.operator_fn.func is gdp_jax.householder_delta_product
  assert hh.operator_fn.keywords == dict(chunk_size=16, implementation="xla")
  assert hh.step_fn.func is gdp_jax.householder_delta_product_step


@pytest.mark.parametrize("make", [gdp, householder], ids=["gdp", "householder"])
def test_given_callables_run_every_call(make):
  """The layer calls operator_fn for the whole sequence (with cu_seqlens when packed, from the
  cached state in step_tokens) and step_fn for a step; the results are the callables'. (The
  layer on the operator's recurrence: its programs compile fastest; the wiring is the same.)"""
  make = functools.partial(make, implementation="reference")
  default = make()
  calls = []

  def spy(fn, name):
    def run(*args, **kw):
      calls.append((name, sorted(kw)))
      return fn(*args, **kw)

    return run

  layer = make(
    operator_fn=spy(default.operator_fn, "operator"), step_fn=spy(default.step_fn, "step")
  )
  x = x_of(40, T=5)
  # jitted (one compile per call instead of one per operation); the spies run when traced
  call = nnx.jit(lambda m, x: m(x, return_cache=True))
  y, cache = call(layer, x)
  y_default, cache_default = call(default, x)
  np.testing.assert_array_equal(np.asarray(y), np.asarray(y_default))
  nnx.jit(lambda m, x, cu: m(x, cu_seqlens=cu))(layer, x[:1], jnp.array([0, 2, 5], jnp.int32))
  nnx.jit(lambda m, x_t, c: m.step(x_t, c))(layer, x[:, 0], cache)
  nnx.jit(lambda m, x, c: m.step_tokens(x, c))(layer, x[:, :2], cache)
  state_kw = {"initial_state", "output_final_state"}
  assert [c[0] for c in calls] == ["operator", "operator", "step", "operator"]
  assert state_kw <= set(calls[0][1]) and "cu_seqlens" not in calls[0][1]
  assert "cu_seqlens" in calls[1][1]
  assert state_kw <= set(calls[3][1])
  # A callable that changes the result changes the layer's output.
  halved = lambda *a, **kw: jax.tree.map(lambda t: 0.5 * t, default.operator_fn(*a, **kw))
  y_halved, _ = call(make(operator_fn=halved), x)
  assert not np.allclose(np.asarray(y_halved), np.asarray(y_default))


def test_sharding_builds_the_sharded_callables():
  """sharding= is a convenience for functools.partial(sharded_gated_delta_product, sharding=...)
  and the sharded step; on one device they give the single-device results."""
  from gdp_jax.sharding import (
    ShardingConfig,
    sharded_gated_delta_product,
    sharded_gated_delta_product_step,
  )

  cfg = ShardingConfig(jax.make_mesh((1,), ("data",)), batch="data")
  layer = gdp(sharding=cfg, mask_mode="token")
  assert layer.operator_fn.func is sharded_gated_delta_product
  assert layer.operator_fn.keywords == dict(sharding=cfg, chunk_size=16, implementation="xla")
  assert layer.step_fn.func is sharded_gated_delta_product_step
  assert layer.step_fn.keywords == dict(sharding=cfg, implementation="xla")
  x = x_of(41, T=5)
  # jitted: one compile per call instead of one per operation
  call = nnx.jit(lambda m, x: m(x, return_cache=True))
  step = nnx.jit(lambda m, x_t, c: m.step(x_t, c)[0])
  one = gdp(mask_mode="token")
  y, cache = call(layer, x)
  y_one, cache_one = call(one, x)
  assert_close(y, y_one, 1e-6, "sharded layer on one device")
  assert_close(
    step(layer, x[:, 0], cache), step(one, x[:, 0], cache_one), 1e-6, "sharded step on one device"
  )
  with pytest.raises(ValueError, match="sharded_gated_delta_product takes no cu_seqlens"):
    layer(x[:1], cu_seqlens=jnp.array([0, 2, 5], jnp.int32))
  with pytest.raises(ValueError, match="pass either sharding .* or operator_fn / step_fn"):
    gdp(sharding=cfg, operator_fn=gated_delta_product)


def test_bad_callables():
  with pytest.raises(TypeError, match="operator_fn must be callable"):
    gdp(operator_fn="xla")
  with pytest.raises(TypeError, match="step_fn must be callable"):
    householder(step_fn=3)


# ---- packed documents (segment_ids) -------------------------------------------------------------


def packed(lengths, T):
  """segment_ids [1, T] of documents of `lengths` (ids 3, 4, ...), plus (start, end) of each."""
  assert sum(lengths) == T
  ids = np.repeat(np.arange(3, 3 + len(lengths)), lengths)[None].astype(np.int32)
  ends = np.cumsum(lengths)
  return jnp.asarray(ids), list(zip(ends - np.asarray(lengths), ends))


def check_packed_matches_separate(layer, T, lengths, rtol):
  """Each packed document's output equals that document run alone (right-padded in its own
  row, one call for all)."""
  x = x_of(11, B=1, T=T)
  seg, spans = packed(lengths, T)
  y = jax.jit(lambda x, s: layer(x, segment_ids=s))(x, seg)
  alone = jnp.concatenate(
    [jnp.pad(x[:, a:e], ((0, 0), (0, T - (e - a)), (0, 0))) for a, e in spans]
  )
  y_alone = jax.jit(layer)(alone)
  for i, (a, e) in enumerate(spans):
    assert_close(y[:, a:e], y_alone[i : i + 1, : e - a], rtol, f"document {i} at [{a}, {e})")


@pytest.mark.parametrize(
  "mask_mode,use_short_conv,lengths",
  [("static", True, (5, 30, 3, 26)), ("ones", False, (21, 43)), ("token", True, (1, 47, 16))],
)
def test_gdp_packed_documents_match_separate_runs(mask_mode, use_short_conv, lengths):
  layer = gdp(mask_mode=mask_mode, use_short_conv=use_short_conv)
  check_packed_matches_separate(layer, 64, lengths, 1e-4)  # float32 cumsum from -112: 1e-5


def test_gdp_document_start_resets_the_state():
  """A document start is an effective reset: exp(RESET_LOG_DECAY) is exactly 0 in float32, and
  the outputs of the second document do not change when the first one does."""
  assert float(jnp.exp(jnp.float32(layers.RESET_LOG_DECAY))) == 0.0
  layer = gdp(use_short_conv=False)
  seg, _ = packed((16, 16), 32)
  x = x_of(12, B=1, T=32)
  x2 = x.at[:, :16].set(1e3 * x_of(13, B=1, T=16))
  run = jax.jit(lambda x: layer(x, segment_ids=seg))
  y, y2 = run(x), run(x2)
  np.testing.assert_array_equal(np.asarray(y[:, 16:]), np.asarray(y2[:, 16:]))
  assert not np.allclose(np.asarray(y[:, :16]), np.asarray(y2[:, :16]))


def doc_gradients(layer):
  """A function of (lengths, T): grads[i] = d(sum sin(y) over document i) / dx, for x [1, T, D]
  packed as `lengths`, and the documents' (start, end). One jitted function per layer: segment
  ids and weights are traced, so document lengths of the same count and T share one compile."""
  loss = lambda x, s, w: jnp.sum(jnp.sin(layer(x, segment_ids=s)) * w)
  run = jax.jit(jax.vmap(jax.grad(loss), in_axes=(None, None, 0)))

  def grads(lengths, T):
    x = x_of(14, B=1, T=T)
    seg, spans = packed(lengths, T)
    weights = jnp.asarray(
      [(np.arange(T) >= a) & (np.arange(T) < e) for a, e in spans], jnp.float32
    )[:, None, :, None]  # [docs, 1, T, 1]: one doc each
    return np.abs(np.asarray(run(x, seg, weights))), spans

  return grads


@pytest.mark.parametrize(
  "implementation,lengths",
  [("xla", (16, 32, 16)), ("reference", (7, 40, 17)), ("pallas", (16, 16))],
)
def test_gdp_packed_gradients_do_not_cross_documents(implementation, lengths):
  """d(loss of one document) / d(inputs of the others) is exactly zero: documents starting at
  multiples of the chunk (16) with the chunked forms, anywhere with the recurrence. With the
  chunked form, a start inside a chunk leaves only rounding-level gradient (the documented
  limit: through the chunk's cumulative sum of g) in the earlier document."""
  T = sum(lengths)
  layer = gdp(implementation=implementation)
  cases = [(lengths, 0.0)]
  if implementation == "xla":
    cases.append(((20, 12, 32), 1e-6))
  doc_grads = doc_gradients(layer)
  for lens, bound in cases:
    grads, spans = doc_grads(lens, T)
    for i, (a, e) in enumerate(spans):
      outside = np.ones(T, bool)
      outside[a:e] = False
      inside = grads[i][:, a:e]
      assert grads[i][:, outside].max() <= bound * inside.max(), (lens, i)
      assert np.all(inside.sum(-1) > 0), f"document {i} of {lens}: dead inputs"


def test_short_conv_does_not_read_other_documents():
  conv = layers.ShortConv(3, 4, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(0), (1, 10, 3))
  seg = jnp.asarray([[0, 0, 0, 1, 1, 2, 2, 2, 2, 2]], jnp.int32)
  y = conv(x, seg)
  for a, e in ((0, 3), (3, 5), (5, 10)):
    np.testing.assert_allclose(y[:, a:e], conv(x[:, a:e]), rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(conv(x, jnp.zeros((1, 10), jnp.int32)), conv(x))


def test_segment_ids_bad_inputs():
  layer, a = gdp(), attn()
  x = x_of(0)
  for lay in (layer, a):
    with pytest.raises(ValueError, match=r"segment_ids has shape \(2, 5\), expected \[B, T\]"):
      lay(x, segment_ids=jnp.zeros((2, 5), jnp.int32))
    with pytest.raises(TypeError, match="segment_ids must be integers"):
      lay(x, segment_ids=jnp.zeros((2, 7)))
    with pytest.raises(ValueError, match="segment_ids with return_cache is not supported"):
      lay(x, segment_ids=jnp.zeros((2, 7), jnp.int32), return_cache=True)


# ---- GroupedQueryAttention ----------------------------------------------------------------------


def attn(**kw):
  return GroupedQueryAttention(D, 4, 2, 8, implementation="xla", rngs=nnx.Rngs(1), **kw)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_attention_shapes_and_dtypes(dtype):
  layer = attn(dtype=dtype, cache_dtype=dtype)
  x = x_of(7, dtype=dtype)
  y, cache = apply(layer, x, return_cache=True, cache_size=12)
  assert y.shape == x.shape and y.dtype == dtype
  assert cache.key.shape == (2, 12, 2, 8) and cache.key.dtype == dtype
  np.testing.assert_array_equal(cache.lengths, [7, 7])
  y1, cache1 = jit_step(layer, x[:, 0], cache)
  assert y1.shape == (2, D) and y1.dtype == dtype
  np.testing.assert_array_equal(cache1.lengths, [8, 8])


def test_attention_sequence_matches_steps():
  layer = attn()
  x = x_of(8)
  y_steps, cache = run_steps(layer, x, layer.init_cache(2, 16))
  assert_close(y_steps, apply(layer, x), 2e-5, "outputs")
  np.testing.assert_array_equal(cache.lengths, [7, 7])


def test_attention_ragged_prefill_then_steps():
  """Prefill of right-padded prompts (lengths 2 and 5) into a 16-slot cache, then steps: the
  stale slots (prompt padding filled with huge values) get no weight."""
  layer = attn()
  T = 9
  x = x_of(9, T=T)
  lengths = jnp.array([2, 5], jnp.int32)
  pad = jnp.arange(T)[None, :, None] >= lengths[:, None, None]
  _, cache = apply(layer, jnp.where(pad, 1e4, x), lengths, return_cache=True, cache_size=16)
  np.testing.assert_array_equal(cache.lengths, lengths)
  y_full = apply(layer, x)
  for b in range(2):
    n = int(lengths[b])
    row = jax.tree.map(lambda a: a[b : b + 1], cache)
    y_rest, row = run_steps(layer, x[b : b + 1, n:], row)
    assert_close(y_rest, y_full[b : b + 1, n:], 2e-5, f"row {b}")
    assert int(row.lengths[0]) == T


def test_attention_lengths_are_traced():
  layer = attn()
  calls = []

  @jax.jit
  def step(x_t, cache):
    calls.append(1)
    return layer.step(x_t, cache)

  cache = layer.init_cache(2, 8)
  for t in range(3):
    _, cache = step(x_of(10)[:, t], cache._replace(lengths=cache.lengths + t))
  assert len(calls) == 1


@pytest.mark.parametrize(
  "kw,match",
  [
    (dict(num_heads=4, num_kv_heads=3), "num_heads = 4 must be a multiple of num_kv_heads = 3"),
    (dict(num_heads=4, head_dim=7), "head_dim must be even for RoPE"),
    (dict(num_heads=3), "hidden_size = 16 is not divisible by num_heads = 3"),
  ],
)
def test_attention_bad_configuration(kw, match):
  with pytest.raises(ValueError, match=match):
    GroupedQueryAttention(D, rngs=nnx.Rngs(0), **kw)


def test_attention_packed_documents_match_separate_runs():
  check_packed_matches_separate(attn(), 32, (5, 20, 7), 2e-5)


def test_flash_attention_matches_xla_with_segments():
  """attention_impl="flash" (JAX's Pallas flash attention, interpreted here) against the
  jnp path: outputs and gradients with packed documents and grouped key/value heads."""
  x = x_of(16, B=2, T=32)
  seg = jnp.asarray(
    np.stack([np.repeat([0, 1, 2], [5, 20, 7]), np.repeat([4, 9], [16, 16])]), jnp.int32
  )
  ref, flash = attn(), attn(attention_impl="flash")

  def run(layer):
    y = lambda x: layer(x, segment_ids=seg)
    return jax.jit(lambda x: (y(x), jax.grad(lambda x: jnp.sum(jnp.sin(y(x))))(x)))(x)

  (y_ref, g_ref), (y_fl, g_fl) = run(ref), run(flash)
  assert_close(y_fl, y_ref, 1e-5, "outputs")
  assert_close(g_fl, g_ref, 1e-4, "gradients")
  with pytest.raises(ValueError, match="needs T a multiple of 128"):
    attn(attention_impl="flash")(x_of(0, T=130))
  with pytest.raises(ValueError, match="attention_impl must be one of"):
    attn(attention_impl="cudnn")


def test_flash_attention_lowers_for_h200(monkeypatch):
  """The flash path (forward and backward, segment ids, repeated key/value heads) goes through
  the Pallas Triton lowering for an H200."""
  from tests.triton_lowering import lower_for_h200

  layer = attn(attention_impl="flash", dtype=jnp.bfloat16)
  seg = jax.ShapeDtypeStruct((1, 64), jnp.int32)
  xs = jax.ShapeDtypeStruct((1, 64, D), jnp.bfloat16)
  fn = lambda x, s: jax.grad(lambda x: jnp.sum(layer(x, segment_ids=s).astype(jnp.float32)))(x)
  modules = lower_for_h200(monkeypatch, fn, xs, seg)
  assert len(modules) >= 3  # forward, the backward's preprocessing and its kernel(s)


# ---- several new tokens per step (step_tokens) --------------------------------------------------


def ragged_cache_and_new(layer, seed, lengths, tq, **kw):
  """x [2, T] with T = max(lengths) + tq, the prefill cache of the first lengths[b] tokens of each
  row (right-padded), and the tq tokens after them, x_new [2, tq, D]."""
  T = max(lengths) + tq
  x = x_of(seed, T=T)
  n = jnp.asarray(lengths, jnp.int32)
  _, cache = call(layer, x, n, return_cache=True, **kw)
  idx = n[:, None] + jnp.arange(tq)[None, :]
  return x, cache, jnp.take_along_axis(x, idx[..., None], axis=1)


def check_step_tokens(layer, seed, lengths, tq, rtol=2e-5, **kw):
  """step_tokens from a ragged prefill equals tq single steps (outputs and caches) and the
  whole-sequence outputs at those positions."""
  x, cache, x_new = ragged_cache_and_new(layer, seed, lengths, tq, **kw)
  y, new = call_step_tokens(layer, x_new, cache)
  assert y.shape == x_new.shape and y.dtype == x_new.dtype
  y_steps, new_steps = run_steps(layer, x_new, cache)
  assert_close(y, y_steps, rtol, "outputs versus single steps")
  assert jax.tree.structure(new) == jax.tree.structure(new_steps)
  for got, want in zip(jax.tree.leaves(new), jax.tree.leaves(new_steps)):
    assert got.shape == want.shape and got.dtype == want.dtype
    assert_close(got, want, rtol, "cache versus single steps")
  y_full = call(layer, x)
  for b, n in enumerate(lengths):
    assert_close(y[b], y_full[b, n : n + tq], rtol, f"row {b} versus the whole sequence")
  return new


@pytest.mark.parametrize(
  "make",
  [
    lambda: gdp(mask_mode="static"),
    lambda: gdp(mask_mode="token", use_gate=False),
    lambda: gdp(mask_mode="ones"),
    lambda: householder(num_householder=2),
    lambda: gdp(mask_mode="static", use_short_conv=False),
  ],
  ids=["static", "token", "ones", "householder", "no-conv"],
)
def test_gdp_step_tokens_matches_steps(make):
  check_step_tokens(make(), 30, [2, 4], 3)


def test_gdp_step_tokens_from_empty_cache_and_single_token():
  """From init_cache, Tq tokens are the whole sequence; Tq = 1 is one step."""
  layer = gdp(mask_mode="token")
  x = x_of(31, T=5)
  empty = layer.init_cache(2)
  # jitted: one compile per call instead of one per operation
  y, cache = jit_step_tokens(layer, x, empty)
  y_ref, cache_ref = apply(layer, x, return_cache=True)
  assert_close(y, y_ref, 2e-5, "outputs")
  assert_close(cache.state, cache_ref.state, 2e-5, "state")
  np.testing.assert_array_equal(cache.conv, cache_ref.conv)
  y1, c1 = jit_step_tokens(layer, x[:, :1], empty)
  y1_ref, c1_ref = jit_step(layer, x[:, 0], empty)
  assert_close(y1[:, 0], y1_ref, 2e-5, "one token")
  assert_close(c1.state, c1_ref.state, 2e-5, "one token's state")


def test_gdp_step_tokens_pallas_matches_xla():
  """The operator's Pallas kernels (interpreted off a GPU) from a cached state inside the layer
  (Tq = 3, shorter than a chunk)."""
  layer = gdp(mask_mode="token")
  _, cache, x_new = ragged_cache_and_new(layer, 37, [1, 2], 3)
  y, new = layer.step_tokens(x_new, cache)
  layer.operator_fn = functools.partial(gated_delta_product, chunk_size=16, implementation="pallas")
  y_pallas, new_pallas = layer.step_tokens(x_new, cache)
  assert_close(y_pallas, y, 2e-5, "outputs, pallas versus xla")
  assert_close(new_pallas.state, new.state, 2e-5, "state, pallas versus xla")
  np.testing.assert_array_equal(new_pallas.conv, new.conv)


def test_attention_step_tokens_matches_steps():
  layer = attn()
  new = check_step_tokens(layer, 32, [2, 5], 3, cache_size=12)
  np.testing.assert_array_equal(new.lengths, [5, 8])


def test_attention_step_tokens_lengths_are_traced():
  """Under jax.jit the lengths stay traced: new lengths do not recompile."""
  layer = attn()
  calls = []

  @jax.jit
  def step_tokens(x, cache):
    calls.append(1)
    return layer.step_tokens(x, cache)

  x, cache, x_new = ragged_cache_and_new(layer, 33, [1, 3], 2, cache_size=8)
  y, _ = step_tokens(x_new, cache)
  y_full = apply(layer, x)
  assert_close(y[1], y_full[1, 3:5], 2e-5, "row 1")
  step_tokens(x_new, cache._replace(lengths=cache.lengths + 1))
  assert len(calls) == 1


def test_attention_step_tokens_pallas_matches_xla():
  """The Pallas multi-token decode (interpreted off a GPU) inside the layer."""
  layer = attn()
  _, cache, x_new = ragged_cache_and_new(layer, 34, [1, 3], 2, cache_size=8)
  y, new = jit_step_tokens(layer, x_new, cache)
  layer.implementation = "pallas"
  y_pallas, new_pallas = jit_step_tokens(layer, x_new, cache)
  assert_close(y_pallas, y, 2e-5, "pallas versus xla")
  np.testing.assert_array_equal(new_pallas.key, new.key)


@pytest.mark.parametrize("make", [gdp, lambda: attn()], ids=["gdp", "attention"])
def test_step_tokens_inputs_are_checked(make):
  layer = make()
  is_gdp = isinstance(layer, GatedDeltaProduct)
  cache = layer.init_cache(2) if is_gdp else layer.init_cache(2, 8)
  x = x_of(35, T=3)
  with pytest.raises(ValueError, match=r"x has shape \(2, 16\), expected \[B, Tq, D\]"):
    layer.step_tokens(x[:, 0], cache)
  with pytest.raises(ValueError, match=r"x has shape \(2, 3, 8\), expected \[B, Tq, D\]"):
    layer.step_tokens(x[..., :8], cache)
  with pytest.raises(TypeError, match="cache is None"):
    layer.step_tokens(x, None)
  with pytest.raises(ValueError, match=r"cache\.\w+ has shape \(3, "):
    layer.step_tokens(x, layer.init_cache(3) if is_gdp else layer.init_cache(3, 8))


def test_attention_step_tokens_cache_too_small():
  layer = attn()
  x = x_of(36, T=3)
  with pytest.raises(ValueError, match=r"Tq = 3 new tokens but the cache's S slots hold only 2"):
    layer.step_tokens(x, layer.init_cache(2, 2))
  cache = layer.init_cache(2, 8)._replace(lengths=jnp.array([2, 6], jnp.int32))
  with pytest.raises(ValueError, match=r"cache too small: sequence 1 holds 6 tokens, and Tq = 3"):
    layer.step_tokens(x, cache)


def test_rounding_helpers_survive_excess_precision():
  """A bf16 sum read in float32 within one jitted function: XLA may compute it in float32 and
  hand on the unrounded value (x + y then .astype(float32) differs here); `as_f32` reads the bf16
  value (docs/layers.md#rounding). `rounded` rounds as bf16 does; both identities in float32."""
  from gdp_jax.layers.common import as_f32, round_to, rounded

  x = jax.random.normal(jax.random.key(0), (1000,)).astype(jnp.bfloat16)
  y = (0.01 * jax.random.normal(jax.random.key(1), (1000,))).astype(jnp.bfloat16)
  want = np.asarray(x + y).astype(np.float32) * np.float32(1.5)  # eager: a bf16 array
  np.testing.assert_array_equal(np.asarray(jax.jit(lambda x, y: as_f32(x + y) * 1.5)(x, y)), want)
  x32, y32 = x.astype(jnp.float32), y.astype(jnp.float32)
  got = jax.jit(lambda x, y: rounded(x + y, jnp.bfloat16))(x32, y32)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(x + y))
  assert round_to(x32, jnp.float32) is x32 and as_f32(x32) is x32
