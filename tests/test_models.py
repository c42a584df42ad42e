"""The hybrid LM and `generate`: whole sequence versus token by token, ragged prefill then decode,
greedy generation versus recomputing the full sequence, gradients, a training step, config
errors, and the demo command with tiny settings."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from examples.s3_demo import demo
from examples.s3_demo.__main__ import main as demo_main
from gdp_jax.__main__ import main
from gdp_jax.models import HybridConfig, HybridLM, generate
from gdp_jax.models.scan import layer_plan
from tests.cases import assert_close

VOCAB = 13


def tiny(**kw):
  args = dict(
    vocab_size=VOCAB,
    hidden_size=16,
    layer_pattern="DAD",
    num_heads=2,
    head_dim=8,
    num_blocks=2,
    mask_mode="token",
    attn_num_heads=2,
    attn_num_kv_heads=1,
    mlp_ratio=2,
    chunk_size=16,
    implementation="xla",
  )
  seed = kw.pop("rngs_seed", 0)
  args.update(kw)
  return HybridLM(HybridConfig(**args), rngs=nnx.Rngs(seed))


def tokens_of(seed, B=2, T=7):
  return jax.random.randint(jax.random.key(seed), (B, T), 0, VOCAB, jnp.int32)


@pytest.fixture(scope="module")
def model():
  return tiny()


@nnx.jit
def forward(model, tokens):
  return model(tokens)


@nnx.jit
def step(model, token, cache):
  return model.step(token, cache)


def test_shapes_and_dtypes(model):
  tokens = tokens_of(0)
  logits = forward(model, tokens)
  assert logits.shape == (2, 7, VOCAB) and logits.dtype == jnp.float32
  logits, cache = nnx.jit(lambda m, t: m.prefill(t, cache_size=16))(model, tokens)
  assert len(cache) == 3 and cache[1].key.shape == (2, 16, 1, 8)
  assert cache[0].state.shape == (2, 2, 8, 8) and cache[0].state.dtype == jnp.float32
  step_logits, _ = step(model, tokens[:, 0], model.init_cache(2, 16))
  assert step_logits.shape == (2, VOCAB) and step_logits.dtype == jnp.float32


def test_bfloat16_model_runs():
  m = tiny(dtype=jnp.bfloat16, layer_pattern="DA")
  logits = forward(m, tokens_of(1))
  assert logits.dtype == jnp.float32 and np.all(np.isfinite(logits))


def test_sequence_matches_steps(model):
  tokens = tokens_of(2)
  cache = model.init_cache(2, 16)
  outs = []
  for t in range(tokens.shape[1]):
    logits, cache = step(model, tokens[:, t], cache)
    outs.append(logits)
  assert_close(jnp.stack(outs, axis=1), forward(model, tokens), 2e-5, "logits")


def test_ragged_prefill_then_steps(model):
  """Prompts of lengths 2 and 5 right-padded to 9 (padding = another token); decoding on from
  the prefill's cache, both rows in one batch, gives the whole-sequence logits."""
  tokens = tokens_of(3, T=9)
  lengths = jnp.array([2, 5], jnp.int32)
  padded = jnp.where(jnp.arange(9)[None] < lengths[:, None], tokens, VOCAB - 1)
  _, cache = nnx.jit(lambda m, t, n: m.prefill(t, n, cache_size=16))(model, padded, lengths)
  full = forward(model, tokens)
  rows = jnp.arange(2)
  for i in range(9 - 5):  # each row is fed its own next token
    logits, cache = step(model, tokens[rows, lengths + i], cache)
    assert_close(logits, full[rows, lengths + i], 2e-5, f"decode step {i}")


def test_greedy_generation_equals_full_recompute(model):
  prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11]]
  n_new = 5
  out = np.asarray(generate(model, prompts, n_new, pad_to=16))
  assert out.shape == (3, n_new) and out.dtype == np.int32
  seqs = [list(p) + list(o) for p, o in zip(prompts, out)]
  width = max(map(len, seqs))
  batch = jnp.asarray([s + [0] * (width - len(s)) for s in seqs], jnp.int32)  # causal: pad at end
  logits = np.asarray(forward(model, batch))
  for b, (p, o) in enumerate(zip(prompts, out)):
    # Recomputing the full sequence, the argmax at each generating position is the next token.
    np.testing.assert_array_equal(np.argmax(logits[b, len(p) - 1 : len(p) + n_new - 1], -1), o)


def test_generate_array_prompts_and_sampling(model):
  tokens = np.asarray(tokens_of(4, B=2, T=6))
  greedy_list = generate(model, [tokens[0, :4].tolist(), tokens[1].tolist()], 3, pad_to=16)
  greedy_arr = generate(model, tokens, 3, lengths=[4, 6], pad_to=16)
  np.testing.assert_array_equal(greedy_list, greedy_arr)
  sampled = generate(model, tokens, 3, temperature=1.0, rng=jax.random.key(3), pad_to=16)
  assert sampled.shape == (2, 3) and np.all((0 <= sampled) & (sampled < VOCAB))
  with pytest.raises(ValueError, match="max_new_tokens must be a positive integer"):
    generate(model, tokens, 0)
  with pytest.raises(ValueError, match="lengths must lie in"):
    generate(model, tokens, 2, lengths=[0, 3])


def test_gradients_reach_every_parameter():
  m = tiny(mask_mode="static", layer_pattern="DA")
  tokens = tokens_of(5)

  def loss(m):
    return optax.softmax_cross_entropy_with_integer_labels(m(tokens), tokens).mean()

  grads = nnx.state(nnx.jit(nnx.grad(loss))(m), nnx.Param)
  leaves = jax.tree_util.tree_leaves_with_path(grads)
  assert len(leaves) == len(jax.tree.leaves(nnx.state(m, nnx.Param)))
  for path, g in leaves:
    assert np.all(np.isfinite(g)), jax.tree_util.keystr(path)
    assert np.any(np.asarray(g) != 0), f"zero gradient for {jax.tree_util.keystr(path)}"


def test_models_of_one_configuration_share_their_compiled_step():
  # the layers keep their operator in the graph definition's static part (`ValuePartial`, equal
  # by value): a second model of the same configuration traces and compiles nothing new
  traces = []

  @functools.partial(jax.jit, static_argnums=0)
  def logits(graphdef, state, tokens):
    traces.append(1)
    return nnx.merge(graphdef, state)(tokens)

  tokens = jnp.zeros((1, 8), jnp.int32)
  for seed in (0, 1):
    graphdef, state = nnx.split(tiny(layer_pattern="DHA", rngs_seed=seed))
    logits(graphdef, state, tokens)
  assert len(traces) == 1


def test_training_step_lowers_loss():
  m = tiny(layer_pattern="DA", mask_mode="static")
  tokens = tokens_of(6, B=4, T=12)
  x, y = tokens[:, :-1], tokens[:, 1:]
  graphdef, params = nnx.split(m)
  tx = optax.adam(1e-2)
  opt = tx.init(params)

  def loss(p):
    return optax.softmax_cross_entropy_with_integer_labels(nnx.merge(graphdef, p)(x), y).mean()

  @jax.jit
  def step(p, opt):
    value, g = jax.value_and_grad(loss)(p)
    updates, opt = tx.update(g, opt, p)
    return optax.apply_updates(p, updates), opt, value

  values = []
  for _ in range(6):  # the sixth step's value is the loss after five updates
    params, opt, value = step(params, opt)
    values.append(float(value))
  assert values[-1] < 0.9 * values[0], values


@pytest.mark.parametrize(
  "kw,match",
  [
    (dict(layer_pattern="DXA"), r"unknown letters \['X'\]"),
    (dict(layer_pattern=""), "layer_pattern must be a non-empty string"),
    (dict(mask_mode="full"), "mask_mode must be one of"),
    (dict(vocab_size=0), "vocab_size must be a positive integer"),
    (dict(head_dim=6, num_blocks=4), "head_dim = 6 must be divisible by num_blocks = 4"),
  ],
)
def test_bad_configuration(kw, match):
  with pytest.raises(ValueError, match=match):
    tiny(**kw)


def test_permutation_task():
  elems, table = demo.permutation_group("S3")
  assert elems.shape == (6, 3)
  e = [tuple(p) for p in elems].index((0, 1, 2))
  assert np.all(table[e] == np.arange(6)) and np.all(table[:, e] == np.arange(6))
  assert all(sorted(row) == list(range(6)) for row in table)  # a Latin square
  x = np.array([[1, 2, 3, 4]])
  y = demo.running_products(table, x)
  assert y[0, 3] == table[table[table[1, 2], 3], 4]
  signs = demo.signs_of(elems)
  assert signs.sum() == 3 and signs[e] == 0
  assert np.all(signs[table] == signs[:, None] ^ signs[None, :])  # the sign is a homomorphism
  assert demo.permutation_group("A5")[0].shape == (60, 5)
  assert not demo.signs_of(demo.permutation_group("A4")[0]).any()


def test_demo_command_runs(capsys):
  """Every part of the demo at toy sizes: two models (one layer each; the hybrid model with
  attention layers is trained in test_training_step_lowers_loss), the report and generation."""
  rc = demo_main(
    [
      "--steps",
      "2",
      "--seq-len",
      "8",
      "--batch",
      "4",
      "--eval-batch",
      "8",
      "--layers",
      "D",
      "--hidden",
      "16",
      "--head-dim",
      "8",
      "--generate",
      "2",
      "--no-baseline",
    ]
  )
  out = capsys.readouterr().out
  assert rc == 0
  assert "held-out accuracy" in out and "mask = ones" not in out
  assert "DeltaProduct n_h=2, b<2" in out
  assert "which tracks what" in out and "generated tokens correct" in out


def test_check_command_runs(capsys):
  assert main(["check", "--implementation", "xla"]) == 0
  assert "check: OK" in capsys.readouterr().out


# ---- several new tokens per step (step_tokens) --------------------------------------------------


@nnx.jit
def step_tokens(model, tokens, cache):
  return model.step_tokens(tokens, cache)


@pytest.mark.parametrize("page_size", [None, 16], ids=["dense", "paged"])
def test_step_tokens_matches_steps_and_sequence(model, page_size):
  """From the prefill of prompts of lengths 2 and 5, Tq = 3 new tokens in one step_tokens call
  give the logits and caches of 3 single steps and the whole-sequence logits."""
  from gdp_jax.models import KVCache, PagedKVCache, to_paged

  tq = 3
  tokens = tokens_of(40, T=8)
  lengths = jnp.array([2, 5], jnp.int32)
  _, cache = nnx.jit(lambda m, t, n: m.prefill(t, n, cache_size=16))(model, tokens, lengths)
  if page_size is not None:
    cache = tuple(to_paged(c, page_size) if isinstance(c, KVCache) else c for c in cache)
    assert isinstance(cache[1], PagedKVCache)
  new_tokens = jnp.take_along_axis(tokens, lengths[:, None] + jnp.arange(tq)[None], axis=1)
  logits, new = step_tokens(model, new_tokens, cache)
  assert logits.shape == (2, tq, VOCAB) and logits.dtype == jnp.float32
  outs, cache_steps = [], cache
  for i in range(tq):
    out, cache_steps = step(model, new_tokens[:, i], cache_steps)
    outs.append(out)
  assert_close(logits, jnp.stack(outs, axis=1), 2e-5, "logits versus single steps")
  assert jax.tree.structure(new) == jax.tree.structure(cache_steps)
  for got, want in zip(jax.tree.leaves(new), jax.tree.leaves(cache_steps)):
    assert got.shape == want.shape and got.dtype == want.dtype
    assert_close(got, want, 2e-5, "cache versus single steps")
  np.testing.assert_array_equal(new[1].lengths, lengths + tq)
  full = forward(model, tokens)
  for b in range(2):
    n = int(lengths[b])
    assert_close(logits[b], full[b, n : n + tq], 2e-5, f"row {b} versus the whole sequence")


def test_step_tokens_householder_layers():
  """An "HA" model (a DeltaProduct layer) from an empty cache equals its whole-sequence call."""
  m = tiny(layer_pattern="HA", mask_mode="static", mlp_ratio=0)
  tokens = tokens_of(41, T=5)
  logits, cache = nnx.jit(lambda m, t, c: m.step_tokens(t, c))(m, tokens, m.init_cache(2, 8))
  assert_close(logits, forward(m, tokens), 2e-5, "logits")
  np.testing.assert_array_equal(cache[1].lengths, [5, 5])


def test_tokens_are_checked(model):
  """Ids outside the vocabulary used to give all-NaN logits, float tokens an error from inside
  flax: now a ValueError naming the id, its position and the vocabulary, and a TypeError
  naming the argument and the dtype. Traced ids are not checked (documented)."""
  tokens = np.asarray(tokens_of(3))
  for bad, pos in ((VOCAB, (1, 4)), (-1, (0, 2))):
    t = tokens.copy()
    t[pos] = bad
    for call in (lambda: model(t), lambda: model(jnp.asarray(t)), lambda: model.prefill(t)):
      with pytest.raises(
        ValueError,
        match=rf"tokens holds id {bad} at position \[{pos[0]}, "
        rf"{pos[1]}\], outside \[0, vocab_size = {VOCAB}\)",
      ):
        call()
  with pytest.raises(ValueError, match=rf"token holds id {VOCAB + 5} at position \[1\]"):
    model.step(jnp.asarray([0, VOCAB + 5]), model.init_cache(2, 8))
  for dtype in (jnp.float32, jnp.bool_):
    with pytest.raises(
      TypeError, match=rf"tokens must be integer token ids .* dtype {dtype.__name__}"
    ):
      model(tokens.astype(dtype))
  with pytest.raises(TypeError, match="tokens must be integer token ids .* dtype float"):
    model.step_tokens(tokens.astype(np.float32), model.init_cache(2, 16))
  # Traced: unchecked; an id >= vocab_size gives NaN logits from its position on (docstring).
  t = tokens.copy()
  t[0, 3] = VOCAB
  logits = np.asarray(forward(model, jnp.asarray(t)))
  assert np.isnan(logits[0, 3]).all() and np.isfinite(logits[1]).all()


def test_step_tokens_errors(model):
  from gdp_jax.models import to_paged

  # traced, not run: the checks read the caches' concrete lengths (closed over), and nothing
  # before them compiles
  def step_tokens(tokens, cache):
    return jax.eval_shape(lambda t: model.step_tokens(t, cache), tokens)

  cache = model.init_cache(2, 16)
  with pytest.raises(ValueError, match=r"tokens has shape \(2,\), expected \[B, Tq\]"):
    step_tokens(tokens_of(42)[:, 0], cache)
  with pytest.raises(TypeError, match="one entry per layer"):
    step_tokens(tokens_of(42), cache[:2])
  full = tuple(c._replace(lengths=c.lengths + 12) if hasattr(c, "lengths") else c for c in cache)
  with pytest.raises(ValueError, match=r"cache too small: sequence 0 holds 12 tokens, and Tq = 7"):
    step_tokens(tokens_of(42), full)
  paged = tuple(to_paged(c, 16) if hasattr(c, "lengths") else c for c in full)
  with pytest.raises(ValueError, match=r"cache too small: .* the cache's pages"):
    step_tokens(tokens_of(42), paged)


# ---- layers scanned (scan_layers) ----------------------------------------------------------------


def _max_diff(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  return max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.mark.slow  # eight programs compiled
def test_scanned_layers_equal_unrolled():
  """ "DDADDA" (the unit "DDA" twice, in it "D" twice) under `jax.lax.scan` and layer by layer,
  the same parameters: gradients, prefill logits and caches, generate (its decode steps), and
  step_tokens' check of the caches' room. The delta layers run the operator's recurrence
  ("reference"; their steps the jnp step): what is checked is the stacking of the layers, and the
  recurrence's gradient compiles in about a third of the time of the chunked form's."""
  unrolled, scanned = (
    tiny(layer_pattern="DDADDA", scan_layers=False, implementation="reference"),
    tiny(layer_pattern="DDADDA", scan_layers=True, implementation="reference"),
  )
  assert unrolled.scan_plan is None and scanned.scan_plan == (2, (("D", 2), ("A", 1)))
  assert _max_diff(nnx.state(unrolled), nnx.state(scanned)) == 0  # one layout of parameters
  tokens = tokens_of(50, T=9)

  def loss(m):
    return jnp.mean(m(tokens) ** 2)

  grads = [nnx.state(nnx.jit(nnx.grad(loss))(m), nnx.Param) for m in (unrolled, scanned)]
  assert _max_diff(*grads) < 1e-5 and max(np.abs(g).max() for g in jax.tree.leaves(grads[0])) > 0
  lengths = jnp.array([4, 9], jnp.int32)
  prefill = nnx.jit(lambda m, t, n: m.prefill(t, n, cache_size=16))
  out = [prefill(m, tokens, lengths) for m in (unrolled, scanned)]
  assert len(out[1][1]) == 6 and _max_diff(*out) < 1e-5  # logits and the per-layer caches
  with pytest.raises(ValueError, match="cache too small"):  # checked before the scan
    jax.eval_shape(lambda t: scanned.step_tokens(t, out[1][1]), tokens[:, :8])
  prompts = [[1, 2, 3], [4]]
  np.testing.assert_array_equal(
    generate(unrolled, prompts, 4, pad_to=16), generate(scanned, prompts, 4, pad_to=16)
  )


def _count(jaxpr, name):
  n = 0
  for eqn in jaxpr.eqns:
    n += eqn.primitive.name == name
    for value in eqn.params.values():  # the sub-programs: scan bodies, pjit, custom_vjp
      for item in value if isinstance(value, (tuple, list)) else (value,):
        sub = getattr(item, "jaxpr", item)
        if hasattr(sub, "eqns"):
          n += _count(sub, name)
  return n


def test_scanned_program_does_not_grow_with_depth():
  # each distinct layer traced once: twice the layers, the same matmuls in the program
  def dots(pattern, scan):
    graphdef, state = nnx.split(tiny(layer_pattern=pattern, scan_layers=scan))
    jaxpr = jax.make_jaxpr(lambda s: nnx.merge(graphdef, s)(tokens_of(0)))(state)
    return _count(jaxpr.jaxpr, "dot_general")

  assert dots("DA" * 4, None) == dots("DA" * 2, None) < dots("DA" * 2, False)
  assert dots("DA" * 4, False) > dots("DA" * 2, False)
  unrolled, scanned = (
    tiny(layer_pattern="DADA", scan_layers=False),
    tiny(layer_pattern="DADA", scan_layers=True),
  )
  assert_close(forward(scanned, tokens_of(51)), forward(unrolled, tokens_of(51)), 1e-5, "logits")
  with pytest.raises(ValueError, match="scan_layers must be None, True or False"):
    tiny(scan_layers="yes")


def _scans(jaxpr):
  """The scan equations of a jaxpr and of the jaxprs nested in it, outermost first."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "scan":
      yield eqn
    for value in eqn.params.values():
      for item in value if isinstance(value, (tuple, list)) else (value,):
        sub = getattr(item, "jaxpr", item)
        if hasattr(sub, "eqns"):
          yield from _scans(sub)


def test_one_scan_level_and_a_backward_that_keeps_the_kernels_outputs():
  """The layers' scans (docs/train_lm.md#compile-time): never nested ("DDADDA": one scan of two
  units; "DDA", one unit: its run "DD" scanned alone, with the unrolled logits); and under a
  gradient the backward's scan of "DD" runs the operator's backward kernels only (its forward's
  outputs kept, not recomputed: `models.scan.saveable`)."""
  assert layer_plan("DDADDA").scans() == (((0, 1, 2), (3, 4, 5)),)
  unrolled, scanned = (tiny(layer_pattern="DDA", scan_layers=s) for s in (False, True))
  assert scanned.scan_plan.scans() == (((0,), (1,)), ((2,),))
  assert_close(forward(scanned, tokens_of(52)), forward(unrolled, tokens_of(52)), 1e-5, "logits")
  graphdef, state = nnx.split(tiny(layer_pattern="DD", scan_layers=True, implementation="pallas"))
  loss = lambda s: jnp.sum(nnx.merge(graphdef, s)(tokens_of(0, T=16)))
  jaxpr = jax.make_jaxpr(jax.grad(loss))(state).jaxpr
  layers = [e.params["jaxpr"].jaxpr for e in _scans(jaxpr) if e.params["length"] == 2]
  assert [_count(body, "pallas_call") for body in layers] == [2, 7]  # forward, backward
